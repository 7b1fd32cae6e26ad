"""The chunked executor on threads over the in-memory fabric (which refuses any message out of its pair's order):
every worker's ChunkSet ends with the single-process reference's weights, for both layouts, decoupled or fused,
staggered or coupled, fault-free, after failures (nested and not), and across a plan switch between iterations."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from recycle.config import Config
from recycle.ir import Plan
from recycle.models.chunk_set import gpt_chunk_set
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.tools.fakes import MemoryFabric, run_ranks_in_threads
from recycle.runtime.tools.reference import reference_train
from recycle.runtime.worker.chunked_executor import ChunkedStageExecutor
from recycle.runtime.worker.data import data_source

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def chunked(config: Config, layout: str, n_layer: int = 4) -> Config:
    return replace(config, topology=replace(config.topology, chunks_per_worker=2, chunk_layout=layout),
                   model=replace(config.model, n_layer=n_layer))


def plan_for(config: Config, down: set, decoupled: bool = True, staggered: bool = True) -> Plan:
    from recycle.planner.api import make_plan  # tests may use the planner; the runtime may not
    from recycle.planner.options import PlannerOptions

    plan = make_plan(config, frozenset(down), options=PlannerOptions(decoupled=decoupled, staggered=staggered))
    assert plan.chunks == 2 and plan.failed == frozenset(down)
    return plan


def train_in_threads(config: Config, plans: list[Plan]) -> dict[int, torch.nn.Module]:
    """Step i runs plans[i] (each on a fresh fabric, as a new generation would); returns each rank's ChunkSet."""
    training, workload = config.training, config.workload
    load = data_source(config)
    fabrics = [MemoryFabric.for_plan(plan) for plan in plans]
    first = plans[0]
    step_done = threading.Barrier(len(first.live_ranks()), timeout=60)
    modules = {}
    shape = (workload.microbatch_size, workload.seq_len, 32)

    def work(rank: int) -> None:
        module = gpt_chunk_set(config.model, first.num_stages, 2, first.chunk_layout, first.worker(rank)[1],
                               training.seed, training.dtype, workload.seq_len)
        modules[rank] = module
        executor = ChunkedStageExecutor(first, rank, module, make_optimizer(module, training),
                                        fabrics[0].endpoint(rank), load, shape, shape, torch.float64)
        for step, plan in enumerate(plans):
            if step > 0:
                step_done.wait()
                if rank not in plan.live_ranks():
                    return
                executor.set_plan(plan, fabrics[step].endpoint(rank))
            executor.run_iteration(step)

    def cut_all() -> None:  # the peers blocked on a failed worker raise at once
        for fabric in fabrics:
            fabric.cut()
        step_done.abort()

    run_ranks_in_threads(first.live_ranks(), work, cut_all, 90)
    return modules


def assert_reference(config: Config, plans: list[Plan]) -> None:
    modules = train_in_threads(config, plans)
    ref, _ = reference_train(replace(config, training=replace(config.training, steps=len(plans))))
    last = plans[-1]
    for rank in last.live_ranks():
        state = modules[rank].state_dict()
        for name, value in state.items():
            assert float((value - ref[name]).abs().max() / ref[name].abs().max().clamp_min(1e-12)) < 1e-9, \
                (rank, name)
    covered = {name for rank in last.live_ranks() for name in modules[rank].state_dict()}
    assert covered == set(ref)  # the live workers hold the whole model


@pytest.mark.parametrize("layout", ["interleaved", "v"])
@pytest.mark.parametrize("decoupled,staggered", [(True, True), (False, False)])
def test_fault_free_chunked_plans_match_the_reference(tiny_config, layout: str, decoupled: bool,
                                                      staggered: bool) -> None:
    config = chunked(tiny_config(D=2, S=2, M=3, steps=2), layout)
    plan = plan_for(config, set(), decoupled, staggered)
    assert_reference(config, [plan, plan])


@pytest.mark.parametrize("layout,D,S,down", [("v", 2, 2, {(1, 1)}), ("interleaved", 3, 2, {(0, 1)}),
                                             ("v", 3, 3, {(0, 0), (2, 1)}), ("interleaved", 3, 3, {(1, 2)})])
def test_adapted_chunked_plans_match_the_reference(tiny_config, layout: str, D: int, S: int, down: set) -> None:
    """A dead worker's chunks' micro-batches run on the same chunks of its peers (non-nested failures too)."""
    config = chunked(tiny_config(D=D, S=S, M=2, steps=1), layout, n_layer=2 * S)
    assert_reference(config, [plan_for(config, down)])


def test_a_chunked_run_switches_plans_between_iterations(tiny_config) -> None:
    """Step 0 fault-free on 4 workers, then worker 1:1 leaves and the survivors run the adapted plan."""
    config = chunked(tiny_config(D=2, S=2, M=2, steps=2), "v")
    assert_reference(config, [plan_for(config, set()), plan_for(config, {(1, 1)})])


def test_the_chunked_executor_refuses_what_it_cannot_run(tiny_config) -> None:
    config = chunked(tiny_config(D=1, S=2, M=2), "v")
    module = gpt_chunk_set(config.model, 2, 2, "v", 0, 7, "float64", 8)
    plan = plan_for(config, set())
    with pytest.raises(TypeError, match="runs a ChunkSet"):
        ChunkedStageExecutor(plan, 0, torch.nn.Linear(2, 2), make_optimizer(module, config.training), None,
                             data_source(config), None, None, torch.float64)
    other = gpt_chunk_set(config.model, 2, 2, "v", 1, 7, "float64", 8)  # worker 1's chunks, given to worker 0
    with pytest.raises(ValueError, match=r"holds chunks \[1, 2\] but its plan runs chunks \[0, 3\] too"):
        ChunkedStageExecutor(plan, 0, other, make_optimizer(other, config.training), None, data_source(config),
                             None, None, torch.float64)
    executor = ChunkedStageExecutor(plan, 0, module, make_optimizer(module, config.training), None,
                                    data_source(config), None, None, torch.float64)
    with pytest.raises(RuntimeError, match="redoes the whole iteration"):
        executor.keep_for_completion(0)
