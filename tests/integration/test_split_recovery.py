"""Split plans on real gloo processes: a fault-free run switched to a plan that cuts the dead worker's micro-batches
into pieces after a SIGKILL, and a kill during a piece's own action, end with the single-process reference's
parameters (float64, 1e-9) and held-out losses; the recovery of a split plan redoes the whole iteration."""

from __future__ import annotations

import functools
import json
import multiprocessing as mp

import pytest
import torch

from recycle.config import parse_config
from recycle.ir import Kind, Plan
from recycle.planner.api import make_plan
from recycle.planner.options import PlannerOptions
from recycle.planner.provider import PlanLibrary
from recycle.runtime.control.launcher import TrainResult, launch
from recycle.runtime.options import LaunchOptions, with_keywords
from recycle.runtime.tools.faults import FaultInjection
from recycle.runtime.tools.reference import reference_train
from recycle.schedules.fault_free import build_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

SPLIT = PlannerOptions(split_microbatches=True)


@functools.lru_cache(maxsize=None)
def config():
    """D=3, S=2, M=3 micro-batches of 6 samples: one dead worker leaves 3 micro-batches for 2 survivors."""
    return parse_config({
        "topology": {"num_replicas": 3, "num_stages": 2},
        "workload": {"num_microbatches": 3, "microbatch_size": 6, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"preset": "tiny"},
        "training": {"steps": 2, "lr": 0.01, "weight_decay": 0.1, "dtype": "float64", "seed": 5,
                     "eval_every": 1, "eval_batches": 1, "eval_fraction": 0.2},
    }, name="split-recovery")


def run(plan: Plan, faults: list[tuple[tuple[int, int], FaultInjection]], tmp_path) -> TrainResult:
    library = PlanLibrary.build(config(), SPLIT, max_failures=2)
    options = with_keywords(LaunchOptions(), dict(
        save_path=str(tmp_path / "final.pt"), metrics_path=str(tmp_path / "metrics.jsonl"), verify_replicas=True, timeout_s=30, progress=None,
        start_method="forkserver", plan_provider=library.lookup, faults=tuple((plan.rank(*w), f) for w, f in faults)))
    return launch(config(), plan, options)


def assert_exact(result: TrainResult, tmp_path) -> None:
    got = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    evaluations: dict[int, float] = {}
    ref = reference_train(config(), evaluations=evaluations)[0]
    records = map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())
    evals = {r["step"]: r["loss"] for r in records if r.get("event") == "eval"}
    assert sorted(evals) == sorted(evaluations) == [1, 2]
    for step, loss in evals.items():  # the held-out loss, forwarded along the split plans' routing
        assert abs(loss - evaluations[step]) <= 1e-9 * abs(evaluations[step]), (step, loss)
    assert got.keys() == ref.keys()
    for key in ref:
        error = float((got[key] - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-12))
        assert error < 1e-9, (key, error)
    assert [m.step for m in result.steps] == [1, 2]
    assert not mp.active_children()


def test_a_fault_free_run_switches_to_a_split_plan_after_a_kill(tmp_path) -> None:
    plan = build_schedule(config(), "zb-h1", staggered=True)
    after = make_plan(config(), {(0, 1)}, SPLIT)
    assert after.pieces, after.meta.notes  # the state the kill leads to has a split plan
    worker = (0, 1)
    index = next(i for i, a in enumerate(plan.actions[plan.rank(*worker)]) if a.kind is Kind.B)
    result = run(plan, [(worker, FaultInjection(1, index))], tmp_path)
    assert_exact(result, tmp_path)
    (recovery,) = result.recoveries
    assert recovery.workers == ("0:1",) and "killed by SIGKILL" in recovery.causes[0]
    assert recovery.plan_source == "store"


def test_a_kill_during_a_split_pieces_action(tmp_path) -> None:
    """The run starts on the split plan for 0:0 down; worker 0:1 dies before the forward of an extra piece (an id
    past D x M), and the run goes on with the split plan for 0:0 and 0:1 down."""
    plan = make_plan(config(), {(0, 0)}, SPLIT)
    total = plan.total_microbatches
    worker = (0, 1)
    acts = plan.actions[plan.rank(*worker)]
    index = next(i for i, a in enumerate(acts) if a.kind is Kind.F and a.mb >= total)
    assert plan.pieces[acts[index].mb].samples < plan.microbatch_size
    result = run(plan, [(worker, FaultInjection(1, index))], tmp_path)
    assert_exact(result, tmp_path)
    (recovery,) = result.recoveries
    assert recovery.workers == ("0:1",)
    assert f"during {acts[index]}" in recovery.causes[0]  # the kill landed inside the piece's action
    assert recovery.kept.endswith("a plan splits micro-batches into pieces")  # --redo lost falls back
    assert result.failed == ((0, 0), (0, 1))
