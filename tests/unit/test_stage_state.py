"""The stage state as one flat dict keyed by whole-model names: its keys, an exact round trip into another stage
module, the copy that reuses its tensors, and the wire format that migration and state transfer share."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from recycle.config import Training
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.stage_state import IterationPosition, StageState, copy_state
from recycle.runtime.state.state_transfer import receive_state, send_state

TRAINING = Training(lr=0.1, optimizer="SGD", momentum=0.9)


def _stage(seed: int, steps: int, frozen: bool = False) -> StageState:
    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).double()
    if frozen:
        module[0].bias.requires_grad_(False)
    state = StageState(module, make_optimizer(module, TRAINING), 1, IterationPosition(steps - 1), "stage1.")
    for _ in range(steps):
        module(torch.randn(5, 4, dtype=torch.float64)).sum().backward()
        state.optimizer.step()
        state.optimizer.zero_grad()
    return state


def test_keys_are_the_whole_models_names_and_the_optimizer_state_is_keyed_by_parameter_name() -> None:
    state = _stage(0, 2, frozen=True).state_dict()
    assert list(state) == ["stage1.0.weight", "stage1.0.bias", "stage1.1.weight", "stage1.1.bias",
                           "stage1.1.running_mean", "stage1.1.running_var", "stage1.1.num_batches_tracked",
                           "optimizer.state.stage1.0.weight.momentum_buffer",
                           "optimizer.state.stage1.1.weight.momentum_buffer",
                           "optimizer.state.stage1.1.bias.momentum_buffer", "train.step", "train.rng.stage1"]
    assert int(state["train.step"]) == 2


def test_parameter_of_reads_only_this_stages_optimizer_entries() -> None:
    state = _stage(0, 0)
    assert state.parameter_of("optimizer.state.stage1.1.bias.momentum_buffer") == 3
    assert state.parameter_of("optimizer.state.stage1.1.bias") is None  # a parameter, not one of its entries
    assert state.parameter_of("optimizer.state.stage0.1.bias.momentum_buffer") is None
    assert state.parameter_of("stage1.1.bias") is None


def test_a_state_loads_exactly_into_another_module_with_its_positions() -> None:
    source, target = _stage(0, 3), _stage(1, 1)
    target.position.snapshot = 0
    saved = copy_state(source.state_dict())
    target.load_state_dict({**saved, "optimizer.state.stage0.0.weight.momentum_buffer": torch.zeros(1)})
    assert target.position == IterationPosition(applied=2)
    assert target.optimizer.steps == 3
    loaded = target.state_dict()
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], v) for k, v in saved.items())


def test_loading_a_state_without_a_module_entry_says_which() -> None:
    state = _stage(0, 1)
    entries = state.state_dict()
    del entries["stage1.1.running_mean"]
    with pytest.raises(KeyError, match="stage1.1.running_mean"):
        _stage(1, 0).load_state_dict(entries)


def test_copy_state_writes_into_an_earlier_copy_in_place() -> None:
    live = {"a": torch.ones(3), "b": torch.ones(2), "n": None}
    first = copy_state(live)
    assert first["a"] is not live["a"] and first["n"] is None
    live["a"] += 1
    live["b"] = torch.ones(4)  # another shape: a new tensor
    second = copy_state(live, first)
    assert second["a"] is first["a"] and torch.equal(second["a"], torch.full((3,), 2.0))
    assert second["b"] is not first["b"] and second["b"].shape == (4,)


def test_copy_state_into_an_earlier_copy_is_exact_and_records_no_autograd_history() -> None:
    """The in-place copies (one _foreach_copy_ per device) of parameters, optimizer moments of several dtypes and the
    generator state: equal bit for bit, and the copies stay plain tensors outside autograd."""
    state = _stage(0, 2)
    for p in state.module.parameters():
        p.grad = torch.randn_like(p)
    state.optimizer.step()
    first = copy_state(state.state_dict())
    with torch.no_grad():
        for p in state.module.parameters():
            p.add_(torch.randn_like(p))
    state.optimizer.step()
    live = state.state_dict()
    second = copy_state(live, first)
    for key, value in live.items():
        if isinstance(value, torch.Tensor):
            assert second[key] is first[key], key  # written in place
            assert second[key].dtype == value.dtype and torch.equal(second[key], value), key
            assert not second[key].requires_grad and second[key].grad_fn is None, key


def test_a_state_goes_over_the_wire_exactly_with_its_plain_values() -> None:
    state = {**_stage(0, 2).state_dict(), "optimizer.state.stage1.0.weight.unset": None, "optimizer.lr": 0.5}
    wire: deque[torch.Tensor] = deque()
    sent = send_state(state, lambda t: wire.append(t.clone()), torch.device("cpu"))
    received, got = receive_state(lambda t: t.copy_(wire.popleft()), torch.device("cpu"))
    assert sent == got and not wire
    assert received.keys() == state.keys()
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert received[key].dtype == value.dtype and torch.equal(received[key], value)
        else:
            assert received[key] == value
