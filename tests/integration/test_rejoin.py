"""Workers come back: a replacement re-joins at an iteration boundary with its stage's state from a live replica,
and a stage that lost every replica is restored from the latest checkpoint with respawned workers. Every run ends
with exactly the fault-free parameters (float64) and no process left behind."""

from __future__ import annotations

import functools
import multiprocessing as mp

import pytest
import torch
from reference_check import LONG_RUN_TOLERANCE

from recycle.config import parse_config
from recycle.errors import RuntimeFailure
from recycle.planner.options import PlannerOptions
from recycle.planner.provider import PlanLibrary
from recycle.runtime.control.launcher import TrainResult, launch
from recycle.runtime.options import (CheckpointOptions, ClusterOptions, DebugOptions, FaultOptions, LaunchOptions,
                                     OutputOptions, RecoveryOptions, with_keywords)
from recycle.runtime.tools.faults import FaultInjection
from recycle.runtime.tools.reference import reference_train
from recycle.runtime.worker.emulate import Emulation
from recycle.schedules.fault_free import build_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150), pytest.mark.timing]

STEPS = 10
PACING = Emulation(20.0, 1.0)  # 20 ms per slot: a step lasts ~0.3 s, so a replacement is up before the run ends


@functools.lru_cache(maxsize=None)
def config_for(D: int, S: int):
    return parse_config({
        "topology": {"num_replicas": D, "num_stages": S},
        "workload": {"num_microbatches": S, "microbatch_size": 2, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"preset": "tiny"},
        "training": {"steps": STEPS, "lr": 0.01, "weight_decay": 0.1, "dtype": "float64", "seed": 3},
    }, name=f"rejoin-{D}x{S}")


@functools.lru_cache(maxsize=None)
def reference(D: int, S: int) -> dict[str, torch.Tensor]:
    return reference_train(config_for(D, S))[0]


def run(D: int, S: int, tmp_path, faults=(), rejoins=(), **extra) -> TrainResult:
    config = config_for(D, S)
    plan = build_schedule(config, "zb-h1", staggered=True)
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=D * S)
    extra.setdefault("start_method", "forkserver")
    options = with_keywords(LaunchOptions(), dict(
        save_path=str(tmp_path / "final.pt"), verify_replicas=True, timeout_s=30, progress=None,
        plan_provider=library.lookup, emulation=PACING, faults=tuple((plan.rank(*w), f) for w, f in faults),
        rejoins=tuple((plan.rank(*w), step - 1) for w, step in rejoins), **extra))
    return launch(config, plan, options)


def assert_exact(result: TrainResult, tmp_path, D: int, S: int, tolerance: float = 1e-9) -> None:
    got = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    ref = reference(D, S)
    for key in ref:
        error = float((got[key] - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-12))
        assert error < tolerance, (key, error)
    assert [m.step for m in result.steps][-1] == STEPS
    assert not mp.active_children()


def joins(result: TrainResult) -> list[str]:
    return [w for r in result.recoveries for w in r.joined]


def test_rejoin_after_one_kill(tmp_path) -> None:
    result = run(2, 2, tmp_path, faults=[((1, 1), FaultInjection(1, 3))], rejoins=[((1, 1), 4)])
    assert_exact(result, tmp_path, 2, 2)
    assert result.failed == ()
    kill, join = result.recoveries
    assert kill.workers == ("1:1",) and join.joined == ("1:1",) and not join.causes
    assert join.transfer_bytes > 0 and join.redone_actions == 0  # admitted at an iteration boundary
    assert join.resumed_s < 5


@pytest.mark.parametrize("first,second", [((1, 1), (2, 1)), ((1, 0), (2, 1))], ids=["same-stage", "two-stages"])
def test_rejoin_after_two_kills(first, second, tmp_path) -> None:
    result = run(3, 2, tmp_path, faults=[(first, FaultInjection(1, 2)), (second, FaultInjection(2, 1))],
                 rejoins=[(first, 5), (second, 5)])
    assert_exact(result, tmp_path, 3, 2)
    assert result.failed == ()
    assert sorted(joins(result)) == sorted(f"{p}:{s}" for p, s in (first, second))


def test_rejoin_while_another_worker_dies(tmp_path) -> None:
    """Worker 0:0 dies as the others stop to admit 1:1: one recovery handles both."""
    result = run(2, 2, tmp_path, faults=[((1, 1), FaultInjection(1, 3)), ((0, 0), FaultInjection(3, point="recovery"))],
                 rejoins=[((1, 1), 5)])
    assert_exact(result, tmp_path, 2, 2)
    assert result.failed == ((0, 0),)
    assert joins(result) == ["1:1"]
    assert any("0:0" in r.workers and "1:1" in r.joined for r in result.recoveries)


def test_respawn_after_brings_a_dead_worker_back(tmp_path) -> None:
    result = run(2, 2, tmp_path, faults=[((0, 1), FaultInjection(1, 2))], respawn_after_s=0.5)
    assert_exact(result, tmp_path, 2, 2)
    assert result.failed == () and joins(result) == ["0:1"]


@pytest.mark.parametrize("policy", ["reshape", "respawn"])
def test_lost_stage_is_restored_from_the_latest_checkpoint(tmp_path, policy: str) -> None:
    """Both replicas of stage 1 die (the second after a checkpoint of step 4). reshape: worker 1:0 (stage 0 has a
    replica to spare) moves into slot 1:1; respawn: a replacement process for 0:1 starts. Either way every worker
    loads that checkpoint and the run redoes the lost steps to the same parameters."""
    result = run(2, 2, tmp_path, faults=[((1, 1), FaultInjection(2, 3)), ((0, 1), FaultInjection(5, 2))],
                 checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2, stage_loss=policy)
    assert_exact(result, tmp_path, 2, 2)
    restore = next(r for r in result.recoveries if r.restored_step is not None)
    # The newest complete checkpoint when the second replica died: step 4's, unless its write (after the step, off
    # the training path) or the records saying so had not come in yet on a loaded machine: then step 2's (seen once
    # in CI under two pytest processes), and the run redoes more steps to the same parameters.
    if restore.restored_step == 4:
        assert restore.steps_lost == 1 and restore.step == 5, restore
    else:
        assert restore.restored_step == 2 and restore.steps_lost >= 1, restore
    if policy == "reshape":
        assert restore.moved == (((1, 0), (1, 1)),) and restore.joined == ("1:1",)
        assert "worker 1:0 moved to stage 1 as 1:1 (reshape)" in restore.line()
        assert result.failed == ((0, 1), (1, 0))  # two live workers, one per stage: the job runs on
    else:
        assert restore.moved == () and result.failed == ()  # both dead slots respawned
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == f"step{STEPS:06d}"
    assert not list((tmp_path / "ckpt").rglob("*.tmp"))


@pytest.mark.parametrize("policy", ["reshape", "respawn"])
def test_a_stage_lost_before_any_checkpoint_completes_restores_the_start(tmp_path, policy: str) -> None:
    """Issue 21 item 7: both replicas of stage 1 die at step 2 and 3, before the first checkpoint (every 6 steps) is
    written. The initial state is a pure function of the seed, so the run restores step 0 and redoes everything,
    rather than stopping with "no checkpoint is complete yet"."""
    result = run(2, 2, tmp_path, faults=[((1, 1), FaultInjection(1, 3)), ((0, 1), FaultInjection(2, 2))],
                 checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=6, stage_loss=policy)
    assert_exact(result, tmp_path, 2, 2)
    restore = next(r for r in result.recoveries if r.restored_step is not None)
    assert restore.restored_step == 0 and restore.step == 1 and restore.steps_lost >= 2
    assert "restored checkpoint step 0" in restore.line()


def test_reshape_evens_out_the_live_workers_across_stages(tmp_path) -> None:
    """D=4, S=2: stage 1 loses all four replicas (three at step 2, the last after the checkpoint of step 4). Two
    stage-0 workers move into stage 1 of their own pipelines, so the run goes on 2 + 2 (a D' = 2 layout, global
    batch unchanged) rather than 3 + 1, and ends with the fault-free parameters."""
    stage1 = [((replica, 1), FaultInjection(2, 1)) for replica in range(3)]
    result = run(4, 2, tmp_path, faults=stage1 + [((3, 1), FaultInjection(5, 2))],
                 checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_every=2)
    assert_exact(result, tmp_path, 4, 2)
    restore = next(r for r in result.recoveries if r.restored_step is not None)
    assert restore.moved == (((3, 0), (3, 1)), ((2, 0), (2, 1))) and sorted(restore.joined) == ["2:1", "3:1"]
    assert result.failed == ((0, 1), (1, 1), (2, 0), (3, 0))


def test_lost_stage_without_a_checkpoint_stops_with_a_clear_error(tmp_path) -> None:
    with pytest.raises(RuntimeFailure, match="last live replica of stage 1.*writes no checkpoints.*--checkpoint-dir"):
        run(2, 2, tmp_path, faults=[((1, 1), FaultInjection(1, 3)), ((0, 1), FaultInjection(3, 2))])
    assert not mp.active_children()


def test_a_short_chaos_soak_ends_exact(tmp_path) -> None:
    """Random kills, hangs and a whole-stage loss, each repaired, in one run (benchmarks/bench_chaos.py is the long
    version)."""
    from recycle.runtime.tools.chaos import ChaosSpec

    config = config_for(3, 2)
    result = launch(config, build_schedule(config, "zb-h1", staggered=True), LaunchOptions(
        outputs=OutputOptions(save_path=str(tmp_path / "final.pt")),
        checkpoint=CheckpointOptions(dir=str(tmp_path / "ckpt"), every=2),
        recovery=RecoveryOptions(timeout_s=20, heartbeat_timeout_s=1.0, heartbeat_s=0.25),
        cluster=ClusterOptions(start_method="forkserver"),
        faults=FaultOptions(chaos=ChaosSpec(4, 0.6, stage_loss_share=0.3)),
        debug=DebugOptions(verify_replicas=True, emulation=PACING), progress=None,
        plan_provider=PlanLibrary.build(config, PlannerOptions(), max_failures=4).lookup))
    assert_exact(result, tmp_path, 3, 2, tolerance=LONG_RUN_TOLERANCE)  # random recoveries: see reference_check
    injected = [w for e in result.chaos_events for w in e["workers"]]
    recovered = [w for r in result.recoveries for w in r.workers]
    assert len(result.chaos_events) >= 1 and sorted(injected) == sorted(recovered)
    assert not list((tmp_path / "ckpt").rglob("*.tmp"))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("point", ["ready", "admitted", "formed", "transfer"])
def test_a_replacement_that_dies_during_its_admission_is_survived(point: str, tmp_path, monkeypatch) -> None:
    """Worker 0:1 is killed; its replacement (--respawn-after) SIGKILLs itself at `point` of its admission (right
    after it says it is ready, once admitted, with the groups formed, as its state arrives); the next replacement
    gets in and the run ends exactly (issue 21 item 2: the launcher crashed in the first case)."""
    steps = 30  # long enough for two replacements to start
    monkeypatch.setenv("RECYCLE_TEST_JOINER_DIES", f"{point}:{tmp_path / 'died'}")
    result = run(2, 2, tmp_path, faults=[((0, 1), FaultInjection(1, 2))], respawn_after_s=0.3, steps=steps)
    assert (tmp_path / "died").exists()  # the first replacement did die at that point
    got = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    ref = reference_train(config_for(2, 2), steps)[0]
    for key in ref:  # 30 steps with recoveries: see reference_check
        error = float((got[key] - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-12))
        assert error < LONG_RUN_TOLERANCE, (key, error)
    assert not mp.active_children()
    assert result.failed == () and joins(result)[-1] == "0:1"
