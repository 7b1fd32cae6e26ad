"""Communication for one generation of live workers: torch.distributed groups on a generation-prefixed store,
p2p send/recv addressed by topology rank, and the per-stage and all-worker SUM all-reduces."""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from recycle.runtime.control import Keys
from recycle.runtime.messages import Channel, Message, message_tag

__all__ = ["Transport", "GenerationGroups", "is_comm_error", "default_backend"]


def default_backend() -> str:
    """NCCL when CUDA is present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def is_comm_error(exc: BaseException) -> bool:
    """Whether `exc` is what a collective or p2p op raises when a peer died or timed out."""
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in (
        "Connection closed by peer", "Connection reset", "Timed out waiting", "pair closure", "NCCL", "gloo"))


@dataclass
class GenerationGroups:
    """The process groups of one generation: the world of live workers and each stage's live replicas."""

    live_ranks: list[int]  # topology ranks, ascending; index = rank in this generation's world
    stage_ranks: dict[int, list[int]]  # stage -> topology ranks of its live replicas
    stage_groups: dict[int, object] = field(default_factory=dict)

    def group_rank(self, topology_rank: int) -> int:
        return self.live_ranks.index(topology_rank)


class Transport:
    """p2p and collectives among the live workers of one generation.

    Sends are asynchronous; their handles and buffers are kept until `flush()` (called at the end of every
    iteration), so a buffer is never reused while in flight. Receives block at the point of need. Collectives
    and groups all carry the generation's timeout, so a frozen peer raises instead of hanging.
    """

    def __init__(self, store: dist.Store, generation: int, rank: int, live_ranks: list[int],
                 stage_ranks: dict[int, list[int]], timeout_s: float, backend: str, device: torch.device) -> None:
        self.rank = rank
        self.device = device
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.groups = GenerationGroups(sorted(live_ranks), {s: sorted(r) for s, r in stage_ranks.items()})
        prefixed = dist.PrefixStore(Keys.process_groups(generation), store)
        dist.init_process_group(backend, store=prefixed, rank=self.groups.group_rank(rank),
                                world_size=len(self.groups.live_ranks), timeout=self.timeout)
        # Every worker creates every stage group in the same order (new_group is collective over the world);
        # new_group does not inherit the init timeout, so pass it explicitly.
        for stage in sorted(self.groups.stage_ranks):
            members = [self.groups.group_rank(r) for r in self.groups.stage_ranks[stage]]
            self.groups.stage_groups[stage] = dist.new_group(members, timeout=self.timeout)
        self._pending: list[tuple[object, torch.Tensor]] = []

    # -- p2p ----------------------------------------------------------------------------------------------------
    def send(self, message: Message, tensor: torch.Tensor) -> None:
        buffer = tensor.detach().contiguous()
        work = dist.isend(buffer, self.groups.group_rank(message.dst), tag=self._tag(message))
        self._pending.append((work, buffer))

    def recv(self, message: Message, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(buffer, self.groups.group_rank(message.src), tag=self._tag(message))
        return buffer

    def _tag(self, message: Message) -> int:
        return message_tag(Channel(message.channel), message.mb) if self.backend == "gloo" else 0

    def flush(self) -> None:
        """Wait for every send of this iteration."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()

    # -- collectives ----------------------------------------------------------------------------------------------
    def stage_allreduce_sum(self, stage: int, tensor: torch.Tensor) -> None:
        if len(self.groups.stage_ranks[stage]) > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.groups.stage_groups[stage])

    def world_allreduce_sum(self, tensor: torch.Tensor) -> None:
        if len(self.groups.live_ranks) > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def barrier(self) -> None:
        """All live workers meet here (a one-element all-reduce: works on every backend and honours the timeout)."""
        self.world_allreduce_sum(torch.zeros(1, device=self.device))

    def close(self, abort: bool = False) -> None:
        """Leave this generation's groups. `abort`: after a failure, drop in-flight work first (NCCL would otherwise
        wait on a dead peer in its destructor); on gloo, destroying the group closes its sockets, which is also how
        every peer still blocked on this worker learns at once that the generation is over."""
        self._pending.clear()
        if not dist.is_initialized():
            return
        if abort and self.backend == "nccl":
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        dist.destroy_process_group()
        # gloo closes a group's sockets only when its last reference goes: drop ours (the caller must not keep the
        # exception whose traceback holds the failed op either).
        self.groups.stage_groups.clear()
