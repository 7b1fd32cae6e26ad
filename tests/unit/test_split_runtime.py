"""Split plans on the StageExecutor, every worker on a thread over an in-memory transport: a plan that cuts
micro-batches into pieces, from the start and switched to after a worker leaves, ends with the single-process
reference's parameters (float64, 1e-9); what cannot take split plans says so."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from recycle.errors import ConfigError
from recycle.ir import Plan
from recycle.models.gpt import build_stages
from recycle.planner.api import make_plan
from recycle.planner.options import PlannerOptions
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.tools.fakes import MemoryFabric
from recycle.runtime.tools.reference import reference_train
from recycle.runtime.worker.data import data_source
from recycle.runtime.worker.executor import StageExecutor
from recycle.schedules.fault_free import build_schedule

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SPLIT = PlannerOptions(split_microbatches=True)


def split_config(tiny_config, steps: int = 2):
    """D=4, S=3, M=4, micro-batches of 6 samples: a failure at stage 0 leaves 4 orphans for 3 survivors."""
    config = tiny_config(D=4, S=3, M=4, steps=steps)
    return replace(config, workload=replace(config.workload, microbatch_size=6))


def train_switching(config, plans: list[Plan]) -> dict[int, torch.nn.Module]:
    """Step i runs plans[min(i, last)]; between steps the survivors switch plans (new transport), as after a
    failure. Returns the stage module of every rank live in the last plan."""
    training, workload = config.training, config.workload
    load = data_source(config)
    fabrics = [MemoryFabric.for_plan(p) for p in plans]
    first = plans[0]
    modules: dict[int, torch.nn.Module] = {}
    errors: list[tuple[int, BaseException]] = []
    barriers = [threading.Barrier(len(p.live_ranks()), timeout=60) for p in plans]

    def work(rank: int) -> None:
        try:
            _, stage = first.worker(rank)
            module = build_stages(config.model, first.num_stages, training.seed, "float64", workload.seq_len)[stage]
            modules[rank] = module
            shape = module.boundary_shape(workload.microbatch_size, workload.seq_len)
            executor = StageExecutor(first, rank, module, make_optimizer(module, training), fabrics[0].endpoint(rank),
                                     load, shape, shape, torch.float64)
            for step in range(training.steps):
                index = min(step, len(plans) - 1)
                if rank not in plans[index].live_ranks():
                    return
                if index and step == index:
                    executor.set_plan(plans[index], fabrics[index].endpoint(rank))
                executor.run_iteration(step)
                barriers[index].wait()
        except BaseException as exc:  # noqa: BLE001 -- reported by the test
            errors.append((rank, exc))

    threads = [threading.Thread(target=work, args=(r,)) for r in first.live_ranks()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return {r: modules[r] for r in plans[-1].live_ranks()}


def assert_reference(config, modules: dict[int, torch.nn.Module], tol: float = 1e-9) -> None:
    ref, _ = reference_train(config)
    for rank, module in modules.items():
        for name, value in module.state_dict().items():
            scale = ref[name].abs().max().clamp_min(1e-12)
            assert float((value - ref[name]).abs().max() / scale) < tol, (rank, name)


def test_a_split_plan_trains_exactly_like_the_reference(tiny_config) -> None:
    config = split_config(tiny_config)
    plan = make_plan(config, {(0, 0)}, SPLIT)
    assert plan.pieces and any(p.samples < 6 for p in plan.pieces)  # the test runs real pieces
    assert_reference(config, train_switching(config, [plan]))


def test_a_fault_free_run_switched_to_a_split_plan_matches_the_reference(tiny_config) -> None:
    config = split_config(tiny_config, steps=3)
    before = build_schedule(config, "zb-h1", staggered=True)
    after = make_plan(config, {(0, 1)}, SPLIT)
    assert after.pieces
    assert_reference(config, train_switching(config, [before, after]))


def test_a_wrong_weight_would_be_caught(tiny_config) -> None:
    """The exactness check can fail: pieces weighted as whole micro-batches drift from the reference."""
    config = split_config(tiny_config, steps=1)
    plan = make_plan(config, {(0, 0)}, SPLIT)
    wrong = replace(plan)
    object.__setattr__(wrong, "loss_weight", lambda mb: 1.0 / plan.total_microbatches)
    modules = train_switching(config, [wrong])  # runs without error...
    with pytest.raises(AssertionError):
        assert_reference(config, modules)  # ...and ends away from the reference


def test_what_cannot_run_split_plans_refuses_them(tiny_config) -> None:
    from recycle.api import check_runtime_split

    config = split_config(tiny_config)
    plan = make_plan(config, {(0, 0)}, SPLIT)
    check_runtime_split(config, plan)  # the built-in GPT takes it
    with pytest.raises(ConfigError, match="--model-factory 'x:y'.*built-in GPT only"):
        check_runtime_split(config, plan, model_factory="x:y")
    with pytest.raises(ConfigError, match="--split-microbatches cannot run with --repartition"):
        check_runtime_split(config, None, split_microbatches=True, repartition=True)
    tp = replace(config, topology=replace(config.topology, gpus_per_worker=2))
    with pytest.raises(ConfigError, match="tensor-parallel"):
        check_runtime_split(tp, plan)
    dropping = replace(config, model=replace(config.model, dropout=0.1))
    with pytest.raises(ConfigError, match=r"a plan that splits .* \[model\] dropout = 0.1: a piece draws its own "
                                          r"dropout mask.*set \[model\] dropout = 0"):
        check_runtime_split(dropping, plan)
    check_runtime_split(dropping, make_plan(config, {(0, 0)}))  # whole micro-batches: dropout is the reference's


@pytest.mark.parametrize("extra,words", [
    (["--repartition"], "--split-microbatches cannot run with --repartition"),
    (["--set", "topology.chunks_per_worker=2"], "chunks_per_worker = 2: chunked plans run whole micro-batches"),
    (["--set", "model.dropout=0.1"], "--split-microbatches cannot run with [model] dropout = 0.1: a piece draws its "
                                     "own dropout mask"),
])
def test_recycle_train_refuses_split_microbatches_with_what_cannot_run_them(cli_error, extra, words: str) -> None:
    line = cli_error(["train", "--config", "configs/tiny-gpt.toml", "--split-microbatches", *extra])
    assert words in line


def test_select_plan_makes_the_split_start_plan_only_when_asked(tiny_config) -> None:
    from recycle.api import select_plan

    config = split_config(tiny_config)
    assert select_plan(config, down=("0:0",), split_microbatches=True).pieces
    assert not select_plan(config, down=("0:0",)).pieces
