"""Tensor parallel inside a worker (D x S x T processes, gloo on CPU): exact against the single-process reference
fault-free (1F1B) and with a worker down (adaptive plan), the whole worker fenced when one of its TP ranks is
SIGKILLed (the survivors' work kept) or frozen mid-step, a re-join, a stage lost whole and restored from the
checkpoint, a llama stage, a T=2 checkpoint resumed with T=1, --resume into T=2 across a change of T, D and S, and
a short --chaos soak."""

from __future__ import annotations

import json
import multiprocessing as mp
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
from recycle.runtime.worker.emulate import Emulation
from recycle.schedules.fault_free import build_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240), pytest.mark.timing]
CHAOS_SEED = 4


def with_tp(config: Config, degree: int) -> Config:
    return replace(config, topology=replace(config.topology, gpus_per_worker=degree))


def train(config: Config, plan: Plan, tmp_path, faults: FaultOptions = FaultOptions(), provider: object = None,
          recovery: RecoveryOptions = RecoveryOptions(timeout_s=30),
          debug: DebugOptions = DebugOptions(verify_replicas=True)) -> tuple[dict[str, torch.Tensor], TrainResult]:
    save = tmp_path / "final.pt"
    options = LaunchOptions(outputs=OutputOptions(save_path=str(save), metrics_path=str(tmp_path / "m.jsonl")),
                            debug=debug,
                            recovery=recovery, faults=faults,
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
    """Also the held-out evaluation after each step (forward-only through the sharded stages), whose loss only TP
    rank 0 of the last stage counts: equal to the reference's."""
    config = with_tp(tiny_config(seed=11, eval_every=1, eval_batches=1, eval_fraction=0.2), 2)
    result = check(config, build_schedule(config, "1f1b"), tmp_path)
    for metrics in result.steps:  # the TP rank 0 shards of both replicas of a stage stay bit-identical
        for s in range(2):
            assert metrics.digests[f"0:{s}"] == metrics.digests[f"1:{s}"]
    expected: dict[int, float] = {}
    reference_train(config, evaluations=expected)
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    evals = {r["step"]: r["loss"] for r in records if r.get("event") == "eval"}
    assert sorted(evals) == sorted(expected) == [1, 2]
    for step, loss in evals.items():
        assert abs(loss - expected[step]) <= 1e-9 * abs(expected[step]), (step, loss, expected[step])


def test_worker_down_adaptive_plan_d2_s2_t2_matches_reference(tiny_config, tmp_path) -> None:
    """--down 1:1 with T=2: stage 1's micro-batches of pipeline 1 run on worker 0:1's two TP ranks."""
    from recycle.planner.api import make_plan  # the test may use the planner; the runtime never does
    from recycle.planner.options import PlannerOptions

    config = with_tp(tiny_config(seed=11), 2)
    plan = make_plan(config, frozenset({(1, 1)}), options=PlannerOptions(decoupled=True, staggered=True),
                     solver="heuristic")
    assert plan.failed == {(1, 1)} and not plan.actions[plan.rank(1, 1)]
    check(config, plan, tmp_path)


def test_sigkill_of_one_tp_rank_fences_the_whole_worker_and_the_run_is_exact(tiny_config, tmp_path) -> None:
    """TP rank 1 of worker 1:0 is SIGKILLed at its second backward of step 2 (1F1B: a fused BW; by then worker 1:1
    has done work of the step for sure: the first backward took its gradient): its TP rank 0 is fenced with it, the
    plan re-routes the worker's micro-batches, the survivors keep their work of the step (--redo lost), and the run
    ends exact. Worker 1:1's ranks are then inside their own TP all-reduces (DTensor's,
    outside the transport) when the abort cuts them: a peer's failure there must end the generation, not the run."""
    from recycle.planner.options import PlannerOptions
    from recycle.planner.provider import PlanLibrary

    config = with_tp(tiny_config(seed=5, steps=3), 2)
    plan = build_schedule(config, "1f1b")
    index = [i for i, a in enumerate(plan.actions[plan.rank(1, 0)]) if a.kind.name in ("B", "BW")][1]
    worker, fault = parse_fault(f"kill:1:0:1@2.{index}", 2, 2, tp_degree=2)
    assert fault.tp_rank == 1
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=1)
    result = check(config, plan, tmp_path, faults=FaultOptions(injections=((plan.rank(*worker), fault),)),
                   provider=library.lookup)
    (recovery,) = result.recoveries
    assert recovery.workers == ("1:0",) and "killed by SIGKILL" in recovery.causes[0]
    assert result.failed == ((1, 0),)
    # --redo lost (the default): every surviving worker's two ranks stopped at one point (a rank stopped in its
    # send counts the action done), so the survivors keep their work and redo at most twice the dead worker's share.
    assert recovery.kept.startswith("kept the survivors' work"), (recovery.kept, recovery.line())
    share = len(plan.worker_actions(1, 0))
    assert recovery.rolled_back == 0 and recovery.lost_actions <= recovery.redone_actions <= 2 * share
    assert not mp.active_children()  # worker 1:0's TP rank 0 was fenced with its killed rank 1


def test_a_frozen_tp_rank_ends_its_worker_through_rank_0_and_the_run_is_exact(tiny_config, tmp_path) -> None:
    """TP rank 1 of worker 1:0 is SIGSTOPped: it beats to nobody but its rank 0, which sees its beats stop and ends
    the worker; the launcher kills the frozen rank with it, and the plan re-routes as for a death."""
    from recycle.planner.options import PlannerOptions
    from recycle.planner.provider import PlanLibrary

    config = with_tp(tiny_config(seed=5, steps=3), 2)
    plan = build_schedule(config, "1f1b")
    worker, fault = parse_fault("hang:1:0:1@2.1", 2, 2, tp_degree=2)
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=1)
    result = check(config, plan, tmp_path, faults=FaultOptions(injections=((plan.rank(*worker), fault),)),
                   provider=library.lookup,
                   recovery=RecoveryOptions(timeout_s=30, heartbeat_s=0.25, heartbeat_timeout_s=2.0))
    (recovery,) = result.recoveries
    assert recovery.workers == ("1:0",) and "exited with code 5" in recovery.causes[0], recovery.causes
    assert not mp.active_children()


def test_a_llama_stage_sharded_over_two_ranks_matches_the_whole_model(tiny_config, tmp_path, monkeypatch) -> None:
    """The Hugging Face llama family (built from a config JSON, nothing downloaded), D=1 x S=2 x T=2, with the
    grouped-query heads (4 query, 2 key/value) split over the ranks: exact against the whole model in one process."""
    pytest.importorskip("transformers")
    import os

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    llama = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf-tiny-llama.json"))
    base = tiny_config(D=1, seed=4)
    config = with_tp(replace(base, model=replace(base.model, hf_config=llama)), 2)
    check(config, build_schedule(config, "1f1b"), tmp_path)


def test_a_tp_worker_rejoins_with_its_ranks_state_from_a_live_replica(tiny_config, tmp_path) -> None:
    """TP rank 1 of worker 1:0 is SIGKILLed in step 2; all of worker 1:0 is started again at step 3 (both ranks) and
    admitted at a step boundary once up, each rank taking its shards from the same rank of the live replica 0:0; the
    run ends exact with nobody down."""
    from recycle.planner.options import PlannerOptions
    from recycle.planner.provider import PlanLibrary

    # A replacement's two processes take ~20 s to start on this loaded 2-core machine: the steps are paced (100 ms a
    # cost slot, ~1 s a step) so that the run is still going when it is up.
    config = with_tp(tiny_config(seed=5, steps=20), 2)
    plan = build_schedule(config, "1f1b")
    worker, fault = parse_fault("kill:1:0:1@2.2", 2, 2, tp_degree=2)
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=1)
    result = check(config, plan, tmp_path, provider=library.lookup,
                   faults=FaultOptions(injections=((plan.rank(*worker), fault),), rejoins=((plan.rank(1, 0), 2),)),
                   debug=DebugOptions(verify_replicas=True, emulation=Emulation(100.0)))
    kill, join = result.recoveries
    assert kill.workers == ("1:0",) and join.joined == ("1:0",)
    assert join.transfer_bytes > 0 and result.failed == ()
    last = result.steps[-1]
    assert last.digests["0:0"] == last.digests["1:0"]  # the re-joined rank 0 shards equal the replica's
    assert not mp.active_children()


def test_a_t2_checkpoint_holds_the_whole_model_and_resumes_with_t1(tiny_config, tmp_path) -> None:
    """D=2 x S=2 x T=2 writes its checkpoint gathered whole (the T = 1 format, whole-model names, optimizer state
    included): it equals the reference after 2 steps, and a D=2 x S=2 x T=1 run resumed from it ends exact."""
    from recycle.runtime.options import CheckpointOptions
    from recycle.runtime.state import checkpoint

    config = with_tp(tiny_config(seed=5, steps=4, lr_schedule="cosine", warmup_steps=1, min_lr=0.001), 2)
    ck = tmp_path / "ck"
    options = LaunchOptions(outputs=OutputOptions(save_path=str(tmp_path / "t2.pt")), progress=None,
                            checkpoint=CheckpointOptions(dir=str(ck), every=2),
                            cluster=ClusterOptions(start_method="forkserver"))
    launch(config, build_schedule(config, "1f1b"), replace(options, steps=2))
    assert (ck / "latest").read_text().strip() == "step000002"
    at_two = checkpoint.load_full_model(ck, config).state_dict()
    assert max_relative_error(at_two, reference_train(config, steps=2)[0]) < 1e-9
    one = with_tp(config, 1)
    launch(one, build_schedule(one, "1f1b"), replace(options, checkpoint=CheckpointOptions(resume_dir=str(ck)),
                                                     outputs=OutputOptions(save_path=str(tmp_path / "t1.pt"))))
    resumed = torch.load(tmp_path / "t1.pt", weights_only=True)["model"]
    assert max_relative_error(resumed, reference_train(config)[0]) < 1e-9  # Adam's moments came through whole
    assert not mp.active_children()


def test_resume_into_t2_across_a_change_of_t_d_and_s(tiny_config, tmp_path) -> None:
    """A T = 1 checkpoint (D=1 x S=1, step 2) resumed with T = 2 at D=1 x S=2, which checkpoints step 4; that T = 2
    checkpoint resumed with T = 2 at D=2 x S=1 (M halved: the same 4 micro-batches a step) to step 6. Each rank cuts
    its shards from the checkpoint's whole tensors, Adam's moments included; both runs end exact against the
    single-process reference, the warm-up + cosine schedule going on where it was."""
    from recycle.runtime.options import CheckpointOptions

    def tiny(D: int, S: int, M: int, degree: int) -> Config:
        return with_tp(tiny_config(D=D, S=S, M=M, seed=5, steps=6, lr_schedule="cosine", warmup_steps=1,
                                   min_lr=0.001), degree)

    def run(config: Config, steps: int, save: str, **checkpoints: object) -> dict[str, torch.Tensor]:
        options = LaunchOptions(outputs=OutputOptions(save_path=str(tmp_path / save)), progress=None, steps=steps,
                                checkpoint=CheckpointOptions(**checkpoints),  # type: ignore[arg-type]
                                cluster=ClusterOptions(start_method="forkserver"))
        launch(config, build_schedule(config, "1f1b"), options)
        assert not mp.active_children()
        return torch.load(tmp_path / save, weights_only=True)["model"]

    one = tiny(D=1, S=1, M=4, degree=1)
    run(one, 2, "t1.pt", dir=str(tmp_path / "ck1"), every=2)
    at_four = run(tiny(D=1, S=2, M=4, degree=2), 4, "t2-s2.pt", resume_dir=str(tmp_path / "ck1"),
                  dir=str(tmp_path / "ck2"), every=2)
    assert (tmp_path / "ck2" / "latest").read_text().strip() == "step000004"
    assert max_relative_error(at_four, reference_train(one, steps=4)[0]) < 1e-9
    at_six = run(tiny(D=2, S=1, M=2, degree=2), 6, "t2-d2.pt", resume_dir=str(tmp_path / "ck2"))
    assert max_relative_error(at_six, reference_train(one)[0]) < 1e-9


def test_a_stage_lost_whole_is_restored_from_the_checkpoint_into_tp_workers(tiny_config, tmp_path) -> None:
    """Both replicas of stage 1 die (TP rank 1 of 1:1 at step 2, TP rank 0 of 0:1 at step 6, after the checkpoint of
    step 4): worker 1:0 moves into slot 1:1 (reshape, two new processes), every worker loads that checkpoint, each
    rank cutting its shards from the whole tensors, and the run redoes the lost steps to the reference's weights."""
    from recycle.planner.options import PlannerOptions
    from recycle.planner.provider import PlanLibrary
    from recycle.runtime.options import CheckpointOptions

    config = with_tp(tiny_config(seed=3, steps=8), 2)
    plan = build_schedule(config, "1f1b")
    faults = tuple((plan.rank(*worker), fault) for worker, fault in
                   (parse_fault(text, 2, 2, tp_degree=2) for text in ("kill:1:1:1@2.1", "kill:0:1:0@6.1")))
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=4)
    ck = tmp_path / "ck"
    options = LaunchOptions(outputs=OutputOptions(save_path=str(tmp_path / "final.pt")), progress=None,
                            checkpoint=CheckpointOptions(dir=str(ck), every=2), plan_provider=library.lookup,
                            recovery=RecoveryOptions(timeout_s=30), faults=FaultOptions(injections=faults),
                            cluster=ClusterOptions(start_method="forkserver"))
    result = launch(config, plan, options)
    got = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    assert max_relative_error(got, reference_train(config)[0]) < 1e-9
    restore = next(r for r in result.recoveries if r.restored_step is not None)
    assert restore.restored_step == 4 and restore.moved == (((1, 0), (1, 1)),), restore.line()
    assert result.failed == ((0, 1), (1, 0)) and (ck / "latest").read_text().strip() == "step000008"
    assert not mp.active_children()


def test_a_short_chaos_soak_with_tp_workers_ends_exact(tiny_config, tmp_path) -> None:
    """--chaos with T = 2: random faults, each of one process of a worker (TP rank 1 among them), here whole-stage
    losses restored from the checkpoint and a frozen rank, each repaired (all T processes again), in one run that
    ends with the reference's weights. (A replacement's rank 0 says the worker is ready only once its other ranks
    are up: the generation that admits it waited for a rank still starting, and timed out, before.)"""
    from recycle.planner.options import PlannerOptions
    from recycle.planner.provider import PlanLibrary
    from recycle.runtime.options import CheckpointOptions
    from recycle.runtime.tools.chaos import ChaosSpec

    config = with_tp(tiny_config(seed=3, steps=8), 2)
    result = launch(config, build_schedule(config, "1f1b"), LaunchOptions(
        outputs=OutputOptions(save_path=str(tmp_path / "final.pt")),
        checkpoint=CheckpointOptions(dir=str(tmp_path / "ck"), every=2),
        recovery=RecoveryOptions(timeout_s=40, heartbeat_timeout_s=3.0, heartbeat_s=0.25),
        cluster=ClusterOptions(start_method="forkserver"),
        faults=FaultOptions(chaos=ChaosSpec(CHAOS_SEED, 0.6, stage_loss_share=0.3)),
        debug=DebugOptions(verify_replicas=True), progress=None,
        plan_provider=PlanLibrary.build(config, PlannerOptions(), max_failures=4).lookup))
    got = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    assert max_relative_error(got, reference_train(config)[0]) < 1e-9
    injected = [w for e in result.chaos_events for w in e["workers"]]
    recovered = [w for r in result.recoveries for w in r.workers]
    assert len(result.chaos_events) >= 1 and sorted(injected) == sorted(recovered)
    causes = [cause for r in result.recoveries for cause in r.causes]
    assert any("of TP rank 1" in cause for cause in causes), causes  # not only the rank that speaks for a worker
    assert not mp.active_children()
