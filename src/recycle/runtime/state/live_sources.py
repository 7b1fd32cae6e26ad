"""The tensors of a stage's state that the pre-step snapshot copies, held from one walk of the state dict, with the
checks that tell whether they still are the state's: the snapshot's copy without a state dict walk per step."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, is_
from typing import Any, Iterator

import torch
from torch import nn

from recycle.runtime.state.optim import TrainingOptimizer
from recycle.runtime.state.stage_state import PLAIN_TENSORS, STEP_KEY, StageState

__all__ = ["LiveSources"]

_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")


def _module_slots(module: nn.Module, prefix: str) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(state dict key, the dict that holds the tensor, its name there) in module.state_dict()'s order: each module's
    parameters, then its persistent buffers, then its children's (torch.nn.Module._save_to_state_dict). Hooks and
    extra state are not followed: LiveSources.of compares the result with the real state dict."""
    for name, param in module._parameters.items():
        if param is not None:
            yield prefix + name, module._parameters, name
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, module._buffers, name
    for name, child in module._modules.items():
        if child is not None:
            yield from _module_slots(child, f"{prefix}{name}.")


def _tree(module: nn.Module) -> Iterator[nn.Module]:
    yield module
    for child in module._modules.values():
        if child is not None:
            yield from _tree(child)


def _holders(module: nn.Module) -> tuple[Any, ...]:
    """What makes a module's part of the state dict's layout, told by size: a parameter, buffer or child added or
    removed, a buffer made (non-)persistent, a state dict hook registered."""
    return (module._parameters, module._buffers, module._modules, module._non_persistent_buffers_set,
            module._state_dict_hooks, module._state_dict_pre_hooks)


@dataclass(frozen=True)
class LiveSources:
    """The live tensors behind a stage's state dict (parameters, buffers, the optimizer's per-parameter tensors) in a
    fixed order, the snapshot's tensors they are copied into, and what must stay as it was for them to still be the
    state dict's: every module of the stage with the sizes of its dicts, every slot still holding the same tensor
    object with the same shape and dtype, the optimizer's state dict objects. `intact()` checks all of it (tens of
    microseconds, where the state dict walk and a layout comparison took ~0.3 ms of a ~75 ms step)."""

    state: StageState
    holders: list[Any]  # dicts and sets whose sizes make the layout (_holders), and their sizes
    sizes: list[int]
    slot_holders: list[dict[Any, Any]]  # each slot: the dict, its key, and the object it must still hold there
    slot_keys: list[Any]
    slot_objects: list[Any]
    sources: list[torch.Tensor]  # the state's tensors, in the order of `targets`
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    targets: list[torch.Tensor]  # the snapshot's tensors, then its step and RNG state tensors
    optimizer_state: dict[Any, Any]

    @staticmethod
    def of(state: StageState, live: dict[str, Any], saved: dict[str, Any]) -> LiveSources | None:
        """The sources of `live` (state.state_dict(), just taken) copied into `saved` (its snapshot), or None where
        they cannot be told without the walk: an optimizer that is not a TrainingOptimizer, a tensor that is not a
        plain tensor (a DTensor, None, a number), hooks or extra state that make the state dict differ from the
        modules' own tensors."""
        optimizer = state.optimizer
        if not isinstance(optimizer, TrainingOptimizer):
            return None
        inner = optimizer.optimizer
        if getattr(inner, "_optimizer_state_dict_pre_hooks", None) or \
                getattr(inner, "_optimizer_state_dict_post_hooks", None):
            return None
        holders = [holder for m in _tree(state.module) for holder in _holders(m)]
        slots: list[tuple[dict[Any, Any], Any, Any]] = [
            (m._modules, name, child) for m in _tree(state.module) for name, child in m._modules.items()]
        keys, sources = [], []
        for key, holder, name in _module_slots(state.module, state.prefix):
            tensor, shown = holder[name], live.get(key)  # type: Any, Any
            # The state dict holds a detached alias of the module's own tensor: the same memory, shape and strides.
            if type(tensor) not in PLAIN_TENSORS or type(shown) not in PLAIN_TENSORS or \
                    tensor.data_ptr() != shown.data_ptr() or tensor.shape != shown.shape or \
                    tensor.stride() != shown.stride() or tensor.dtype != shown.dtype:
                return None
            slots.append((holder, name, tensor))
            keys.append(key)
            sources.append(tensor)
        index = {id(p): i for i, p in enumerate(p for group in inner.param_groups for p in group["params"])}
        optimizer_state = inner.state
        holders.append(optimizer_state)
        for param, per_param in optimizer_state.items():
            slots.append((optimizer_state, param, per_param))
            holders.append(per_param)
            for name, value in per_param.items():
                key = state.optimizer_head(index[id(param)]) + name
                if type(value) not in PLAIN_TENSORS or live.get(key) is not value:
                    return None
                slots.append((per_param, name, value))
                keys.append(key)
                sources.append(value)
        keys += [STEP_KEY, state.rng_key]
        if len(keys) != len(live) or set(keys) != set(live):
            return None
        targets = [saved[key] for key in keys]
        for target, source in zip(targets, [*sources, live[STEP_KEY], live[state.rng_key]]):
            if type(target) not in PLAIN_TENSORS or target.shape != source.shape or target.dtype != source.dtype:
                return None
        return LiveSources(state, holders, list(map(len, holders)), [h for h, _, _ in slots], [k for _, k, _ in slots],
                           [o for _, _, o in slots], sources, [t.shape for t in sources], [t.dtype for t in sources],
                           targets, optimizer_state)

    def intact(self) -> bool:
        """Whether the state dict would still hold exactly these tensors, with these shapes and dtypes (else the
        snapshot walks it again). Each check runs as one C loop (map): the Python loops took ~50 us."""
        optimizer = self.state.optimizer
        return isinstance(optimizer, TrainingOptimizer) and optimizer.optimizer.state is self.optimizer_state \
            and list(map(len, self.holders)) == self.sizes \
            and all(map(is_, map(dict.get, self.slot_holders, self.slot_keys), self.slot_objects)) \
            and list(map(_SHAPE, self.sources)) == self.shapes and list(map(_DTYPE, self.sources)) == self.dtypes

    def copy(self) -> None:
        """Copy the state into the snapshot's tensors: the sources, the steps done and the CPU generator's state, in
        one call (the values state_dict() would give, copied as copy_state copies them)."""
        state = self.state
        step = torch.tensor(state.position.done, dtype=torch.int64)
        rng = torch.get_rng_state()
        if rng.shape != self.targets[-1].shape:  # never for one generator; a mismatch would broadcast silently
            raise RuntimeError(f"the CPU generator's state changed size: {tuple(rng.shape)}, the snapshot holds "
                               f"{tuple(self.targets[-1].shape)}")
        with torch.no_grad():  # the sources are parameters: a copy must not be recorded by autograd
            torch._foreach_copy_(self.targets, [*self.sources, step, rng])
