"""Tensor parallel inside a worker (D x S x T processes, gloo on CPU): exact against the single-process reference
fault-free (1F1B) and with a worker down (adaptive plan), and the whole worker fenced when one of its TP ranks is
SIGKILLed mid-step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from recycle.config import Config
from recycle.ir import Plan
from recycle.runtime.control.launcher import TrainResult, launch
from recycle.runtime.options import (ClusterOptions, DebugOptions, FaultOptions, LaunchOptions, OutputOptions,
                                     RecoveryOptions)
from recycle.runtime.tools.faults import parse_fault
from recycle.runtime.tools.reference import reference_train
from recycle.schedules.fault_free import build_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def with_tp(config: Config, degree: int) -> Config:
    return replace(config, topology=replace(config.topology, gpus_per_worker=degree))


def train(config: Config, plan: Plan, tmp_path, faults: FaultOptions = FaultOptions(),
          provider: object = None) -> tuple[dict[str, torch.Tensor], TrainResult]:
    save = tmp_path / "final.pt"
    options = LaunchOptions(outputs=OutputOptions(save_path=str(save)), debug=DebugOptions(verify_replicas=True),
                            recovery=RecoveryOptions(timeout_s=30), faults=faults,
                            cluster=ClusterOptions(start_method="forkserver"), progress=None)
    if provider is not None:
        options = replace(options, plan_provider=provider)
    result = launch(config, plan, options)
    return torch.load(save, weights_only=True)["model"], result


def max_relative_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert got.keys() == ref.keys()
    return max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) for k in ref)


def check(config: Config, plan: Plan, tmp_path, **kwargs) -> TrainResult:
    got, result = train(config, plan, tmp_path, **kwargs)
    ref, ref_losses = reference_train(config)
    assert max_relative_error(got, ref) < 1e-9
    assert [round(s.loss, 6) for s in result.steps] == [round(x, 6) for x in ref_losses]
    assert len(result.steps) == config.training.steps
    return result


def test_fault_free_1f1b_d2_s2_t2_matches_reference(tiny_config, tmp_path) -> None:
    config = with_tp(tiny_config(seed=11), 2)
    result = check(config, build_schedule(config, "1f1b"), tmp_path)
    for metrics in result.steps:  # the TP rank 0 shards of both replicas of a stage stay bit-identical
        for s in range(2):
            assert metrics.digests[f"0:{s}"] == metrics.digests[f"1:{s}"]
