"""The executor's side of a kept recovery (ir.completion), every worker on threads over the in-memory fabric: a
worker is cut off at many moments of an iteration, the survivors keep their work, run the completion on the next
plan, and the run ends exactly on the single-process reference (float64)."""

from __future__ import annotations

import threading

import pytest
import torch
from test_completion import timeline

from recycle.ir import Plan
from recycle.ir.completion import Completion, CompletionViews, WorkerProgress, complete_iteration
from recycle.ir.worker_view import PlanViews, read_worker_view
from recycle.models.gpt import build_stages
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.precision import weights_dtype
from recycle.runtime.tools.fakes import MemoryFabric
from recycle.runtime.tools.reference import reference_train
from recycle.runtime.worker.data import data_source
from recycle.runtime.worker.executor import StageExecutor
from recycle.schedules.fault_free import build_schedule

KILLED_AT = 1  # the iteration the failure interrupts (of 3)


class _Stop(Exception):
    """Where a worker's part of the broken generation ends."""


def _threads(ranks, work) -> None:
    errors = []

    def run(rank: int) -> None:
        try:
            work(rank)
        except BaseException as exc:  # surface worker errors in the test thread
            errors.append((rank, exc))

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def kill_and_complete(config, plan: Plan, new_plan: Plan, dead: int, counts: dict[int, int]):
    """Run iteration 0, then each worker's first `counts[rank]` actions of iteration 1 (the dead one's too, so the
    survivors' receives are served), drop the dead one, finish iteration 1 with the completion and run iteration 2 on
    the new plan. Returns the survivors' executors and the completion."""
    training, workload = config.training, config.workload
    load = data_source(config)
    fabric = MemoryFabric.for_plan(plan)
    executors: dict[int, StageExecutor] = {}

    def broken_generation(rank: int) -> None:
        stage = plan.worker(rank)[1]
        module = build_stages(config.model, plan.num_stages, training.seed, weights_dtype(training.dtype),
                              workload.seq_len)[stage]
        shape = module.boundary_shape(workload.microbatch_size, workload.seq_len)
        executor = StageExecutor(plan, rank, module, make_optimizer(module, training), fabric.endpoint(rank), load,
                                 shape, shape, next(module.parameters()).dtype)

        def before(_action) -> None:
            progress = executor.progress
            if progress.iteration == KILLED_AT and progress.index == counts[rank]:
                raise _Stop()

        executor.before_action = before
        executors[rank] = executor
        executor.run_iteration(0)
        try:
            executor.run_iteration(KILLED_AT)
        except _Stop:
            pass

    _threads(plan.live_ranks(), broken_generation)
    survivors = {r: e for r, e in executors.items() if r != dead}
    progress = {}
    for rank, executor in survivors.items():
        p = executor.progress
        progress[rank] = WorkerProgress(rank, executor.position.applied, p.iteration, 0 if p.finished else p.index,
                                        p.weighed and not p.finished, p.reducing and not p.finished)
    completion = complete_iteration(plan, new_plan, KILLED_AT, progress)
    if isinstance(completion, str):
        return None, completion
    completion = Completion.from_json(completion.to_json(), new_plan)
    next_fabric = MemoryFabric.for_plan(new_plan)
    # As the workers take them from the store: each its own view of the new plan and of the completion.
    plan_views, completion_views = PlanViews(new_plan), CompletionViews(completion)

    def next_generation(rank: int) -> None:
        executor = survivors[rank]
        executor.before_action = None
        executor.keep_for_completion(KILLED_AT)
        executor.set_plan(read_worker_view(plan_views.json_for(rank), rank), next_fabric.endpoint(rank))
        executor.run_completion(Completion.from_json(completion_views.json_for(rank), new_plan, rank))
        executor.run_iteration(KILLED_AT + 1)

    _threads(survivors, next_generation)
    return survivors, completion


def rerouted_plan(config, plan: Plan, dead: int) -> Plan:
    from recycle.planner.api import make_plan  # tests may use the planner; the runtime may not

    return make_plan(config, frozenset({plan.worker(dead)}), solver="heuristic")


@pytest.mark.parametrize("D,S,M,schedule", [(2, 2, 2, "zb-h1"), (2, 2, 3, "1f1b"), (3, 2, 2, "zb-h1")])
def test_a_worker_cut_off_at_any_moment_costs_only_its_share_and_the_run_stays_exact(tiny_config, D: int, S: int,
                                                                                     M: int, schedule: str) -> None:
    torch.set_num_threads(1)
    config = tiny_config(D=D, S=S, M=M, steps=3)
    plan = build_schedule(config, schedule, staggered=True)
    reference, _ = reference_train(config)
    finish = timeline(plan)
    end = max(t for ticks in finish.values() for t in ticks)
    kept = 0
    for dead in (plan.rank(D - 1, 0), plan.rank(D - 1, S - 1)):
        new_plan = rerouted_plan(config, plan, dead)
        for tick in range(1, end, 2):
            counts = {r: sum(1 for t in ticks if t <= tick) for r, ticks in finish.items()}
            survivors, completion = kill_and_complete(config, plan, new_plan, dead, counts)
            if survivors is None:
                continue  # e.g. every stage had stepped: nothing to keep (the whole-iteration path covers it)
            kept += 1
            assert completion.redone_actions <= 2 * len(plan.actions[dead]), (dead, tick, completion)
            assert_exact(survivors, reference, (dead, tick))
    assert kept >= 4


def assert_exact(survivors: dict[int, StageExecutor], reference: dict[str, torch.Tensor], where) -> None:
    for rank, executor in survivors.items():
        for name, value in executor.module.state_dict().items():
            scale = reference[name].abs().max().clamp_min(1e-12)
            error = float((value - reference[name]).abs().max() / scale)
            assert error < 1e-9, (where, rank, name, error)


@pytest.mark.parametrize("schedule", ["zb-h1", "1f1b"])
def test_a_stage_that_stepped_keeps_its_step_and_recomputes_a_lost_gradient_with_its_old_weights(
        tiny_config, schedule: str) -> None:
    """The last stage has stepped; the first stage had not yet taken delivery of its last input-gradient, sent by the
    worker that then died: the stage that stepped computes that forward and input-gradient again with its weights
    from before the step (its snapshot) and nobody rolls back."""
    torch.set_num_threads(1)
    config = tiny_config(D=2, S=2, M=2, steps=3)
    plan = build_schedule(config, schedule, staggered=True)
    dead = plan.rank(1, 1)
    counts = {r: len(plan.actions[r]) for r in plan.live_ranks()}
    for rank in (plan.rank(0, 0), plan.rank(1, 0)):  # each stops before its last input-gradient's delivery
        counts[rank] = max(i for i, a in enumerate(plan.actions[rank]) if a.kind.value in ("B", "BW"))
    survivors, completion = kill_and_complete(config, plan, rerouted_plan(config, plan, dead), dead, counts)
    assert survivors is not None, completion
    assert completion.applied_stages == (1,)
    assert any(s.kind == "B" for s in completion.steps[plan.rank(0, 1)])  # computed again on the stepped stage
    assert_exact(survivors, reference_train(config)[0], "stepped")
