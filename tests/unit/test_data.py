"""The training data: the built-in corpus, a user's text file, and micro-batches as pure functions of (iteration,
micro-batch)."""

from __future__ import annotations

import pytest
import torch

from recycle.errors import ConfigError
from recycle.runtime.data import builtin_corpus, load_dataset, microbatch


def test_builtin_corpus_is_deterministic_text() -> None:
    data = builtin_corpus()
    assert data == builtin_corpus()
    assert len(data) > 100_000
    data.decode("utf-8")


def test_microbatch_is_a_pure_function_of_iteration_and_mb() -> None:
    ds = load_dataset("builtin", 8)
    a_tokens, a_targets = microbatch(ds, 3, 5, 2, 8)
    b_tokens, _ = microbatch(ds, 3, 5, 2, 8)
    c_tokens, _ = microbatch(ds, 3, 6, 2, 8)
    d_tokens, _ = microbatch(ds, 4, 5, 2, 8)
    assert a_tokens.shape == (2, 8) and a_tokens.dtype == torch.int64
    assert torch.equal(a_tokens, b_tokens)
    assert not torch.equal(a_tokens, c_tokens) and not torch.equal(a_tokens, d_tokens)
    assert torch.equal(a_tokens[:, 1:], a_targets[:, :-1])  # targets are the next bytes


def test_user_text_file_and_its_errors(tmp_path) -> None:
    text = tmp_path / "t.txt"
    text.write_text("héllo wörld " * 20, encoding="utf-8")
    ds = load_dataset(str(text), 8)
    assert len(ds) == len(("héllo wörld " * 20).encode())
    with pytest.raises(ConfigError, match="not a file"):
        load_dataset(str(tmp_path / "missing.txt"), 8)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00" * 50)
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_dataset(str(bad), 8)
    short = tmp_path / "short.txt"
    short.write_text("abc")
    with pytest.raises(ConfigError, match="seq_len = 8"):
        load_dataset(str(short), 8)
