"""The training data: the built-in corpus, a user's text file, and micro-batches as pure functions of (iteration,
micro-batch)."""

from __future__ import annotations

import pytest
import torch

from recycle.data import builtin_corpus
from recycle.errors import ConfigError
from recycle.runtime.worker.data import check_data, data_source


def test_builtin_corpus_is_deterministic_text() -> None:
    data = builtin_corpus()
    assert data == builtin_corpus()
    assert len(data) > 100_000
    data.decode("utf-8")


def test_microbatch_is_a_pure_function_of_iteration_and_mb(tiny_config) -> None:
    load = data_source(tiny_config())
    a_tokens, a_targets = load(3, 5)
    b_tokens, _ = load(3, 5)
    c_tokens, _ = load(3, 6)
    d_tokens, _ = load(4, 5)
    assert a_tokens.shape == (2, 8) and a_tokens.dtype == torch.int64
    assert torch.equal(a_tokens, b_tokens)
    assert not torch.equal(a_tokens, c_tokens) and not torch.equal(a_tokens, d_tokens)
    assert torch.equal(a_tokens[:, 1:], a_targets[:, :-1])  # targets are the next bytes
    # The micro-batches every earlier run (and the correctness tests' references) trained on.
    assert a_tokens.tolist() == [[101, 32, 119, 97, 105, 116, 115, 32], [105, 118, 97, 116, 105, 111, 110, 32]]


def test_user_text_file_and_its_errors(tmp_path, tiny_config) -> None:
    text = tmp_path / "t.txt"
    text.write_text("héllo wörld " * 20, encoding="utf-8")
    assert len(data_source(tiny_config(dataset=str(text))).stream) == len(("héllo wörld " * 20).encode())
    with pytest.raises(ConfigError, match="not a file"):
        data_source(tiny_config(dataset=str(tmp_path / "missing.txt")))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok" + b"\xff\xfe\x00" * 50)
    with pytest.raises(ConfigError, match="not UTF-8 text \\(byte 2"):
        check_data(tiny_config(dataset=str(bad)))
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ConfigError, match="seq_len = 8"):
        data_source(tiny_config(dataset=str(short)))
