"""The training loop's reports on real gloo processes: the learning rate in the metrics, the held-out evaluation run
through the pipeline and equal to the single-process reference's (float64), also when a worker dies during it, and
the start-up table of pids and workers (and each replacement's line)."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from recycle.planner.options import PlannerOptions
from recycle.planner.provider import PlanLibrary
from recycle.runtime.control.launcher import TrainResult, launch
from recycle.runtime.options import LaunchOptions, with_keywords
from recycle.runtime.state.optim import lr_factor
from recycle.runtime.tools.faults import FaultInjection
from recycle.runtime.tools.reference import reference_train
from recycle.runtime.worker.emulate import Emulation
from recycle.schedules.fault_free import build_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180), pytest.mark.timing]

STEPS = 4


def eval_config(tiny_config, steps: int = STEPS):
    # Warm-up, stable and decay steps (wsd), and an evaluation of 2 global batches after steps 2 and 4.
    return tiny_config(D=2, S=2, M=2, steps=steps, seed=3, lr_schedule="wsd", warmup_steps=1, wsd_decay_steps=2,
                       eval_every=2, eval_batches=2, eval_fraction=0.2)


def run(config, tmp_path: Path, lines: list[str], staggered: bool = True, **extra) -> TrainResult:
    plan = build_schedule(config, "zb-h1", staggered=staggered)
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=2)
    options = with_keywords(LaunchOptions(), dict(
        save_path=str(tmp_path / "final.pt"), metrics_path=str(tmp_path / "m.jsonl"), verify_replicas=True,
        timeout_s=30, progress=lines.append, start_method="forkserver", plan_provider=library.lookup, **extra))
    return launch(config, plan, options)


def assert_exact(config, tmp_path: Path, evals_at: tuple[int, ...] = (2, 4)) -> list[dict]:
    """The final parameters and every evaluation equal the reference's; the metrics records, for more checks."""
    evaluations: dict[int, float] = {}
    ref, losses = reference_train(config, evaluations=evaluations)
    got = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    for key in ref:
        assert float((got[key] - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-12)) < 1e-9, key
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("event") == "eval"]
    assert [e["step"] for e in evals] == list(evals_at) and sorted(evaluations) == sorted(set(evals_at))
    for e in evals:
        expected = evaluations[e["step"]]
        assert abs(e["loss"] - expected) <= 1e-9 * abs(expected), (e, expected)
        assert e["microbatches"] == 2 * 4 and e["tokens"] == 8 * 2 * 8
    assert len({e["loss"] for e in evals}) == len(evaluations)  # the model moved between them
    steps = {r["step"]: r for r in records if "event" not in r}  # the last report of each (a restore redoes some)
    assert sorted(steps) == list(range(1, config.training.steps + 1))
    assert [round(steps[k]["loss"], 9) for k in sorted(steps)] == [round(x, 9) for x in losses]
    return records


def test_lr_and_eval_in_the_metrics_exact_against_the_reference(tiny_config, tmp_path: Path) -> None:
    config = eval_config(tiny_config)
    lines: list[str] = []
    run(config, tmp_path, lines)
    records = assert_exact(config, tmp_path)
    steps = [r for r in records if "event" not in r]
    # The rates the workers' optimizer steps applied, step by step: warm-up 1, stable, then the decay to 0.
    assert [s["lr"] for s in steps] == [0.01 * lr_factor(k, config.training) for k in range(STEPS)] == \
        [0.01, 0.01, 0.01, 0.005]
    assert all(s["lr_by_stage"] == [] and s["tokens_per_s_per_gpu"] * 4 == pytest.approx(s["tokens_per_s"])
               for s in steps)
    # The progress: the table of pids (one row per worker), the lr on each step line, the eval lines.
    table = lines[lines.index(next(x for x in lines if x.startswith("node 0's workers started"))) + 1:][:5]
    assert table[0].split() == ["node", "worker", "rank", "pid"]
    rows = [row.split() for row in table[1:]]
    assert [r[:3] for r in rows] == [["0", "0:0", "0"], ["0", "0:1", "1"], ["0", "1:0", "2"], ["0", "1:1", "3"]]
    assert len({r[3] for r in rows}) == 4 and all(r[3].isdigit() for r in rows)
    assert any(x.startswith("step 4/4 loss ") and " lr 5.00e-03 " in x for x in lines)
    assert sum(x.startswith("eval after step ") and " loss " in x for x in lines) == 2
    assert not mp.active_children()


def test_a_kill_in_the_step_after_an_evaluation_keeps_that_evaluation(tiny_config, tmp_path: Path) -> None:
    """Worker 1:0 dies at its stage all-reduce of step 3, after the evaluation after step 2: the survivors keep
    their work (--redo lost) and finish step 3 with a completion; the evaluation after step 2, done and reported
    before the failure, stands (not reported again), and every evaluation and the parameters equal the
    reference's."""
    config = eval_config(tiny_config)
    plan = build_schedule(config, "zb-h1", staggered=True)
    index = next(i for i, a in enumerate(plan.worker_actions(1, 0)) if a.kind.value == "OPT")
    lines: list[str] = []
    result = run(config, tmp_path, lines, faults=((plan.rank(1, 0), FaultInjection(step=2, index=index)),))
    (recovery,) = result.recoveries
    assert recovery.step == 3 and recovery.kept.startswith("kept the survivors' work"), recovery.kept
    records = assert_exact(config, tmp_path)
    assert [r["redone"] for r in records if r.get("event") == "eval"] == [False, False]


@pytest.mark.parametrize("worker", [(1, 1), (0, 0)])
def test_a_worker_killed_during_the_eval_is_survived_and_the_eval_redone(tiny_config, tmp_path: Path,
                                                                        worker: tuple[int, int]) -> None:
    """Killed before its first forward of the eval after step 2: the survivors go on in a new generation from step
    3, which runs that evaluation again first (routed by the adaptive plan) and says so; everything stays exact.
    A replacement for the dead worker is started at once (its line printed). Coupled optimizer steps (not
    staggered): every worker has applied step 2 when the kill comes, so nothing is rolled back (staggered, a stage
    that finished first may start the evaluation while another stage is still in step 2, which the recovery then
    rolls back and redoes before evaluating: also exact, but another story)."""
    config = eval_config(tiny_config)
    lines: list[str] = []
    rank = worker[0] * 2 + worker[1]
    result = run(config, tmp_path, lines, staggered=False, respawn_after_s=0.0,
                 faults=((rank, FaultInjection(step=1, mode="kill", point="eval")),))
    assert len(result.recoveries) >= 1 and result.recoveries[0].step == 3  # nothing to roll back: step 3 is next
    assert "during the evaluation after step 2" in result.recoveries[0].causes[0]
    records = assert_exact(config, tmp_path)
    assert [r["redone"] for r in records if r.get("event") == "eval"] == [True, False]
    assert any(x.startswith("eval after step 2: loss ") and x.endswith("run again in generation 1 after a failure)")
               for x in lines)
    assert any(x.startswith(f"node 0: worker {worker[0]}:{worker[1]} (rank {rank}) replaced: pid ") for x in lines)
    assert not mp.active_children()


def test_a_checkpoint_restore_runs_the_evaluations_from_its_step_again(tiny_config, tmp_path: Path) -> None:
    """Stage 1 loses both replicas (1:1 in step 2, 0:1 in step 4), so every worker restores the checkpoint of step
    2 (reshape: 1:0 moves into stage 1) and redoes steps 3 and 4. The evaluation after step 2 runs again first,
    from the restored weights, and equals the first; all of them equal the reference's. Paced (20 ms per cost
    slot) so that the checkpoint of step 2 is complete before the second kill, as in test_rejoin.py."""
    config = eval_config(tiny_config, steps=6)
    lines: list[str] = []
    plan = build_schedule(config, "zb-h1", staggered=True)
    kills = ((plan.rank(1, 1), FaultInjection(step=1, index=3)), (plan.rank(0, 1), FaultInjection(step=3, index=2)))
    result = run(config, tmp_path, lines, faults=kills, checkpoint_dir=str(tmp_path / "ck"), checkpoint_every=2,
                 stage_loss="reshape", emulation=Emulation(20.0, 1.0))
    restore = next(r for r in result.recoveries if r.restored_step is not None)
    assert restore.restored_step == 2
    records = assert_exact(config, tmp_path, evals_at=(2, 2, 4, 6))
    evals = [r for r in records if r.get("event") == "eval"]
    assert evals[0]["loss"] == evals[1]["loss"] and evals[1]["redone"] and not evals[2]["redone"]
    assert not mp.active_children()


def test_an_evaluation_cut_at_the_end_of_the_run_is_reported_skipped(tiny_config, tmp_path: Path) -> None:
    """Killed in the evaluation after the last step: every step is applied everywhere (coupled optimizer steps, as
    above), so the survivors only finish (no generation runs together again); the run ends exact and says that
    evaluation was skipped."""
    config = eval_config(tiny_config)
    lines: list[str] = []
    result = run(config, tmp_path, lines, staggered=False,
                 faults=((3, FaultInjection(step=STEPS - 1, mode="kill", point="eval")),))
    assert [m.step for m in result.steps] == list(range(1, STEPS + 1))
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    evals = [r for r in records if r.get("event") == "eval"]
    assert [(e["step"], e["loss"] is None) for e in evals] == [(2, False), (4, True)], "\n".join(lines)
    assert evals[1]["skipped"].startswith("a failure cut it short")
    assert f"eval after step {STEPS}: skipped (a failure cut it short, and the run ended before it could run again)" \
        in lines
    evaluations: dict[int, float] = {}
    ref, _ = reference_train(config, evaluations=evaluations)
    assert abs(evals[0]["loss"] - evaluations[2]) <= 1e-9 * abs(evaluations[2])
    got = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    assert all(float((got[k] - ref[k]).abs().max() / ref[k].abs().max()) < 1e-9 for k in ref)
    assert not mp.active_children()
