"""The OPT's cheap paths compute what the slower ones did, bit for bit: a stage with one live replica skips the flat
all-reduce copy (a parameter no micro-batch reached still gets a zero gradient, so AdamW decays it and keeps state
for it); the squared gradient norm, one float64 dot product per stage, is the sum of the squares to rounding."""

from __future__ import annotations

import math

import pytest
import torch

from recycle.models.gpt import build_stages
from recycle.runtime.state.optim import allreduce_grads, fill_missing_grads, make_optimizer
from recycle.runtime.tools.fakes import LoneComm
from recycle.runtime.worker.data import data_source
from recycle.runtime.worker.executor import StageExecutor
from recycle.schedules.fault_free import build_schedule


def test_fill_missing_grads_gives_zeros_where_the_all_reduce_did() -> None:
    reached = torch.nn.Parameter(torch.ones(3, dtype=torch.float64))
    reached.grad = torch.full((3,), 2.0, dtype=torch.float64)
    missed = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    grads = fill_missing_grads([reached, missed])
    assert [g.tolist() for g in grads] == [[2.0, 2.0, 2.0], [0.0, 0.0]]
    assert grads[0] is reached.grad and grads[1] is missed.grad
    # The all-reduce over one member leaves the same values.
    other = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    allreduce_grads([other], lambda flat: None)
    assert torch.equal(other.grad, missed.grad)


def test_a_one_replica_stage_steps_a_parameter_no_micro_batch_reached(tiny_config) -> None:
    config = tiny_config(D=1, S=1, M=2, steps=1)
    training = config.training
    plan = build_schedule(config, "1f1b", staggered=True)
    module = build_stages(config.model, 1, training.seed, torch.float64, config.workload.seq_len)[0]
    module.unused = torch.nn.Parameter(torch.full((4,), 3.0, dtype=torch.float64))  # outside the forward
    optimizer = make_optimizer(module, training)
    executor = StageExecutor(plan, 0, module, optimizer, LoneComm(), data_source(config), None, None,
                             torch.float64)
    executor.run_iteration(0)
    # AdamW with a zero gradient: only the decoupled weight decay moves it, and it now has optimizer state.
    expected = torch.full((4,), 3.0, dtype=torch.float64) * (1 - training.lr * training.weight_decay)
    assert torch.equal(module.unused.detach(), expected)
    inner = getattr(optimizer, "optimizer", optimizer)  # a TrainingOptimizer wraps the torch.optim one
    assert module.unused in inner.state


def test_the_squared_norm_is_the_sum_of_every_float64_square_to_rounding(tiny_config) -> None:
    """One float64 buffer dotted with itself: the same squares as pow(2) per tensor, summed in another order (so
    equal to rounding, not bit for bit), and the gradients left alone."""
    config = tiny_config(D=1, S=2, M=2, steps=1)
    plan = build_schedule(config, "1f1b", staggered=True)
    module = build_stages(config.model, 2, config.training.seed, torch.float64, config.workload.seq_len)[1]
    executor = StageExecutor(plan, 1, module, make_optimizer(module, config.training), LoneComm(),
                             data_source(config), None, None, torch.float64)
    generator = torch.Generator().manual_seed(3)
    for p in module.parameters():
        p.grad = torch.randn(p.shape, dtype=p.dtype, generator=generator) * 1e3
    grads = [p.grad.clone() for p in module.parameters()]
    exact = math.fsum(float(x) ** 2 for p in module.parameters() for x in p.grad.detach().double().reshape(-1))
    assert executor._squared_norm() == pytest.approx(exact, rel=1e-14, abs=0.0)
    assert all(torch.equal(p.grad, g) for p, g in zip(module.parameters(), grads))  # the gradients are left alone


def _stepped_executor(config, grad_norm_metric: bool) -> tuple[StageExecutor, list[float]]:
    """A one-stage executor after iteration 0, and the exact sum of squares of the gradients its step applied."""
    plan = build_schedule(config, "1f1b", staggered=True)
    module = build_stages(config.model, 1, config.training.seed, torch.float64, config.workload.seq_len)[0]
    optimizer = make_optimizer(module, config.training)
    applied: list[float] = []
    step = optimizer.step

    def spied_step() -> None:
        applied.append(math.fsum(float(x) ** 2 for p in module.parameters() if p.grad is not None
                                 for x in p.grad.detach().reshape(-1)))
        step()

    optimizer.step = spied_step  # type: ignore[method-assign]
    executor = StageExecutor(plan, 0, module, optimizer, LoneComm(), data_source(config), None, None, torch.float64,
                             grad_clip=config.training.grad_clip, grad_norm_metric=grad_norm_metric)
    executor.run_iteration(0)
    return executor, applied


def test_the_grad_norm_metric_off_computes_no_norm_and_trains_the_same(tiny_config, monkeypatch) -> None:
    """Off (no report wants it): no squared norm is computed and grad_sq is None; on: grad_sq is the sum of the squares
    of the gradients the step applied (to rounding); the weights are the same either way."""
    config = tiny_config(D=1, S=1, M=2, steps=1)
    on, applied = _stepped_executor(config, grad_norm_metric=True)
    assert on.last_result is not None and len(applied) == 1
    assert on.last_result.grad_sq == pytest.approx(applied[0], rel=1e-12, abs=0.0) and applied[0] > 0

    def refused(self: StageExecutor) -> float:
        raise AssertionError("the squared norm was computed with the metric off")

    monkeypatch.setattr(StageExecutor, "_squared_norm", refused)
    monkeypatch.setattr(StageExecutor, "_squared_norms", refused)
    off, _ = _stepped_executor(config, grad_norm_metric=False)
    assert off.last_result is not None and off.last_result.grad_sq is None and off.last_result.grad_norm is None
    assert all(torch.equal(a, b) for a, b in zip(on.module.state_dict().values(), off.module.state_dict().values()))


def test_clipping_computes_the_norm_with_the_metric_off(tiny_config) -> None:
    """The clipping path needs the norm: it reports it whatever the metric option says."""
    config = tiny_config(D=1, S=1, M=2, steps=1, grad_clip=1e9)
    off, applied = _stepped_executor(config, grad_norm_metric=False)
    assert off.last_result is not None and off.last_result.grad_norm is not None
    assert off.last_result.grad_norm ** 2 == pytest.approx(applied[0], rel=1e-12)
