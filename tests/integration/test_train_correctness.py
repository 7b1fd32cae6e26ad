"""Real multi-process training (gloo, CPU) ends with the single-process reference's parameters, for fault-free
schedules and adaptive plans with a worker down, staggered and coupled; replicas stay bit-identical every step."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from recycle.ir import Plan
from recycle.runtime.control.launcher import TrainResult, launch
from recycle.runtime.options import ClusterOptions, DebugOptions, LaunchOptions, OutputOptions, RecoveryOptions
from recycle.runtime.tools.reference import reference_train
from recycle.schedules.fault_free import build_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def adaptive_plan(config, down: set[tuple[int, int]], staggered: bool, decoupled: bool = True) -> Plan:
    from recycle.planner.api import make_plan  # the test may use the planner; the runtime never does
    from recycle.planner.options import PlannerOptions

    return make_plan(config, frozenset(down), options=PlannerOptions(decoupled=decoupled, staggered=staggered),
                     solver="heuristic")


def train(config, plan: Plan, tmp_path) -> tuple[dict[str, torch.Tensor], TrainResult]:
    save = tmp_path / "final.pt"
    # forkserver: torch is imported once per test session instead of once per worker per launch.
    result = launch(config, plan, LaunchOptions(outputs=OutputOptions(save_path=str(save)),
                                                debug=DebugOptions(verify_replicas=True),
                                                recovery=RecoveryOptions(timeout_s=30),
                                                cluster=ClusterOptions(start_method="forkserver"), progress=None))
    return torch.load(save, weights_only=True)["model"], result


def max_relative_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert got.keys() == ref.keys()
    return max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) for k in ref)


def check(config, plan: Plan, tmp_path, tol: float = 1e-9) -> None:
    got, result = train(config, plan, tmp_path)
    ref, ref_losses = reference_train(config)
    assert max_relative_error(got, ref) < tol
    # The losses as summed by the workers and by the reference, in their own orders: equal to float64 rounding, and
    # to a few float32 ulps in float32 (a comparison of rounded decimals flipped with the CPU's float32 kernels).
    loss_rel = 1e-12 if config.training.dtype == "float64" else 1e-6
    assert [s.loss for s in result.steps] == pytest.approx(ref_losses, rel=loss_rel)
    assert len(result.steps) == config.training.steps
    for metrics in result.steps:  # bit-identical replicas after every step
        for s in range(plan.num_stages):
            digests = {metrics.digests[f"{p}:{s}"] for p in plan.live_replicas(s)}
            assert len(digests) == 1, (metrics.step, s)
        assert {int(w.split(":")[0]) * plan.num_stages + int(w.split(":")[1]) for w in metrics.digests} == \
            set(plan.live_ranks())


@pytest.mark.parametrize("schedule,staggered", [("1f1b", False), ("1f1b-decoupled", True), ("zb-h1", True)])
def test_fault_free_schedules_match_reference(tiny_config, schedule: str, staggered: bool, tmp_path) -> None:
    config = tiny_config(seed=11)
    check(config, build_schedule(config, schedule, staggered=staggered), tmp_path)


@pytest.mark.parametrize("D,staggered", [(2, True), (2, False), (3, True)])
def test_worker_down_from_the_start_matches_reference(tiny_config, D: int, staggered: bool, tmp_path) -> None:
    """--down 1:1: stage 1's micro-batches of pipeline 1 run on one peer (D=2) or are split over two (D=3)."""
    config = tiny_config(D=D, seed=11)
    plan = adaptive_plan(config, {(1, 1)}, staggered=staggered)
    assert plan.failed == {(1, 1)} and not plan.actions[plan.rank(1, 1)]
    rerouted_hosts = {plan.host[1][mb] for mb in range(config.num_microbatches, 2 * config.num_microbatches)}
    assert 1 not in rerouted_hosts
    check(config, plan, tmp_path)


def test_float32_matches_reference_closely(tiny_config, tmp_path) -> None:
    config = tiny_config(dtype="float32", seed=11)
    # Adam turns float32 noise in mathematically-zero gradients into steps of up to lr: compare to the scale.
    check(config, build_schedule(config, "zb-h1", staggered=True), tmp_path, tol=1e-3)


def test_dropout_masks_follow_the_microbatch_not_the_host(tiny_config, tmp_path) -> None:
    """With dropout on, a re-routed micro-batch draws the same masks on its new host: the fault-free and the
    adaptive run end with the same parameters (to summation order), and dropout really changed the result."""
    base = tiny_config(seed=11)
    config = replace(base, model=replace(base.model, dropout=0.2))
    fault_free, _ = train(config, build_schedule(config, "zb-h1", staggered=True), tmp_path)
    adaptive, _ = train(config, adaptive_plan(config, {(1, 1)}, staggered=True), tmp_path)
    assert max_relative_error(adaptive, fault_free) < 1e-9
    no_dropout, _ = reference_train(base)
    assert max_relative_error(fault_free, no_dropout) > 1e-6
