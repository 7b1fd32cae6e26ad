"""The held-out evaluation through the pipeline (worker.evaluation), every worker on threads over an in-memory
transport: the single-process reference's loss on the same batches, under fault-free and adaptive routing, with no
weight changed and dropout off; and the [training] keys' errors."""

from __future__ import annotations

import pytest
import torch

from recycle.errors import ConfigError
from recycle.ir import Plan
from recycle.models.gpt import build_stages, full_model
from recycle.runtime.state.precision import weights_dtype
from recycle.runtime.tools.fakes import MemoryFabric, run_ranks_in_threads
from recycle.runtime.tools.reference import reference_eval_loss
from recycle.runtime.worker.data import check_data, data_source
from recycle.runtime.worker.evaluation import evaluate
from recycle.runtime.worker.process import parameter_digest
from recycle.schedules.fault_free import build_schedule

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def evaluate_in_threads(config, plan: Plan, times: int = 1) -> tuple[dict[int, list[float]], dict[int, bool]]:
    """Each live rank's eval losses (`times` evaluations in a row) and whether its weights were left unchanged."""
    training, workload = config.training, config.workload
    load = data_source(config, "eval")
    fabric = MemoryFabric.for_plan(plan)
    losses: dict[int, list[float]] = {}
    unchanged: dict[int, bool] = {}

    def work(rank: int) -> None:
        _, stage = plan.worker(rank)
        module = build_stages(config.model, plan.num_stages, training.seed, weights_dtype(training.dtype),
                              workload.seq_len)[stage]
        before = parameter_digest(module)
        shape = module.boundary_shape(workload.microbatch_size, workload.seq_len)
        losses[rank] = [evaluate(plan, rank, module, fabric.endpoint(rank), load, training.eval_batches, shape,
                                 weights_dtype(training.dtype), torch.device("cpu"), training.dtype, None,
                                 lambda: None) for _ in range(times)]
        unchanged[rank] = parameter_digest(module) == before and module.training

    run_ranks_in_threads(plan.live_ranks(), work, fabric.cut, 60)
    return losses, unchanged


def reference(config) -> float:
    t = config.training
    model = full_model(config.model, config.workload.seq_len, t.seed, weights_dtype(t.dtype))
    return reference_eval_loss(config, model, model)


def adaptive_plan(config, down: set[tuple[int, int]]) -> Plan:
    from recycle.planner.api import make_plan  # the test may use the planner; the runtime never does
    from recycle.planner.options import PlannerOptions

    return make_plan(config, frozenset(down), options=PlannerOptions(decoupled=True, staggered=True),
                     solver="heuristic")


@pytest.mark.parametrize("D,S,down", [(2, 2, set()), (3, 2, {(1, 1)}), (2, 3, {(0, 1)}), (1, 1, set())])
def test_the_pipeline_eval_is_the_reference_eval(tiny_config, D: int, S: int, down: set) -> None:
    config = tiny_config(D=D, S=S, M=2, eval_every=1, eval_fraction=0.2, eval_batches=2)
    plan = adaptive_plan(config, down) if down else build_schedule(config, "zb-h1", staggered=True)
    losses, unchanged = evaluate_in_threads(config, plan, times=2)
    expected = reference(config)
    assert set(losses) == set(plan.live_ranks())
    for rank, (first, second) in losses.items():  # every worker gets the loss; twice the same (deterministic)
        assert abs(first - expected) <= 1e-9 * abs(expected) and first == second, (rank, first, expected)
    assert all(unchanged.values())  # forward only: no weight moved, and back in training mode


def test_dropout_is_off_during_the_eval(tiny_config) -> None:
    """With dropout in the model the eval is still the deterministic eval-mode loss (the reference's, dropout off)."""
    from dataclasses import replace

    config = tiny_config(D=2, S=2, M=2, eval_every=1, eval_fraction=0.2)
    dropped = replace(config, model=replace(config.model, dropout=0.5))
    losses, _ = evaluate_in_threads(dropped, build_schedule(dropped, "1f1b"))
    expected = reference(config)  # no dropout at all
    assert all(abs(v[0] - expected) <= 1e-9 * abs(expected) for v in losses.values())


def test_eval_keys_are_checked_with_the_fix(tiny_config) -> None:
    for bad, message in [({"eval_every": 2}, r"eval_fraction = 0 holds nothing out; set eval_fraction"),
                         ({"eval_every": -1, "eval_fraction": 0.1}, "eval_every >= 0"),
                         ({"eval_every": 1, "eval_fraction": 0.1, "eval_batches": 0}, "eval_batches >= 1"),
                         ({"eval_every": 1, "eval_fraction": 0.1, "data_source": "m:f"}, "has no held-out split")]:
        with pytest.raises(ConfigError, match=message):
            tiny_config(**bad)
    # Message tags number an evaluation's micro-batches in 24 bits: 65,536 batches of 2 x 130 do not fit.
    with pytest.raises(ConfigError, match=r"eval_batches = 65536 makes an evaluation of 17,039,360 micro-batches"):
        check_data(tiny_config(D=2, M=130, eval_every=1, eval_fraction=0.1, eval_batches=65_536))
    check_data(tiny_config(D=2, M=128, eval_every=1, eval_fraction=0.1, eval_batches=65_536))  # 2^24 exactly


@pytest.mark.parametrize("layout,D,down", [("v", 2, set()), ("interleaved", 2, set()), ("v", 3, {(1, 1)}),
                                           ("interleaved", 3, {(0, 0), (2, 1)})])
def test_a_chunked_pipelines_eval_is_the_reference_eval(tiny_config, layout: str, D: int, down: set) -> None:
    """Each worker's ChunkSet forwards its chunks in one global (micro-batch, chunk) order: the in-memory fabric
    checks every pair's messages arrive in the order they are expected, and the V's turn stays on its worker."""
    from dataclasses import replace

    from recycle.models.chunk_set import gpt_chunk_set

    config = tiny_config(D=D, S=2, M=2, eval_every=1, eval_fraction=0.2, eval_batches=2)
    config = replace(config, topology=replace(config.topology, chunks_per_worker=2, chunk_layout=layout))
    plan = adaptive_plan(config, down)
    assert plan.chunks == 2
    training, workload = config.training, config.workload
    load = data_source(config, "eval")
    fabric = MemoryFabric.for_plan(plan)
    losses: dict[int, float] = {}

    def work(rank: int) -> None:
        module = gpt_chunk_set(config.model, 2, 2, layout, plan.worker(rank)[1], training.seed,
                               weights_dtype(training.dtype), workload.seq_len)
        losses[rank] = evaluate(plan, rank, module, fabric.endpoint(rank), load, training.eval_batches,
                                (workload.microbatch_size, workload.seq_len, 32), weights_dtype(training.dtype),
                                torch.device("cpu"), training.dtype, None, lambda: None)

    run_ranks_in_threads(plan.live_ranks(), work, fabric.cut, 60)
    expected = reference(config)
    assert set(losses) == set(plan.live_ranks())
    assert all(abs(v - expected) <= 1e-9 * abs(expected) for v in losses.values()), (losses, expected)
