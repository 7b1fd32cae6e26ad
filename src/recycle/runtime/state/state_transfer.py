"""Stage state over torch.distributed: a flat state (runtime.stage_state) goes as its layout in JSON, then its
tensors as one flat buffer per dtype; live state transfer broadcasts a re-joining worker's whole stage state from
a surviving replica of its stage."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from recycle.models.tensor_parallel import local_state
from recycle.runtime.state.stage_state import StageState

__all__ = ["TransferStats", "transfer_stage_state", "send_state", "receive_state", "group_by_dtype"]

Wire = Callable[[torch.Tensor], None]  # sends a tensor, or fills it with the one received (a broadcast does both)


@dataclass(frozen=True)
class TransferStats:
    bytes: int
    seconds: float


def _layout(state: Mapping[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    """A JSON-able description of a flat state: each tensor's shape, dtype and whether it lives on the CPU (an
    optimizer's step counters do), appended to `tensors` in order; plain values as they are."""
    layout: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            tensors.append(value)
            layout[key] = {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                           "cpu": value.device.type == "cpu"}
        elif value is None or isinstance(value, (bool, int, float, str)):
            layout[key] = {"value": value}
        else:
            raise TypeError(f"cannot transfer stage state {key!r} of type {type(value).__name__}")
    return layout


def group_by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The tensors grouped by dtype, groups in a fixed order (by dtype name), each in the given order: sender and
    receiver pack and unpack the same flat buffers (one message per dtype: gloo's per-message cost dominates small
    tensors)."""
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor)
    return [groups[dtype] for dtype in sorted(groups, key=str)]


def send_state(state: Mapping[str, Any], send: Wire, device: torch.device) -> int:
    """Send a flat state (the receiver calls receive_state); returns the bytes sent."""
    tensors: list[torch.Tensor] = []
    blob = torch.frombuffer(bytearray(json.dumps(_layout(state, tensors)).encode()), dtype=torch.uint8).to(device)
    send(torch.tensor([blob.numel()], dtype=torch.int64, device=device))
    send(blob)
    moved = 8 + blob.numel()
    for group in group_by_dtype(tensors):
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in group])
        send(flat)
        moved += flat.numel() * flat.element_size()
    return moved


def receive_state(recv: Wire, device: torch.device) -> tuple[dict[str, Any], int]:
    """The flat state send_state sent, in new tensors (on the CPU where the sender's were), and the bytes received."""
    size = torch.zeros(1, dtype=torch.int64, device=device)
    recv(size)
    blob = torch.empty(int(size[0]), dtype=torch.uint8, device=device)
    recv(blob)
    moved = 8 + blob.numel()
    state: dict[str, Any] = {}
    tensors: list[torch.Tensor] = []
    for key, entry in json.loads(bytes(blob.cpu().numpy()).decode()).items():
        if "value" in entry:
            state[key] = entry["value"]
        else:
            state[key] = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]),
                                     device="cpu" if entry["cpu"] else device)
            tensors.append(state[key])
    for group in group_by_dtype(tensors):
        flat = torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype, device=device)
        recv(flat)
        moved += flat.numel() * flat.element_size()
        offset = 0
        for tensor in group:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
    return state, moved


def transfer_stage_state(state: StageState, is_source: bool, broadcast: Wire,
                         device: torch.device) -> TransferStats:
    """Broadcast the stage's state from the source replica to the joiners (every member of the group calls this;
    `broadcast` sends from the source in place): parameters, optimizer state and schedule position, and the
    iteration position the joiners continue from. A joiner's optimizer may hold no state yet (torch.optim creates it
    at the first step), so the layout travels first and the joiner allocates what it receives into."""
    started = time.perf_counter()
    if is_source:
        # A tensor-parallel stage sends this rank's shards: the group is this TP rank's (runtime.transport), so each
        # joiner rank receives its own shards from the source's same rank.
        moved = send_state(local_state(state.state_dict()), broadcast, device)
    else:
        received, moved = receive_state(broadcast, device)
        state.load_state_dict(received)
    return TransferStats(moved, time.perf_counter() - started)
