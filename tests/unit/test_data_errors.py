"""Bad data through `recycle train` (issue 24): each case exits 2 with one `error:` line naming the file and the
rule, before any worker starts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

TOML = """[topology]
num_replicas = 1
num_stages = 2
[workload]
num_microbatches = 2
microbatch_size = 2
seq_len = 8
[costs]
forward = 1
backward_input = 1
backward_weight = 1
[training]
steps = 1
{training}
"""


def train(cli_error, config_path: str, *args: str) -> str:
    """The error line of `recycle train` on the config (no plan store: the data is checked before any worker)."""
    return cli_error(["train", "--no-recover", "--config", config_path, *args])


def config(tmp_path: Path, training: str) -> str:
    path = tmp_path / "job.toml"
    path.write_text(TOML.format(training=training))
    return str(path)


def ids_file(tmp_path: Path, ids, dtype: str = "uint16", name: str = "train.bin") -> Path:
    path = tmp_path / name
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def test_a_token_id_beyond_the_vocabulary_is_named_with_its_position(tmp_path, cli_error) -> None:
    ids = [5] * 1000
    ids[617] = 300  # the tiny model's vocabulary is 256
    path = ids_file(tmp_path, ids)
    line = train(cli_error, config(tmp_path, f'dataset = "{path}"\ntoken_dtype = "uint16"'))
    assert str(path) in line and "token id 300 at position 617" in line and "vocabulary of 256" in line


def test_a_file_size_not_a_multiple_of_the_dtype(tmp_path, cli_error) -> None:
    path = tmp_path / "train.bin"
    path.write_bytes(b"\x01\x00" * 100 + b"\x01")
    line = train(cli_error, config(tmp_path, f'dataset = "{path}"\ntoken_dtype = "uint16"'))
    assert str(path) in line and "201 bytes, not a multiple of 2" in line


def test_a_bin_file_without_token_dtype_is_not_read_as_bytes(tmp_path, cli_error) -> None:
    path = ids_file(tmp_path, [65] * 1000)  # every id below 128: valid UTF-8, yet not text
    line = train(cli_error, config(tmp_path, f'dataset = "{path}"'))
    assert "train.bin" in line and "token_dtype = 'uint16'" in line


def test_a_too_short_corpus(tmp_path, cli_error) -> None:
    path = ids_file(tmp_path, [1, 2, 3, 4, 5], "uint32")
    line = train(cli_error, config(tmp_path, f'dataset = "{path}"\ntoken_dtype = "uint32"'))
    assert str(path) in line and "has 5 tokens" in line and "seq_len = 8" in line


def test_an_unknown_token_dtype(tmp_path, cli_error) -> None:
    line = train(cli_error, config(tmp_path, 'dataset = "x.bin"\ntoken_dtype = "int8"'))
    assert "[training] token_dtype = 'int8' must be 'uint16' or 'uint32'" in line


def test_a_dataset_without_the_named_column(tmp_path, cli_error) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "hf"
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict({"tokens": [[1, 2, 3] * 10] * 4}).save_to_disk(str(folder))
    line = train(cli_error, config(tmp_path, f'dataset = "{folder}"\ndataset_column = "ids"'))
    assert str(folder) in line and "no column 'ids'" in line and "'tokens'" in line
    line = train(cli_error, config(tmp_path, f'dataset = "{folder}"'))  # the default: input_ids
    assert "no column 'input_ids'" in line


def test_a_missing_tokenizer_and_a_bad_data_source(tmp_path, cli_error) -> None:
    text = tmp_path / "t.txt"
    text.write_text("words " * 100)
    line = train(cli_error, config(tmp_path, f'dataset = "{text}"\ntokenizer = "nope.json"'))
    assert "[training] tokenizer = 'nope.json' is not a file" in line
    line = train(cli_error, config(tmp_path, ""), "--data-source", "os:getcwd")
    assert "data source 'os:getcwd' takes ()" in line
    line = train(cli_error, config(tmp_path, ""), "--data-source", "no_such_module_x:f")
    assert "cannot import 'no_such_module_x'" in line
