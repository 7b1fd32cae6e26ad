"""Live state transfer for a re-joining worker: a surviving replica of its stage broadcasts the stage's parameters,
buffers and optimizer state (moments and step count) over the stage's process group, as one flat buffer."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from recycle.runtime.optim import StageOptimizer

__all__ = ["TransferStats", "stage_tensors", "transfer_stage_state"]


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    seconds: float


def _tensors_of(obj: Any, out: list[torch.Tensor]) -> None:
    """Every tensor in a nested structure, in a deterministic order (dict keys sorted)."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            _tensors_of(obj[key], out)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _tensors_of(value, out)


def stage_tensors(module: nn.Module, optimizer: StageOptimizer) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """The tensors that make up a stage's state (parameters and buffers, then the optimizer's), and the optimizer's
    state dict they came from. Every replica of a stage yields the same list of shapes in the same order."""
    tensors = list(module.state_dict().values())
    optimizer_state = optimizer.state_dict()
    _tensors_of(optimizer_state, tensors)
    return tensors, optimizer_state


def transfer_stage_state(module: nn.Module, optimizer: StageOptimizer, step: int, is_source: bool,
                         broadcast: Callable[[torch.Tensor], None], device: torch.device) -> tuple[int, TransferStats]:
    """Broadcast the stage's state from the source replica to the joiners (every member of the group calls this;
    `broadcast` sends from the source in place). Returns the optimizer step count the joiners take, and the volume
    moved. The step count and every scalar travel in a float64 header, exactly (they are far below 2**53)."""
    started = time.perf_counter()
    tensors, optimizer_state = stage_tensors(module, optimizer)
    scalars = [float(step)] + [float(v) for v in _scalars(optimizer_state)]
    header = torch.tensor(scalars, dtype=torch.float64, device=device)
    broadcast(header)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        by_dtype.setdefault(tensor.dtype, []).append(tensor)
    moved = header.numel() * header.element_size()
    for dtype, group in sorted(by_dtype.items(), key=lambda item: str(item[0])):
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in group]) if is_source else \
            torch.empty(sum(t.numel() for t in group), dtype=dtype, device=device)
        broadcast(flat)
        moved += flat.numel() * flat.element_size()
        if not is_source:
            offset = 0
            with torch.no_grad():
                for tensor in group:
                    tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
                    offset += tensor.numel()
    if not is_source:
        # The tensors above were filled in place: the parameters share storage with module.state_dict(); the
        # optimizer's state dict may hold copies, so it is loaded back with the transferred scalars (step count).
        values = iter(int(v) for v in header[1:].tolist())
        optimizer.load_state_dict(_with_scalars(optimizer_state, values))
    return int(header[0].item()), TransferStats(moved, time.perf_counter() - started)


def _scalars(obj: Any) -> list[float]:
    out: list[float] = []
    if isinstance(obj, bool):
        return out
    if isinstance(obj, int):
        out.append(float(obj))
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            if key != "hyper":  # hyper-parameters come from the config, the same on every replica
                out += _scalars(obj[key])
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            out += _scalars(value)
    return out


def _with_scalars(obj: Any, values: Any) -> Any:
    """`obj` with its integer scalars replaced, in _scalars' order, by the next of `values`."""
    if isinstance(obj, bool):
        return obj
    if isinstance(obj, int):
        return next(values)
    if isinstance(obj, dict):
        return {key: (obj[key] if key == "hyper" else _with_scalars(obj[key], values)) for key in sorted(obj, key=str)}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_with_scalars(v, values) for v in obj)
    return obj
