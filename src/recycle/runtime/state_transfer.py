"""Live state transfer for a re-joining worker: a surviving replica of its stage broadcasts the stage's parameters,
buffers and optimizer state (any torch.optim optimizer's, with its schedule position) over the stage's process
group: first the optimizer state's layout as JSON, then the tensors as one flat buffer per dtype."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from recycle.runtime.optim import StageOptimizer

__all__ = ["TransferStats", "transfer_stage_state", "encode_layout", "decode_layout", "group_by_dtype"]


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    seconds: float


def encode_layout(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """A JSON-able description of a state dict: every tensor replaced by its index in `tensors` (appended), shape
    and dtype; dict keys keep their type (optimizer state is keyed by int); tuples stay tuples."""
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return {"t": len(tensors) - 1, "shape": list(obj.shape), "dtype": str(obj.dtype).removeprefix("torch."),
                "cpu": obj.device.type == "cpu"}
    if isinstance(obj, dict):
        return {"d": [[encode_layout(k, tensors), encode_layout(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"tuple": [encode_layout(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [encode_layout(v, tensors) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot transfer optimizer state of type {type(obj).__name__}")


def decode_layout(obj: Any, make: Callable[[dict[str, Any]], torch.Tensor]) -> Any:
    """The inverse of encode_layout; `make(entry)` returns the tensor for a tensor entry."""
    if isinstance(obj, list):
        return [decode_layout(v, make) for v in obj]
    if isinstance(obj, dict):
        if "t" in obj:
            return make(obj)
        if "tuple" in obj:
            return tuple(decode_layout(v, make) for v in obj["tuple"])
        return {decode_layout(k, make): decode_layout(v, make) for k, v in obj["d"]}
    return obj


def group_by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by dtype, groups in a fixed order (by dtype name), each in the given order: sender and
    receiver pack and unpack the same flat buffers (one message per dtype: gloo's per-message cost dominates small
    tensors)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return [groups[dtype] for dtype in sorted(groups, key=str)]


def transfer_stage_state(module: nn.Module, optimizer: StageOptimizer, step: int, is_source: bool,
                         broadcast: Callable[[torch.Tensor], None], device: torch.device) -> tuple[int, TransferStats]:
    """Broadcast the stage's state from the source replica to the joiners (every member of the group calls this;
    `broadcast` sends from the source in place). Returns the training step the joiners continue from, and the volume
    moved. A joiner's optimizer may hold no state yet (torch.optim creates it at the first step), so the layout
    travels first and the joiner allocates what it receives into."""
    started = time.perf_counter()
    params = list(module.state_dict().values())
    optimizer_tensors: list[torch.Tensor] = []
    if is_source:
        layout = encode_layout({"step": step, "optimizer": optimizer.state_dict()}, optimizer_tensors)
        blob = torch.frombuffer(bytearray(json.dumps(layout).encode()), dtype=torch.uint8).to(device)
        size = torch.tensor([blob.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    broadcast(size)
    if not is_source:
        blob = torch.empty(int(size[0]), dtype=torch.uint8, device=device)
    broadcast(blob)
    moved = size.numel() * 8 + blob.numel()
    if not is_source:
        def make(entry: dict[str, Any]) -> torch.Tensor:
            tensor = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]),
                                 device="cpu" if entry["cpu"] else device)
            optimizer_tensors.append(tensor)
            return tensor

        layout = decode_layout(json.loads(bytes(blob.cpu().numpy()).decode()), make)
    for group in group_by_dtype(params + optimizer_tensors):
        dtype = group[0].dtype
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
        # The parameters were filled in place (they share storage with module.state_dict()); the optimizer's state
        # is new tensors, loaded with its step count and schedule position.
        optimizer.load_state_dict(layout["optimizer"])
        step = int(layout["step"])
    return step, TransferStats(moved, time.perf_counter() - started)
