"""The config's dataset: a relative [training] dataset path is found beside the config file, from any directory."""

from __future__ import annotations

import pytest

from recycle.config import load_config
from recycle.errors import ConfigError
from recycle.runtime.worker.data import config_stream


def _config(folder, dataset: str):
    path = folder / "job.toml"
    path.write_text("[topology]\nnum_replicas = 1\nnum_stages = 2\n[workload]\nnum_microbatches = 2\nseq_len = 8\n"
                    "[costs]\nforward = 1\nbackward_input = 1\nbackward_weight = 1\n"
                    f"[training]\ndataset = {dataset!r}\n")
    return load_config(path)


def test_relative_dataset_resolves_beside_the_config(tmp_path, monkeypatch) -> None:
    (tmp_path / "corpus.txt").write_text("some text to train on, long enough for a few windows\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    dataset = config_stream(_config(tmp_path, "corpus.txt"))
    assert dataset.source == str(tmp_path / "corpus.txt") and len(dataset) == 53
    with pytest.raises(ConfigError, match=r"\[training\] dataset = 'missing.txt' \(\S+/missing.txt\) is not a file"):
        config_stream(_config(tmp_path, "missing.txt"))
