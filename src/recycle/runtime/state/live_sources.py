"""How the pre-step snapshot copies a stage's state into the tensors it holds: one plan per layout of the state dict,
copied from the state dict's entries after a walk, or without the walk from the live tensors it found there while
cheap checks say the state dict would still hold exactly them."""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter, is_
from typing import Any, Iterator

import torch
from torch import nn

from recycle.models.tensor_parallel import local_tensor
from recycle.runtime.state.optim import TrainingOptimizer
from recycle.runtime.state.stage_state import PLAIN_TENSORS, STEP_KEY, StageState, copy_state

__all__ = ["LiveSources"]

_SHAPE, _DTYPE = attrgetter("shape"), attrgetter("dtype")


def _module_slots(module: nn.Module, prefix: str) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(state dict key, the dict that holds the tensor, its name there) in module.state_dict()'s order: each module's
    parameters, then its persistent buffers, then its children's (torch.nn.Module._save_to_state_dict). Hooks and
    extra state are not followed: _Watch.of compares the result with the real state dict."""
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


def _aliases(tensor: Any, shown: Any) -> bool:
    """Whether `shown` (a state dict entry) is a detached alias of the module's own `tensor`: the same type, memory,
    shape, strides and dtype (a DTensor's: its shard's memory and strides). A parameter's alias is a plain tensor."""
    if not isinstance(tensor, torch.Tensor) or type(tensor) is not type(shown) and \
            not (type(tensor) in PLAIN_TENSORS and type(shown) in PLAIN_TENSORS):
        return False
    mine, theirs = local_tensor(tensor), local_tensor(shown)
    return mine.data_ptr() == theirs.data_ptr() and mine.stride() == theirs.stride() and \
        tensor.shape == shown.shape and tensor.dtype == shown.dtype


@dataclass(frozen=True)
class _Watch:
    """The live objects behind a state dict's entries (parameters, buffers, the optimizer's per-parameter entries) and
    what must stay as it was for them to still be the state dict's: every module of the stage with the sizes of its
    dicts, every slot still holding the same object, each tensor with the same shape and dtype, the optimizer's state
    dict object. `intact()` checks all of it (tens of microseconds, where the state dict walk and the layout's
    comparison took ~0.3 ms of a ~75 ms small-preset step)."""

    state: StageState
    holders: list[Any]  # dicts and sets whose sizes make the layout (_holders), and their sizes
    sizes: list[int]
    slot_holders: list[dict[Any, Any]]  # each slot: the dict, its key, and the object it must still hold there
    slot_keys: list[Any]
    slot_objects: list[Any]
    entries: dict[str, Any]  # the state dict's entries but the step and the generator's state, live
    tensors: list[torch.Tensor]  # those that are tensors, with their shapes and dtypes (a `.data =` changes them)
    shapes: list[torch.Size]
    dtypes: list[torch.dtype]
    optimizer_state: dict[Any, Any]

    @staticmethod
    def of(state: StageState, live: dict[str, Any]) -> _Watch | None:
        """The watch of `live` (state.state_dict(), just taken), or None where its entries cannot be told without
        the walk: an optimizer that is not a TrainingOptimizer (its state dict may hold anything), hooks or extra
        state that make the state dict differ from the modules' own tensors."""
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
        entries: dict[str, Any] = {}
        for key, holder, name in _module_slots(state.module, state.prefix):
            tensor = holder[name]
            if not _aliases(tensor, live.get(key)):
                return None
            slots.append((holder, name, tensor))
            entries[key] = tensor
        index = {id(p): i for i, p in enumerate(p for group in inner.param_groups for p in group["params"])}
        optimizer_state = inner.state
        holders.append(optimizer_state)
        for param, per_param in optimizer_state.items():
            slots.append((optimizer_state, param, per_param))
            holders.append(per_param)
            for name, value in per_param.items():
                key = state.optimizer_head(index[id(param)]) + name
                if key not in live or live[key] is not value:
                    return None
                slots.append((per_param, name, value))
                entries[key] = value
        if len(entries) + 2 != len(live) or set(entries) | {STEP_KEY, state.rng_key} != set(live):
            return None
        tensors = [value for value in entries.values() if isinstance(value, torch.Tensor)]
        return _Watch(state, holders, list(map(len, holders)), [h for h, _, _ in slots], [k for _, k, _ in slots],
                      [o for _, _, o in slots], entries, tensors, list(map(_SHAPE, tensors)),
                      list(map(_DTYPE, tensors)), optimizer_state)

    def intact(self) -> bool:
        """Whether the state dict would still hold exactly these entries, with these shapes and dtypes. Each check
        runs as one C loop (map): the Python loops took ~50 us."""
        optimizer = self.state.optimizer
        return isinstance(optimizer, TrainingOptimizer) and optimizer.optimizer.state is self.optimizer_state \
            and list(map(len, self.holders)) == self.sizes \
            and all(map(is_, map(dict.get, self.slot_holders, self.slot_keys), self.slot_objects)) \
            and list(map(_SHAPE, self.tensors)) == self.shapes and list(map(_DTYPE, self.tensors)) == self.dtypes


@dataclass(frozen=True)
class _Pack:
    """Watched plain tensors of one dtype and device, each contiguous, copied by one torch.cat into one buffer whose
    views are the snapshot's tensors: one op where _foreach_copy_ runs one copy_ per tensor on a CPU (~25 % of the
    copy's time at ~100 tensors; docs/runtime-performance.md). Their 1-D aliases are made once, so `intact()` checks
    that each source still has the memory they alias and is contiguous (a `.data =` of the same shape moves it)."""

    sources: list[torch.Tensor]
    flat: list[torch.Tensor]
    pointers: list[int]
    buffer: torch.Tensor

    @staticmethod
    def of(keys: list[str], entries: dict[str, Any], saved: dict[str, Any]) -> _Pack:
        """The pack of `keys` (watched, contiguous, of one dtype and device), whose buffer takes over the snapshot's
        values from `saved`, and `saved` its views in their place."""
        sources = [entries[key] for key in keys]
        flat = [source.detach().view(-1) for source in sources]
        buffer = torch.empty(sum(map(torch.Tensor.numel, flat)), dtype=flat[0].dtype, device=flat[0].device)
        torch.cat([saved[key].reshape(-1) for key in keys], out=buffer)
        offset = 0
        for key, source in zip(keys, flat):
            saved[key] = buffer[offset:offset + source.numel()].view(saved[key].shape)
            offset += source.numel()
        return _Pack(sources, flat, list(map(torch.Tensor.data_ptr, sources)), buffer)

    def intact(self) -> bool:
        return list(map(torch.Tensor.data_ptr, self.sources)) == self.pointers and \
            all(map(torch.Tensor.is_contiguous, self.sources))

    def copy(self) -> None:
        torch.cat(self.flat, out=self.buffer)


def _packs(watch: _Watch, fused: tuple[str, ...], saved: dict[str, Any]) -> tuple[_Pack, ...]:
    """The watched plain contiguous tensors among `fused`, packed by dtype and device (two or more to a pack)."""
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for key in fused:
        entry: Any = watch.entries.get(key)
        if type(entry) in PLAIN_TENSORS and entry.is_contiguous():
            groups.setdefault((entry.dtype, entry.device), []).append(key)
    return tuple(_Pack.of(keys, watch.entries, saved) for keys in groups.values() if len(keys) > 1)


@dataclass(frozen=True)
class LiveSources:
    """The snapshot's copy for one layout of the state dict: its keys in order; the plain tensors' keys (`fused`),
    copied in one _foreach_copy_ into `targets` (the snapshot's tensors of the same shape, dtype and device); the
    other entries (a tensor-parallel stage's DTensors, None, numbers), copied as copy_state copies them; and where it
    can be told, the watch that finds the same values without walking the state dict, with its plain tensors packed
    (`packs`) and the rest (`rest`: the steps done, the generator's state, any other) copied one by one."""

    state: StageState
    keys: tuple[str, ...]
    fused: tuple[str, ...]
    targets: list[torch.Tensor]
    layout: list[tuple[type, torch.Size, torch.dtype, torch.device]]
    others: tuple[str, ...]
    watch: _Watch | None
    packs: tuple[_Pack, ...] = ()
    rest_sources: tuple[Any, ...] = ()  # watched, ending with the step's and the generator's places (None)
    rest_targets: tuple[torch.Tensor, ...] = ()

    @staticmethod
    def of(state: StageState, live: dict[str, Any], saved: dict[str, Any], watch: bool = True) -> LiveSources | None:
        """The copy of `live` (state.state_dict(), just taken) into `saved` (its snapshot, which holds every key of
        `live`), with a watch unless `watch` is False; None where a plain tensor's target is not one of its shape,
        dtype and device (copy_state must copy it). A watch's packs put their views into `saved`."""
        fused = tuple(key for key, value in live.items() if type(value) in PLAIN_TENSORS)
        others = tuple(key for key, value in live.items() if type(value) not in PLAIN_TENSORS)
        layout = [(type(t), t.shape, t.dtype, t.device) for t in map(live.__getitem__, fused)]
        if any(type(t) not in PLAIN_TENSORS or (t.shape, t.dtype, t.device) != shown[1:]
               for t, shown in zip(map(saved.__getitem__, fused), layout)):
            return None
        watched = _Watch.of(state, live) if watch else None
        if watched is None:
            return LiveSources(state, tuple(live), fused, [saved[key] for key in fused], layout, others, None)
        packs = _packs(watched, fused, saved)
        packed = {ident for pack in packs for ident in map(id, pack.sources)}
        rest = [key for key in fused if key in (STEP_KEY, state.rng_key) or id(watched.entries[key]) not in packed]
        if rest[-2:] != [STEP_KEY, state.rng_key]:
            raise RuntimeError(f"the state dict's last entries are not {STEP_KEY!r}, {state.rng_key!r}: {rest[-2:]}")
        return LiveSources(state, tuple(live), fused, [saved[key] for key in fused], layout, others, watched, packs,
                           (*map(watched.entries.__getitem__, rest[:-2]), None, None),
                           tuple(map(saved.__getitem__, rest)))

    def fits(self, live: dict[str, Any]) -> bool:
        """Whether `live` (a walk's) has this layout: the same keys in the same order, and each plain tensor of the
        same type, shape, dtype and device."""
        return tuple(live) == self.keys and \
            [(type(t), t.shape, t.dtype, t.device) for t in map(live.__getitem__, self.fused)] == self.layout

    def intact(self) -> bool:
        """Whether copy() may run: the watch says the state dict would still hold exactly its entries, and each pack
        that its tensors are where it found them."""
        return self.watch is not None and self.watch.intact() and all(pack.intact() for pack in self.packs)

    def copy(self, saved: dict[str, Any]) -> None:
        """Copy the state into `saved` without walking the state dict (only while intact()): the watched entries,
        the steps done and the CPU generator's state, the values state_dict() would give."""
        assert self.watch is not None
        rng = torch.get_rng_state()
        if rng.shape != self.rest_targets[-1].shape:  # never for one generator; a mismatch would broadcast silently
            raise RuntimeError(f"the CPU generator's state changed size: {tuple(rng.shape)}, the snapshot holds "
                               f"{tuple(self.rest_targets[-1].shape)}")
        step = torch.tensor(self.state.position.done, dtype=torch.int64)
        with torch.no_grad():  # the sources are parameters: a copy must not be recorded by autograd
            for pack in self.packs:
                pack.copy()
            torch._foreach_copy_(self.rest_targets, [*self.rest_sources[:-2], step, rng])
        if self.others:
            entries = self.watch.entries
            saved.update(copy_state({key: entries[key] for key in self.others}, saved))

    def copy_from(self, live: dict[str, Any], saved: dict[str, Any]) -> None:
        """Copy `live` (a walk's, of this layout, or the watch's entries) into `saved`: the plain tensors in one call,
        without copy_state's checks per key, the others as copy_state copies them. The values are the same."""
        with torch.no_grad():  # the sources are parameters: a copy must not be recorded by autograd
            torch._foreach_copy_(self.targets, list(map(live.__getitem__, self.fused)))
        if self.others:
            saved.update(copy_state({key: live[key] for key in self.others}, saved))
