"""The pre-step snapshot's copy (runtime.state.live_sources): from the state's tensors held since the last walk while
nothing changed, never once the state dict would hold other tensors; from a walk without per-key checks where nothing
can be held (another optimizer) or the layout is the last one; always the state dict's values."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from recycle.config import Training
from recycle.runtime.state.live_sources import LiveSources
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.rollback import StageSnapshot
from recycle.runtime.state.stage_state import IterationPosition, StageState, copy_state


def _stage(optimizer: str = "AdamW") -> tuple[torch.nn.Module, Any, StageState, StageSnapshot]:
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).double()
    training = Training(lr=0.1, weight_decay=0.01, optimizer=optimizer, momentum=0.9 if optimizer == "SGD" else None)
    opt = make_optimizer(module, training)
    state = StageState(module, opt, 0, IterationPosition())
    return module, opt, state, StageSnapshot(state)


def _step(module: torch.nn.Module, opt: Any, state: StageState) -> None:
    dtype = next(module.parameters()).dtype
    module(torch.randn(5, 4, dtype=dtype)).sum().backward()
    opt.step()
    opt.zero_grad()
    state.position.applied += 1


def _take_and_check(snapshot: StageSnapshot, state: StageState, iteration: int) -> None:
    """Take, then check the snapshot holds exactly what the state dict holds, key for key (values, dtypes, shapes)."""
    expected = copy_state(state.state_dict())
    snapshot.take(iteration)
    held = snapshot._saved
    assert held is not None and list(held) == list(expected)
    for key, value in expected.items():
        assert held[key].dtype == value.dtype and held[key].shape == value.shape, key
        assert torch.equal(held[key], value), key


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_a_take_with_the_same_tensors_reads_no_state_dict_and_restores_exactly(optimizer: str,
                                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    module, opt, state, snapshot = _stage(optimizer)
    for iteration in range(2):  # the first takes: no optimizer state, then its tensors appear
        _take_and_check(snapshot, state, iteration)
        _step(module, opt, state)
    walks = []
    real = StageState.state_dict
    monkeypatch.setattr(StageState, "state_dict", lambda self: walks.append(1) or real(self))
    before = copy_state(real(state))
    snapshot.take(2)
    assert walks == [] and snapshot._copy is not None and snapshot._copy.watch is not None
    _step(module, opt, state)
    snapshot.restore(2)
    after = real(state)
    assert all(torch.equal(after[k], v) for k, v in before.items() if k != state.rng_key)


def test_a_watched_take_copies_each_dtype_in_one_op_not_one_per_tensor() -> None:
    """The watched tensors go to the snapshot in one torch.cat per dtype (the parameters and moments, the moments'
    step counters), the steps done and the generator's state in one _foreach_copy_: no copy_ per tensor."""
    from torch.profiler import ProfilerActivity, profile

    module, opt, state, snapshot = _stage()
    for iteration in range(3):
        _take_and_check(snapshot, state, iteration)
        _step(module, opt, state)
    tensors = sum(isinstance(v, torch.Tensor) for v in state.state_dict().values())
    assert tensors == 18  # 4 parameters, their 8 moments and 4 step counters, the steps done, the generator
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        snapshot.take(3)
    names = [event.name for event in prof.events()]
    assert names.count("aten::cat") == 2 and names.count("aten::copy_") == 2, names
    _take_and_check(snapshot, state, 3)


def _replace_parameter(module: torch.nn.Module, opt: Any) -> None:
    module[0].bias = torch.nn.Parameter(module[0].bias.detach().clone() + 1)  # the optimizer keeps the old one


def _parameter_data_of_another_dtype(module: torch.nn.Module, opt: Any) -> None:
    module[1].weight.data = module[1].weight.data.float()


def _parameter_data_of_another_shape(module: torch.nn.Module, opt: Any) -> None:
    module[1].bias.data = torch.zeros(1, dtype=torch.float64)  # would broadcast into the held (3,) tensor


def _parameter_data_replaced(module: torch.nn.Module, opt: Any) -> None:
    module[1].bias.data = module[1].bias.data + 5  # same object, shape and dtype: copied from it as it is now


def _submodule_replaced(module: torch.nn.Module, opt: Any) -> None:
    module[1] = torch.nn.LayerNorm(3).double()


def _buffer_added(module: torch.nn.Module, opt: Any) -> None:
    module[0].register_buffer("scale", torch.ones(2, dtype=torch.float64))


def _buffer_made_non_persistent(module: torch.nn.Module, opt: Any) -> None:
    module[0].register_buffer("extra", torch.ones(2, dtype=torch.float64))
    module[0]._non_persistent_buffers_set.add("extra")


def _optimizer_state_loaded(module: torch.nn.Module, opt: Any) -> None:
    opt.load_state_dict({**opt.state_dict()})


def _optimizer_tensor_replaced(module: torch.nn.Module, opt: Any) -> None:
    per_param = next(iter(opt.optimizer.state.values()))
    key = next(iter(per_param))
    per_param[key] = per_param[key].clone() + 1


def _state_dict_hook(module: torch.nn.Module, opt: Any) -> None:
    def hook(_: Any, destination: dict[str, Any], prefix: str, __: Any) -> None:
        destination[prefix + "weight"] = destination[prefix + "weight"] * 2
    module[0]._register_state_dict_hook(hook)


@pytest.mark.parametrize("change", [_replace_parameter, _parameter_data_of_another_dtype,
                                    _parameter_data_of_another_shape, _parameter_data_replaced, _submodule_replaced,
                                    _buffer_added, _buffer_made_non_persistent, _optimizer_state_loaded,
                                    _optimizer_tensor_replaced, _state_dict_hook])
def test_every_take_holds_the_state_dict_after_a_change_to_the_state(
        change: Callable[[torch.nn.Module, Any], None]) -> None:
    module, opt, state, snapshot = _stage()
    for iteration in range(3):
        _take_and_check(snapshot, state, iteration)
        _step(module, opt, state)
    change(module, opt)
    _take_and_check(snapshot, state, 3)
    _take_and_check(snapshot, state, 4)  # and the take after it (held again, or walked again)


def test_a_change_is_seen_by_the_check() -> None:
    """Each change above is found by intact() itself, not only by the values it leads to (new data of the same shape
    and dtype too: the packs' aliases would be stale)."""
    for change in (_replace_parameter, _parameter_data_of_another_dtype, _parameter_data_of_another_shape,
                   _parameter_data_replaced, _submodule_replaced, _buffer_added, _buffer_made_non_persistent,
                   _optimizer_state_loaded, _optimizer_tensor_replaced, _state_dict_hook):
        module, opt, state, snapshot = _stage()
        for iteration in range(3):
            snapshot.take(iteration)
            _step(module, opt, state)
        sources = snapshot._copy
        assert sources is not None and sources.intact(), change.__name__
        change(module, opt)
        assert not sources.intact(), change.__name__


class _Wrapped:
    """A StageOptimizer that is not a TrainingOptimizer (the executor takes any)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        self.optimizer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "steps": 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])


def test_no_held_sources_for_an_optimizer_it_cannot_read_without_its_state_dict() -> None:
    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2).double()
    opt = _Wrapped(torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    state = StageState(module, opt, 0, IterationPosition())
    snapshot = StageSnapshot(state)
    for iteration in range(3):
        _take_and_check(snapshot, state, iteration)
        module(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
        state.position.applied += 1
    assert snapshot._copy is not None and snapshot._copy.watch is None
    held = LiveSources.of(state, state.state_dict(), snapshot._saved or {})
    assert held is not None and held.watch is None


def test_an_optimizer_it_cannot_watch_is_copied_from_the_walk_without_checks_per_key(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where nothing can be held, each take walks the state dict and, while its layout is the last one, copies it
    in one call without copy_state; a restore gives back exactly the state before the step."""
    import recycle.runtime.state.rollback as rollback

    torch.manual_seed(0)
    module = torch.nn.Linear(3, 2).double()
    opt = _Wrapped(torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9))
    state = StageState(module, opt, 0, IterationPosition())
    snapshot = StageSnapshot(state)

    def step() -> None:
        module(torch.randn(2, 3, dtype=torch.float64)).sum().backward()
        opt.step()
        opt.zero_grad()
        state.position.applied += 1

    for iteration in range(2):
        _take_and_check(snapshot, state, iteration)
        step()
    per_key = []
    monkeypatch.setattr(rollback, "copy_state", lambda *args: per_key.append(1) or copy_state(*args))
    for iteration in range(2, 4):
        _take_and_check(snapshot, state, iteration)
        step()
    assert per_key == []
    before = copy_state(snapshot._saved or {})
    snapshot.restore(3)
    after = state.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items() if k != state.rng_key)


def test_a_tensor_parallel_stage_is_watched_and_restores_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage of DTensors (one TP rank's, no process group: element-wise ops on one placement) is copied from its
    held tensors too, each DTensor as copy_state copies it, and restores exactly."""
    from torch.distributed.tensor import DTensor

    from recycle.config import ModelSpec
    from recycle.models.gpt import build_stage
    from recycle.models.tensor_parallel import local_state, parallelize_stage
    from recycle.runtime.worker.tensor_parallel import worker_mesh

    module = build_stage(ModelSpec(preset="tiny"), 2, 0, seed=1, dtype="float64", seq_len=8)
    parallelize_stage(module, worker_mesh(2, 1))
    state = StageState(module, make_optimizer(module, Training(lr=0.01)), 0, IterationPosition(-1))
    assert any(isinstance(p, DTensor) for p in module.parameters())
    snapshot = StageSnapshot(state)

    def step(value: float) -> None:
        for p in module.parameters():
            p.grad = torch.full_like(p, value)
        state.optimizer.step()
        state.position.applied += 1

    def take_and_check(iteration: int) -> None:
        expected = copy_state(local_state(state.state_dict()))
        snapshot.take(iteration)
        held = local_state(snapshot._saved or {})
        assert list(held) == list(expected)
        assert all(torch.equal(held[k], v) for k, v in expected.items()), iteration

    for iteration, value in enumerate((0.5, -0.25)):
        take_and_check(iteration)
        step(value)
    walks = []
    real = StageState.state_dict
    monkeypatch.setattr(StageState, "state_dict", lambda self: walks.append(1) or real(self))
    take_and_check(2)
    assert len(walks) == 1  # take_and_check's own walk: the take made none
    before = copy_state(local_state(real(state)))
    step(3.0)
    snapshot.restore(2)
    after = local_state(real(state))
    assert all(torch.equal(after[k], v) for k, v in before.items() if k != state.rng_key)
