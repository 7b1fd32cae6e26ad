"""DCP checkpoints on real gloo processes: a run with a warm-up + cosine schedule checkpoints at step 4; resuming it
with the same D x S is bit-identical to the uninterrupted run, and with S = 4 or S = 1 (the layers re-partitioned)
equal to 1e-9 in float64, with the learning rate continuing where it was; the checkpoint loads into the plain
single-process model, and --save writes safetensors."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from recycle.config import parse_config
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import LaunchOptions, with_keywords
from recycle.runtime.state import checkpoint
from recycle.runtime.tools.reference import reference_train
from recycle.schedules.fault_free import build_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def config(S: int, D: int = 2, M: int = 2):
    return parse_config({
        "topology": {"num_replicas": D, "num_stages": S},
        "workload": {"num_microbatches": M, "microbatch_size": 2, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"preset": "tiny"},
        "training": {"steps": 6, "lr": 0.01, "weight_decay": 0.1, "dtype": "float64", "seed": 5,
                     "lr_schedule": "cosine", "warmup_steps": 2, "min_lr": 0.001},
    }, name=f"dcp-{D}x{S}")


def train(cfg, tmp_path, save: str, **extra) -> dict[str, torch.Tensor]:
    options = with_keywords(LaunchOptions(), dict(save_path=str(tmp_path / save), timeout_s=30, progress=None,
                                                  start_method="forkserver", **extra))
    launch(cfg, build_schedule(cfg, "zb-h1", staggered=True), options)
    assert not mp.active_children()
    return checkpoint.load_model_state(tmp_path / save)


def assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> None:
    assert got.keys() == want.keys()
    for key in want:
        error = float((got[key] - want[key]).abs().max() / want[key].abs().max().clamp_min(1e-12))
        assert error < tol, (key, error)


def test_resume_same_layout_bit_identical_and_repartitioned_to_1e9(tmp_path) -> None:
    ck = tmp_path / "ck"
    two = config(S=2)
    full = train(two, tmp_path, "full.pt", checkpoint_dir=str(ck), checkpoint_every=4)
    assert (ck / "latest").read_text().strip() == "step000004"
    reference, _ = reference_train(two)
    assert_close(full, reference, 1e-9)
    # The checkpoint loads into the plain single-process model, equal to the reference after 4 steps.
    at_four = checkpoint.load_full_model(ck, two).state_dict()
    assert_close(at_four, reference_train(two, steps=4)[0], 1e-9)

    resumed = train(two, tmp_path, "resumed.pt", resume_dir=str(ck))
    assert all(torch.equal(resumed[k], full[k]) for k in full)  # exact resume: bit for bit

    for S, D, M in ((4, 1, 4), (1, 2, 2)):  # D x M stays 4 micro-batches: the global batch is the same
        cfg = config(S=S, D=D, M=M)
        got = train(cfg, tmp_path, f"s{S}.safetensors", resume_dir=str(ck))
        assert_close(got, reference, 1e-9)
        assert got.keys() == load_file(str(tmp_path / f"s{S}.safetensors")).keys()

    # A wrong learning rate after the resume would show: the same resume with a constant schedule differs.
    constant = replace(two, training=replace(two.training, lr_schedule="constant", warmup_steps=0))
    other = train(constant, tmp_path, "constant.pt", resume_dir=str(ck))
    assert max(float((other[k] - full[k]).abs().max()) for k in full) > 1e-6
