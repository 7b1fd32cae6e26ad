"""Pretrained weights in: a Hugging Face model starts from a local safetensors file or save_pretrained folder (made
here from a tiny config; nothing downloaded), each stage reading only its own tensors, with one-line errors for
weights that do not fit the run's model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from recycle.config import load_config
from recycle.errors import ConfigError
from recycle.models import hf_weights
from recycle.models.hf import build_hf_model, check_hf_model
from recycle.runtime.worker.stage import build_stage, check_model

pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402  (transformers' dependency)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TOML = """
[topology]
num_replicas = 2
num_stages = 2
[workload]
num_microbatches = 2
microbatch_size = 2
seq_len = 16
[costs]
forward = 1
backward_input = 1
backward_weight = 1
[model]
hf_config = {hf!r}
hf_weights = {weights!r}
[training]
dtype = "float64"
seed = 4
"""


def saved_model(tmp_path: Path, family: str, seed: int = 11, **save: object) -> Path:
    """A save_pretrained folder of the tiny example model of `family`, initialised from `seed`."""
    folder = tmp_path / f"pretrained-{family}"
    build_hf_model(EXAMPLES / f"hf-tiny-{family}.json", 16, seed, torch.float32).model.save_pretrained(folder, **save)
    return folder


def run_config(tmp_path: Path, hf: str | Path, weights: str | Path = "") -> object:
    path = tmp_path / "run.toml"
    path.write_text(TOML.format(hf=str(hf), weights=str(weights)))
    return load_config(path)


def file_tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_each_stage_starts_from_the_files_tensors(tmp_path, family: str) -> None:
    folder = saved_model(tmp_path, family)
    expected = file_tensors(folder)
    config = run_config(tmp_path, folder)  # --hf DIR: the folder's config.json and weights
    check_model(config)
    seen: dict[str, torch.Tensor] = {}
    for stage in range(2):
        for key, value in build_stage(config, stage).module.state_dict().items():
            seen[key.removeprefix("model.")] = value  # the stages keep the HF names under "model."
    assert sorted(seen) == sorted(expected)
    for key, value in expected.items():  # float32 in the file, float64 in the run: the same values
        assert value.dtype == torch.float32 and seen[key].dtype == torch.float64
        assert torch.equal(seen[key], value.double()), key
    random = build_hf_model(EXAMPLES / f"hf-tiny-{family}.json", 16, 4, torch.float64).model.state_dict()
    assert not any(torch.equal(random[k], seen[k]) for k in seen if k.endswith("proj.weight"))


def test_a_lone_safetensors_file_or_a_sharded_folder_gives_the_same_weights(tmp_path) -> None:
    folder = saved_model(tmp_path, "llama")
    expected = file_tensors(folder)
    sharded = saved_model(tmp_path / "sharded", "llama", max_shard_size="20KB")
    assert (sharded / hf_weights.INDEX_FILE).is_file() and len(list(sharded.glob("*.safetensors"))) > 1
    json_config = EXAMPLES / "hf-tiny-llama.json"
    for config in (run_config(tmp_path, json_config, folder / "model.safetensors"),
                   run_config(tmp_path, json_config, sharded), run_config(tmp_path, sharded)):
        check_model(config)
        last = build_stage(config, 1).module.state_dict()
        assert torch.equal(last["model.lm_head.weight"], expected["lm_head.weight"].double())


def test_a_stage_reads_only_its_own_tensors(tmp_path, monkeypatch) -> None:
    folder = saved_model(tmp_path, "llama")
    read: list[str] = []
    real_open = hf_weights._safe_open

    class Counting:
        def __init__(self, handle: object) -> None:
            self.handle = handle

        def __enter__(self) -> Counting:
            self.handle.__enter__()  # type: ignore[attr-defined]
            return self

        def __exit__(self, *exc: object) -> None:
            self.handle.__exit__(*exc)  # type: ignore[attr-defined]

        def __getattr__(self, attr: str) -> object:  # keys, get_slice: headers only
            return getattr(self.handle, attr)

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self.handle.get_tensor(name)  # type: ignore[attr-defined]

    monkeypatch.setattr(hf_weights, "_safe_open", lambda path, source: Counting(real_open(path, source)))
    build_stage(run_config(tmp_path, folder), 0)
    assert read and "model.embed_tokens.weight" in read
    assert all(n.startswith(("model.embed_tokens.", "model.layers.0.", "model.layers.1.")) for n in read), read
    assert len(read) == len(set(read))


def test_weights_that_do_not_fit_are_one_clear_error(tmp_path) -> None:
    folder = saved_model(tmp_path, "llama")
    tensors = file_tensors(folder)
    config_json = EXAMPLES / "hf-tiny-llama.json"

    missing = dict(tensors)
    del missing["model.layers.2.mlp.up_proj.weight"]
    save_file(missing, tmp_path / "missing.safetensors")
    with pytest.raises(ConfigError, match=r"have no tensor 'model\.layers\.2\.mlp\.up_proj\.weight'"):
        check_hf_model(config_json, 2, 16, tmp_path / "missing.safetensors")

    wrong = dict(tensors, **{"model.norm.weight": torch.ones(31)})
    save_file(wrong, tmp_path / "wrong.safetensors")
    with pytest.raises(ConfigError, match=r"tensor 'model\.norm\.weight' has shape \[31\] but the model of the run's "
                                          r"Hugging Face config needs \[32\]"):
        check_hf_model(config_json, 2, 16, tmp_path / "wrong.safetensors")

    extra = dict(tensors, **{"model.layers.4.mlp.up_proj.weight": torch.ones(2)})
    save_file(extra, tmp_path / "extra.safetensors")
    with pytest.raises(ConfigError, match=r"hold tensors the model .* does not have: \['model\.layers\.4\.mlp"):
        check_hf_model(config_json, 2, 16, tmp_path / "extra.safetensors")

    other = json.loads(config_json.read_text()) | {"intermediate_size": 48}
    (tmp_path / "other.json").write_text(json.dumps(other))
    with pytest.raises(ConfigError, match=r"comes? with a config\.json that disagrees with the run's Hugging Face "
                                          r"config .*intermediate_size = 64 there, 48 in the run's"):
        check_hf_model(tmp_path / "other.json", 2, 16, folder)

    with pytest.raises(ConfigError, match=r"hold neither model\.safetensors nor model\.safetensors\.index\.json"):
        check_hf_model(config_json, 2, 16, tmp_path)

    config_only = tmp_path / "config-only"  # --hf DIR means from_pretrained(DIR): the weights must be there
    config_only.mkdir()
    (config_only / "config.json").write_text(config_json.read_text())
    with pytest.raises(ConfigError, match=r"hold neither .*or, for a random init, give the config JSON itself"):
        check_model(run_config(tmp_path, config_only))


def test_cli_weights_that_do_not_fit_are_one_error_line(tmp_path, capsys) -> None:
    from recycle.cli import main

    folder = saved_model(tmp_path, "gpt2")
    tensors = file_tensors(folder)
    del tensors["transformer.h.3.attn.c_proj.bias"]
    save_file(tensors, tmp_path / "missing.safetensors")
    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-gpt.toml")
    capsys.readouterr()  # save_pretrained's progress bar
    code = main(["train", "--config", tiny, "--hf", str(EXAMPLES / "hf-tiny-gpt2.json"), "--hf-weights",
                 str(tmp_path / "missing.safetensors"), "--max-failures", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error:"), err
    assert "have no tensor 'transformer.h.3.attn.c_proj.bias'" in err[0] and "missing.safetensors" in err[0], err


def test_weights_without_a_hugging_face_model_are_refused(tmp_path) -> None:
    path = tmp_path / "run.toml"
    path.write_text(TOML.format(hf="", weights=str(tmp_path)))
    with pytest.raises(ConfigError, match=r"hf_weights = .* needs the Hugging Face model they are for"):
        check_model(load_config(path))


def test_a_folder_without_config_json_is_named(tmp_path) -> None:
    from recycle.models.hf import resolve_hf_path

    with pytest.raises(ConfigError, match=r"is a folder without config\.json"):
        resolve_hf_path(str(tmp_path))
    assert os.path.basename(resolve_hf_path(str(saved_model(tmp_path, "gpt2")))) == "config.json"


def test_relative_weights_are_found_beside_the_config_file(tmp_path, monkeypatch) -> None:
    folder = saved_model(tmp_path, "gpt2")
    config = run_config(tmp_path, EXAMPLES / "hf-tiny-gpt2.json", folder.name)  # relative to run.toml's folder
    monkeypatch.chdir(EXAMPLES)  # not where the weights are
    check_model(config)
    head = build_stage(config, 1).module.state_dict()["model.lm_head.weight"]
    assert torch.equal(head, file_tensors(folder)["lm_head.weight"].double())


def test_a_tied_models_files_start_both_ends_from_the_one_embedding(tmp_path) -> None:
    """save_pretrained writes a tied model's shared weight once (no lm_head.weight): the last stage's lm_head
    copy is read from the embedding's tensor, and the files pass the check though the meta model names both."""
    raw = json.loads((EXAMPLES / "hf-tiny-llama.json").read_text())
    raw["tie_word_embeddings"] = True
    tied = tmp_path / "tied.json"
    tied.write_text(json.dumps(raw))
    folder = tmp_path / "pretrained"
    build_hf_model(tied, 16, 11, torch.float32).model.save_pretrained(folder)
    expected = file_tensors(folder)
    assert "lm_head.weight" not in expected
    config = run_config(tmp_path, folder)
    check_model(config)
    first, last = (build_stage(config, stage).module.state_dict() for stage in range(2))
    embedding = expected["model.embed_tokens.weight"].double()
    assert torch.equal(first["model.model.embed_tokens.weight"], embedding)
    assert torch.equal(last["model.lm_head.weight"], embedding)
    random = build_stage(run_config(tmp_path, tied), 1).module.state_dict()["model.lm_head.weight"]
    assert not torch.equal(random, embedding)
