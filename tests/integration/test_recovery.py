"""A worker's death mid-run on real gloo processes: the run goes on without a restart and ends with exactly the
fault-free parameters, whatever the moment of the kill (forward, input-gradient, weight-gradient, the stage
all-reduce, between two stages' optimizer steps, during a checkpoint write), for a hang, for successive kills and
for a kill during a recovery; no worker process is left behind."""

from __future__ import annotations

import functools
import multiprocessing as mp

import pytest
import torch

from recycle.config import parse_config
from recycle.ir import Kind, Plan
from recycle.planner.options import PlannerOptions
from recycle.planner.provider import PlanLibrary
from recycle.runtime.control.launcher import TrainResult, launch
from recycle.runtime.options import LaunchOptions, with_keywords
from recycle.runtime.state.checkpoint import load_model_state
from recycle.runtime.tools.faults import FaultInjection
from recycle.runtime.tools.reference import reference_train
from recycle.schedules.fault_free import build_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.timing]

KILL_STEP = 1  # 0-based: the kill lands in the second of three steps


@functools.lru_cache(maxsize=None)
def config_for(D: int, S: int, grad_clip: float = 0.0):
    return parse_config({
        "topology": {"num_replicas": D, "num_stages": S},
        "workload": {"num_microbatches": S, "microbatch_size": 2, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"preset": "tiny"},
        "training": {"steps": 3, "lr": 0.01, "weight_decay": 0.1, "dtype": "float64", "seed": 5,
                     "grad_clip": grad_clip},
    }, name=f"recovery-{D}x{S}")


@functools.lru_cache(maxsize=None)
def reference(D: int, S: int, grad_clip: float = 0.0, steps: int | None = None) -> dict[str, torch.Tensor]:
    return reference_train(config_for(D, S, grad_clip), steps)[0]


def action_index(plan: Plan, worker: tuple[int, int], what: str) -> int:
    """Index in the worker's action list of its first F / B / W, or its OPT (the stage all-reduce)."""
    kind = {"F": Kind.F, "B": Kind.B, "W": Kind.W, "OPT": Kind.OPT}[what]
    return next(i for i, a in enumerate(plan.actions[plan.rank(*worker)]) if a.kind is kind)


def run(config, faults: list[tuple[tuple[int, int], FaultInjection]], tmp_path, **extra) -> TrainResult:
    plan = build_schedule(config, "zb-h1", staggered=True)
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=config.num_replicas * config.num_stages)
    options = with_keywords(LaunchOptions(), dict(
        save_path=str(tmp_path / "final.pt"), verify_replicas=True, timeout_s=30, progress=None,
        start_method="forkserver", plan_provider=library.lookup, faults=tuple((plan.rank(*w), f) for w, f in faults),
        **extra))
    return launch(config, plan, options)


def assert_exact(result: TrainResult, tmp_path, D: int, S: int, grad_clip: float = 0.0) -> None:
    got = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    ref = reference(D, S, grad_clip)
    assert got.keys() == ref.keys()
    for key in ref:
        error = float((got[key] - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-12))
        assert error < 1e-9, (key, error)
    assert [m.step for m in result.steps] == [1, 2, 3]
    assert not mp.active_children()


MATRIX_2x2 = [(stage, what) for stage in range(2) for what in ("F", "B", "W", "OPT")]
MATRIX_3x3 = [(stage, what) for stage in range(3) for what in ("F", "B", "W", "OPT")]


@pytest.mark.parametrize("stage,what", MATRIX_2x2)
def test_kill_matrix_2x2(stage: int, what: str, tmp_path) -> None:
    config = config_for(2, 2)
    worker = (1, stage)
    index = action_index(build_schedule(config, "zb-h1", staggered=True), worker, what)
    result = run(config, [(worker, FaultInjection(KILL_STEP, index))], tmp_path)
    assert_exact(result, tmp_path, 2, 2)
    (recovery,) = result.recoveries
    assert recovery.workers == (f"1:{stage}",) and "killed by SIGKILL" in recovery.causes[0]
    # Nothing older than the iterations in flight is redone: the killed worker was in KILL_STEP, and a survivor of
    # another stage may still have been finishing KILL_STEP - 1 (staggered optimizer).
    assert recovery.step in (KILL_STEP, KILL_STEP + 1)
    assert result.failed == ((1, stage),)
    assert_only_lost_work_redone(recovery, config, worker)


def assert_only_lost_work_redone(recovery, config, worker: tuple[int, int]) -> None:
    """--redo lost (the default): the survivors kept their work; what is redone is at most twice the dead worker's
    share of one iteration (its actions; issue 27's goal), where redoing the iteration costs every survivor's
    finished work."""
    share = len(build_schedule(config, "zb-h1", staggered=True).worker_actions(*worker))
    # (No survivor work in flight, e.g. a kill before the iteration's first forward: nothing to keep or redo.)
    assert recovery.kept.startswith("kept the survivors' work") or recovery.redone_actions == 0, recovery.kept
    assert recovery.rolled_back == 0
    assert recovery.lost_actions <= recovery.redone_actions <= 2 * share, (recovery.redone_actions, share)


@pytest.mark.parametrize("stage,what", MATRIX_3x3)
def test_kill_matrix_3x3_with_clipping(stage: int, what: str, tmp_path) -> None:
    """D=3: the dead worker's micro-batches are split over two peers; clipping adds a world all-reduce per step."""
    config = config_for(3, 3, grad_clip=0.5)
    worker = (2, stage)
    index = action_index(build_schedule(config, "zb-h1", staggered=True), worker, what)
    result = run(config, [(worker, FaultInjection(KILL_STEP, index))], tmp_path)
    assert_exact(result, tmp_path, 3, 3, grad_clip=0.5)
    assert [r.workers for r in result.recoveries] == [(f"2:{stage}",)]
    # Clipping's world all-reduce: a survivor stopped inside it drops its gradients, so a kill at the step can
    # cost more; everywhere else the survivors keep their work.
    if what != "OPT":
        assert_only_lost_work_redone(result.recoveries[0], config, worker)


@pytest.mark.parametrize("stage,what", [(0, "B"), (1, "W")])
def test_kill_matrix_redoing_the_whole_iteration(stage: int, what: str, tmp_path) -> None:
    """--redo iteration, the classic recovery: every survivor redoes the interrupted iteration; exact too."""
    config = config_for(2, 2)
    worker = (1, stage)
    index = action_index(build_schedule(config, "zb-h1", staggered=True), worker, what)
    result = run(config, [(worker, FaultInjection(KILL_STEP, index))], tmp_path, redo="iteration")
    assert_exact(result, tmp_path, 2, 2)
    (recovery,) = result.recoveries
    assert recovery.kept == "" and recovery.lost_actions == 0 and recovery.redone_actions > 0


@pytest.mark.parametrize("D,S,stage", [(2, 2, 0), (2, 2, 1), (3, 3, 1)])
def test_kill_during_a_checkpoint_write(D: int, S: int, stage: int, tmp_path) -> None:
    """The stage's writer dies with its shard written but not yet marked complete: another replica writes it again
    (or, when the others have already finished the run, the step is superseded by the final one); `latest` only
    ever names complete steps, whose files hold exactly the fault-free state of that step."""
    config = config_for(D, S)
    ckpt = tmp_path / "ckpt"
    result = run(config, [((0, stage), FaultInjection(KILL_STEP, point="ckpt"))], tmp_path,
                 checkpoint_dir=str(ckpt), checkpoint_every=1)
    assert_exact(result, tmp_path, D, S)
    (recovery,) = result.recoveries
    assert recovery.workers == (f"0:{stage}",) and "during the checkpoint of step 2" in recovery.causes[0]
    assert (ckpt / "latest").read_text().strip() == "step000003"
    assert not list(ckpt.rglob("*.tmp"))
    complete = [int(p.parent.name.removeprefix("step")) for p in ckpt.glob("step*/recycle.json")]
    assert 3 in complete
    for step in complete:
        ref = reference(D, S, steps=step)
        saved = load_model_state(ckpt / f"step{step:06d}")
        assert saved.keys() == ref.keys()
        for key, tensor in saved.items():
            assert float((tensor - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-12)) < 1e-9, key


@pytest.mark.parametrize("redo", ["lost", "iteration"])
def test_hang_between_two_stages_optimizer_steps_is_fenced(redo: str, tmp_path) -> None:
    """Worker 1:0 freezes (SIGSTOP) at its stage all-reduce. Stage 1 does not need it for its own step, so it
    steps the iteration while stage 0 cannot: the heartbeat catches the freeze long before the 30 s timeout and the
    worker is killed. --redo lost: stage 1 keeps its step and only re-sends what stage 0 needs from its log, and
    stage 0's survivor (stopped inside its all-reduce) computes its gradients again; --redo iteration: stage 1 rolls
    back to its pre-step snapshot and both stages redo the iteration."""
    config = config_for(2, 2)
    index = action_index(build_schedule(config, "zb-h1", staggered=True), (1, 0), "OPT")
    result = run(config, [((1, 0), FaultInjection(KILL_STEP, index, mode="hang"))], tmp_path,
                 heartbeat_timeout_s=2.0, heartbeat_s=0.25, redo=redo)
    assert_exact(result, tmp_path, 2, 2)
    (recovery,) = result.recoveries
    assert "stopped responding" in recovery.causes[0]
    assert recovery.rolled_back == (2 if redo == "iteration" else 0)  # both stage-1 replicas had stepped
    assert recovery.kept.startswith("kept") == (redo == "lost"), recovery.kept
    assert recovery.resumed_s < 10


def test_two_successive_kills_in_one_stage(tmp_path) -> None:
    config = config_for(3, 3)
    result = run(config, [((1, 1), FaultInjection(1, 3)), ((2, 1), FaultInjection(2, 1))], tmp_path)
    assert_exact(result, tmp_path, 3, 3)
    assert [r.workers for r in result.recoveries] == [("1:1",), ("2:1",)]
    assert result.failed == ((1, 1), (2, 1))


def test_kill_during_a_recovery(tmp_path) -> None:
    """Worker 0:2 dies as soon as it stops for the recovery from 1:1's death: both are handled."""
    config = config_for(3, 3)
    result = run(config, [((1, 1), FaultInjection(1, 3)), ((0, 2), FaultInjection(1, point="recovery"))], tmp_path)
    assert_exact(result, tmp_path, 3, 3)
    assert result.failed == ((0, 2), (1, 1))
    assert sorted(w for r in result.recoveries for w in r.workers) == ["0:2", "1:1"]
