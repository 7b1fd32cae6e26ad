"""The data sources (issue 24): token files, a tokenizer-backed text, a Hugging Face dataset on disk and a user's
source each feed the same micro-batches whichever worker loads them; epochs and the held-out tail; flat memory."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest
import torch

from recycle.data import DataSource, builtin_corpus
from recycle.data.windows import permute
from recycle.errors import ConfigError
from recycle.runtime.worker.data import check_data, data_source

KEYS = [(it, mb) for it in range(3) for mb in range(4)]


def write_tokens(path: Path, ids, dtype: str = "uint16") -> Path:
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def make_tokenizer(path: Path) -> Path:
    """A tiny byte-level BPE (vocabulary 200) trained here on the built-in corpus; nothing downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=200, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(builtin_corpus(400).decode().splitlines(), trainer)
    tok.save(str(path))
    return path


def batches(config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    load = data_source(config)
    return [load(it, mb) for it, mb in KEYS]


def _in_worker(config) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(config)


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Iterator[dict[str, dict]]:
    """[training] keys of one source of each kind, over the same corpus where the kind allows (the Hugging Face
    dataset only where the datasets package is installed)."""
    root = tmp_path_factory.mktemp("sources")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RECYCLE_DATA_CACHE", str(root / "cache"))  # the spawned workers inherit it
        yield _sources(root)


def _sources(root: Path) -> dict[str, dict]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, size=5000)
    text = root / "corpus.txt"
    text.write_bytes(builtin_corpus(300))
    out = {
        "builtin": {},
        "text": {"dataset": str(text)},
        "uint16": {"dataset": str(write_tokens(root / "train.bin", ids)), "token_dtype": "uint16"},
        "uint32": {"dataset": str(write_tokens(root / "train32.bin", ids, "uint32")), "token_dtype": "uint32"},
        "tokenizer": {"dataset": str(text), "tokenizer": str(make_tokenizer(root / "tokenizer.json"))},
        "epochs": {"data_order": "epochs", "eval_fraction": 0.1},
    }
    try:
        import datasets
    except ImportError:
        return out
    datasets.disable_progress_bars()
    folder = root / "hf"
    datasets.Dataset.from_dict({"input_ids": [list(ids[i:i + 500]) for i in range(0, 5000, 500)],
                                "text": builtin_corpus(300).decode().splitlines()[:10]}).save_to_disk(str(folder))
    out["hf_ids"] = {"dataset": str(folder)}
    out["hf_text"] = {"dataset": str(folder), "tokenizer": out["tokenizer"]["tokenizer"]}
    return out


def test_every_source_feeds_the_same_microbatches_in_every_worker(sources, tiny_config) -> None:
    configs = {name: tiny_config(**keys) for name, keys in sources.items()}
    here = {name: batches(c) for name, c in configs.items()}
    with multiprocessing.get_context("spawn").Pool(2) as pool:  # other processes, as the workers are
        there = dict(zip(configs, pool.map(_in_worker, list(configs.values()))))
    for name in configs:
        check_data(configs[name])
        for (a, b), (c, d) in zip(here[name], there[name]):
            assert a.shape == (2, 8) and a.dtype == torch.int64, name
            assert torch.equal(a, c) and torch.equal(b, d), name
            assert torch.equal(a[:, 1:], b[:, :-1]), name
    # A token file reads exactly its ids; the same ids as uint32 and through a dataset's token column too.
    assert all(torch.equal(x[0], y[0]) for x, y in zip(here["uint16"], here["uint32"]))
    if "hf_ids" in here:
        assert all(torch.equal(x[0], y[0]) for x, y in zip(here["uint16"], here["hf_ids"]))
    ids = np.fromfile(sources["uint16"]["dataset"], dtype=np.uint16)
    first = here["uint16"][0][0][0].numpy()
    assert any(np.array_equal(ids[o:o + 8], first) for o in range(len(ids) - 8))


def test_tokenizer_source_holds_the_tokenizers_ids(sources, tiny_config) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(sources["tokenizer"]["tokenizer"])
    text = Path(sources["text"]["dataset"]).read_text()
    expected = [i for line in text.splitlines(keepends=True) for i in tok.encode(line, add_special_tokens=False).ids]
    assert data_source(tiny_config(**sources["tokenizer"])).stream.tokens.tolist() == expected


def test_epochs_visit_every_window_once_in_a_seeded_order(tiny_config) -> None:
    assert sorted(permute(i, 1000, 3) for i in range(1000)) == list(range(1000))
    assert [permute(i, 1000, 3) for i in range(10)] != [permute(i, 1000, 4) for i in range(10)]
    config = tiny_config(data_order="epochs", eval_fraction=0.25)  # D x M = 4 micro-batches of 2 per iteration
    load = data_source(config)
    windows = (int(len(load.stream) * 0.75) - 1) // 8
    seen = [o for it in range(windows // 8 + 1) for mb in range(4) for o in load._offsets(it, mb)]
    assert sorted(seen[:windows]) == list(range(0, windows * 8, 8))  # one epoch: every disjoint window once
    assert torch.equal(load(0, 0)[0][0], torch.from_numpy(load.stream.tokens[seen[0]:seen[0] + 8].astype(np.int64)))
    other = data_source(tiny_config(data_order="epochs", eval_fraction=0.25, seed=8))
    assert not torch.equal(load(0, 0)[0], other(0, 0)[0])  # the order comes from the seed


def test_the_held_out_tail_is_never_trained_on(tmp_path, tiny_config) -> None:
    train = data_source(tiny_config(eval_fraction=0.5))
    held = data_source(tiny_config(eval_fraction=0.5), split="eval")
    cut = len(train.stream) - int(len(train.stream) * 0.5)
    assert all(o + 9 <= cut for it in range(20) for mb in range(4) for o in train._offsets(it, mb))
    assert all(o >= cut for it in range(20) for mb in range(4) for o in held._offsets(it, mb))
    assert torch.equal(held(0, 0)[0], held(0, 0)[0])
    short = tmp_path / "short.txt"
    short.write_text("x" * 100)
    with pytest.raises(ConfigError, match="fewer than one window"):
        data_source(tiny_config(dataset=str(short), eval_fraction=0.01))


def user_source(config) -> DataSource:
    """A user's source: constant token ids of the micro-batch's number."""
    size, seq = config.workload.microbatch_size, config.workload.seq_len

    def load(iteration: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.full((size, seq + 1), (iteration * 7 + mb) % 256, dtype=torch.int64)
        return tokens[:, :-1], tokens[:, 1:]
    return load


def test_a_users_source_by_name(tiny_config) -> None:
    load = data_source(tiny_config(data_source=f"{__name__}:user_source"))
    assert torch.equal(load(2, 3)[0], torch.full((2, 8), 17))
    with pytest.raises(ConfigError, match="has no function 'nope'"):
        data_source(tiny_config(data_source=f"{__name__}:nope"))
    with pytest.raises(ConfigError, match="both say where the data comes from"):
        tiny_config(data_source=f"{__name__}:user_source", dataset="x.txt")


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_memory_stays_flat_for_a_large_token_file(tmp_path, tiny_config) -> None:
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(200 * 1024 * 1024)  # 100 M uint16 ids (zeros: a sparse file, so the test writes nothing)
    config = tiny_config(dataset=str(big), token_dtype="uint16")
    before = _rss_mb()
    check_data(config)  # the whole-file scan for ids >= the vocabulary
    load = data_source(config)
    for it in range(50):
        for mb in range(4):
            load(it, mb)
    assert _rss_mb() - before < 20
