"""Training on the user's data (issue 24): `recycle train` on a nanoGPT-style token file, and `train(data_source=)`
with a source of one's own, each exact against the whole model trained in one process on the same micro-batches."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from recycle import api
from recycle.config import load_config
from recycle.data import DataSource
from recycle.runtime.tools.reference import reference_train

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def max_relative_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    return max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-30)) for k in ref)


def test_train_on_a_token_file(tmp_path: Path, tiny_config_file) -> None:
    np.random.default_rng(1).integers(0, 256, size=20_000).astype(np.uint16).tofile(tmp_path / "train.bin")
    path = tiny_config_file(steps=3, training='dataset = "train.bin"\ntoken_dtype = "uint16"\n'
                                             'data_order = "epochs"\neval_fraction = 0.1')
    save = tmp_path / "final.pt"
    run = subprocess.run([sys.executable, "-m", "recycle", "train", "--config", str(path), "--save", str(save),
                          "--no-recover"], cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr
    assert "step 3/3 loss" in run.stdout
    ref, _ = reference_train(load_config(path))
    assert max_relative_error(torch.load(save, weights_only=True)["model"], ref) < 1e-9


def counting_source(config) -> DataSource:
    """A user's source: windows of a fixed arithmetic sequence, offset by the micro-batch's number."""
    size, seq = config.workload.microbatch_size, config.workload.seq_len

    def load(iteration: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = torch.arange(size)[:, None] * 3 + iteration * 11 + mb * 5
        window = (start + torch.arange(seq + 1)[None, :]) % 256
        return window[:, :-1], window[:, 1:]
    return load


def test_train_with_a_users_data_source(tmp_path: Path, tiny_config_file) -> None:
    config = load_config(tiny_config_file(steps=2))
    save = tmp_path / "final.pt"
    api.train(config, schedule="zb-h1", recover=False, data_source=counting_source, save_path=str(save),
              progress=None)
    ref, _ = reference_train(load_config(tiny_config_file(steps=2, training=f'data_source = "{__name__}:'
                                                                           'counting_source"')))
    assert max_relative_error(torch.load(save, weights_only=True)["model"], ref) < 1e-9
