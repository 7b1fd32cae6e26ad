"""Communication for one generation of live workers: torch.distributed groups on a generation-prefixed store,
p2p send/recv addressed by topology rank, and the per-stage, tied-weight and all-worker SUM all-reduces."""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from recycle.runtime.options import Backend
from recycle.runtime.protocol.channels import Keys
from recycle.runtime.protocol.messages import Message, message_tag
from recycle.runtime.worker.group_sockets import SocketSet, cut
from recycle.runtime.worker.nccl_env import init_kwargs

# Benchmarks only (bench_frozen_peers.py): leave an aborted gloo generation's connections open, as before survivors
# cut their own groups, to measure that path side by side.
_NO_CUT = os.environ.get("RECYCLE_TEST_NO_CUT") == "1"

__all__ = ["Transport", "PostedRecv", "GenerationGroups", "GenerationCut", "PeerLost", "Activity", "is_comm_error",
           "default_backend", "tied_ranks"]


def default_backend() -> Backend:
    """NCCL when CUDA is present, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


class PeerLost(RuntimeError):
    """A p2p op, collective or group formation failed because a peer died, froze, timed out or the generation was
    cut: the worker leaves the generation and reports (not a bug to stop the run for)."""


def is_comm_error(exc: BaseException) -> bool:
    """Whether `exc` ends a generation rather than the run: the transport's PeerLost (and GenerationCut), a
    torch.distributed error (the job store's among them), or a peer's failure raised by a collective outside the
    transport (a tensor-parallel stage's DTensor all-reduce inside its forward or backward: a RuntimeError whose
    text only says so)."""
    return isinstance(exc, (PeerLost, GenerationCut, dist.DistError)) or _is_peer_error(exc)


_PEER_ERROR_TEXTS = ("Connection closed by peer", "Connection reset", "Timed out waiting", "pair closure",
                     "Broken pipe", "Transport endpoint", "NCCL", "gloo")


def _is_peer_error(exc: BaseException) -> bool:
    """What gloo and NCCL raise when the other side is gone: only these texts tell it (torch raises RuntimeError)."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(s in text for s in _PEER_ERROR_TEXTS)


@dataclass
class GenerationGroups:
    """The process groups of one generation: the world of live workers, each stage's live replicas, and the live
    workers of the stages that hold a tied weight (a tied model's first and last stage), if any.

    With tensor parallelism (`tp_degree` T > 1) each worker is T processes and the world holds all of them, worker
    after worker (world rank = index of the worker among the live ones x T + TP rank). The plan's traffic and the
    stage and tied groups then run per TP rank: rank t of a worker talks to rank t of the others (its "plane"), and
    each worker's T ranks form its own group (`tp_group`)."""

    live_ranks: list[int]  # topology ranks, ascending; index = worker index in this generation's world
    stage_ranks: dict[int, list[int]]  # stage -> topology ranks of its live replicas
    stage_groups: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    tied_ranks: list[int] = field(default_factory=list)  # topology ranks, ascending
    tied_group: dist.ProcessGroup | None = None
    tp_rank: int = 0  # this process's rank inside its worker
    tp_degree: int = 1
    tp_group: dist.ProcessGroup | None = None  # this worker's T ranks (T > 1 only)

    def group_rank(self, topology_rank: int) -> int:
        """The world rank of the worker `topology_rank`'s process of this process's TP rank."""
        return self.live_ranks.index(topology_rank) * self.tp_degree + self.tp_rank

    def plane(self, topology_ranks: list[int], tp_rank: int) -> list[int]:
        """The world ranks of TP rank `tp_rank` of the workers `topology_ranks`."""
        return [self.live_ranks.index(r) * self.tp_degree + tp_rank for r in topology_ranks]


class Activity:
    """What the main thread is doing, for the watcher's beats (records.Beat): actions started, and the phase."""

    def __init__(self) -> None:
        self.actions = 0
        self.phase = "idle"

    def action(self) -> None:
        self.actions += 1
        self.phase = "compute"


@contextlib.contextmanager
def _peer_op(activity: Activity, what: str, message: Message | None = None) -> Iterator[None]:
    """A p2p op, collective or formation: its wait is on a peer ("comm"), and a peer's failure comes out as PeerLost
    (naming the op, and `message` after it if given; torch's own text after that). The message is formatted only
    when the op fails: a send or receive is on every action's path, a dataclass repr is not free. (Transport.send
    and recv do the same inline: a generator context manager costs more than the rest of their Python.)"""
    previous = activity.phase
    activity.phase = "comm"
    try:
        yield
    except Exception as exc:
        if not _is_peer_error(exc):
            raise
        raise _peer_lost(exc, what, message) from None
    finally:
        activity.phase = previous


def _peer_lost(exc: BaseException, what: str, message: Message | None) -> PeerLost:
    named = what if message is None else f"{what} {message}"
    return PeerLost(f"{named}: {(str(exc).splitlines() or [type(exc).__name__])[0][:300]}")


@dataclass(frozen=True)
class PostedRecv:
    """A receive posted ahead of its need (Transport.post_recv): the message, gloo's work and the buffer it fills."""

    message: Message
    work: dist.Work
    buffer: torch.Tensor


class Transport:
    """p2p and collectives among the live workers of one generation.

    Sends are asynchronous; their handles and buffers are kept until `flush()` (called at the end of every
    iteration), so a buffer is never reused while in flight. Receives block at the point of need (`recv`), or on gloo
    are posted ahead and taken there (`post_recv`, `take`). Collectives and groups all carry the generation's
    timeout. `abort()` may be called from any thread, while forming or while an op is blocked: it cuts every
    communicator of the generation (gloo: its sockets; NCCL: ncclCommAbort), so the blocked op raises at once whether
    or not the peer it waits for will ever answer.
    """

    def __init__(self, store: dist.Store, generation: int, rank: int, live_ranks: list[int],
                 stage_ranks: dict[int, list[int]], timeout_s: float, backend: str, device: torch.device,
                 activity: Activity | None = None, store_peers: set[tuple[str, int]] | None = None,
                 tied_stages: tuple[int, ...] = (), tp_rank: int = 0, tp_degree: int = 1) -> None:
        self.rank = rank
        self.generation = generation
        self.device = device
        self.backend = backend
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.groups = GenerationGroups(sorted(live_ranks), {s: sorted(r) for s, r in stage_ranks.items()},
                                       tied_ranks=tied_ranks(stage_ranks, tied_stages), tp_rank=tp_rank,
                                       tp_degree=tp_degree)
        self.activity = activity if activity is not None else Activity()
        self.formation_s = 0.0
        self._store = store
        self._store_peers = store_peers or set()
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._lock = threading.Lock()
        self._aborted = False
        self._closed = False
        self._forming = False
        self._sockets: SocketSet | None = None
        self._world: dist.ProcessGroup | None = None  # the default group, once used (close() lets go of it)
        self._group_ranks: dict[int, int] = {}

    def form(self) -> None:
        """Create the generation's groups (collective over its live workers); abort() cuts it short."""
        with self._lock:
            if self._aborted:
                raise GenerationCut(f"generation {self.generation} was aborted before it formed")
            self._forming = True
            self._sockets = SocketSet.start(self._store_peers) if self.backend == "gloo" else None
        started = time.perf_counter()
        try:
            with _peer_op(self.activity, f"forming generation {self.generation}"):
                self._form_groups()
        finally:
            with self._lock:
                self._forming = False
                if self._sockets is not None:
                    self._sockets = self._sockets.settled()
        self.formation_s = time.perf_counter() - started
        if self._aborted:  # cut while its last step ran: the groups exist but their connections are gone
            raise GenerationCut(f"generation {self.generation} was aborted while it formed")

    def _form_groups(self) -> None:
        groups = self.groups
        T = groups.tp_degree
        prefixed = dist.PrefixStore(Keys.process_groups(self.generation), self._store)
        dist.init_process_group(self.backend, store=prefixed, rank=groups.group_rank(self.rank),
                                world_size=len(groups.live_ranks) * T, timeout=self.timeout,
                                **init_kwargs(self.device, self.backend))
        # Every process creates every group in the same order (new_group is collective over the world), keeping
        # those of its own TP rank; new_group does not inherit the init timeout, so pass it explicitly.
        for stage in sorted(groups.stage_ranks):
            for t in range(T):
                group = dist.new_group(groups.plane(groups.stage_ranks[stage], t), timeout=self.timeout)
                if t == groups.tp_rank:
                    groups.stage_groups[stage] = group
        if groups.tied_ranks:  # after the stage groups, on every worker alike (the same collective order)
            for t in range(T):
                group = dist.new_group(groups.plane(groups.tied_ranks, t), timeout=self.timeout)
                if t == groups.tp_rank:
                    groups.tied_group = group
        if T > 1:
            mine = groups.live_ranks.index(self.rank)
            for index in range(len(groups.live_ranks)):
                group = dist.new_group(list(range(index * T, (index + 1) * T)), timeout=self.timeout)
                if index == mine:
                    groups.tp_group = group

    # -- p2p ----------------------------------------------------------------------------------------------------
    # send and recv are on every F and B: they call the world group's send/recv themselves, which is what dist.isend
    # and dist.recv come down to for a real tensor in the default group, without their wrappers' checks per call,
    # and _peer_op's work inline (a peer's failure raises PeerLost, the phase is "comm" meanwhile).
    def send(self, message: Message, tensor: torch.Tensor) -> None:
        buffer = tensor.detach().contiguous()
        activity = self.activity
        previous, activity.phase = activity.phase, "comm"
        try:
            work = self._world_group().send([buffer], self._group_rank(message.dst), self._tag(message)) \
                if not buffer.is_complex() else dist.isend(buffer, self._group_rank(message.dst), tag=self._tag(message))
        except Exception as exc:
            if not _is_peer_error(exc):
                raise
            raise _peer_lost(exc, "send", message) from None
        finally:
            activity.phase = previous
        assert work is not None  # None only for a rank outside the default group, which is this generation's world
        self._pending.append((work, buffer))

    def recv(self, message: Message, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        activity = self.activity
        previous, activity.phase = activity.phase, "comm"
        try:
            if not buffer.is_complex():
                self._world_group().recv([buffer], self._group_rank(message.src), self._tag(message)).wait()
            else:
                dist.recv(buffer, self._group_rank(message.src), tag=self._tag(message))
        except Exception as exc:
            if not _is_peer_error(exc):
                raise
            raise _peer_lost(exc, "receive", message) from None
        finally:
            activity.phase = previous
        return buffer

    def post_recv(self, message: Message, shape: tuple[int, ...], dtype: torch.dtype) -> PostedRecv | None:
        """Post the receive of `message` now, to be taken later with `take`; None where only `recv` is offered (NCCL:
        a receive posted on the world communicator ahead of a collective there would order the two differently on
        the two ranks; a complex tensor).

        Why: gloo sends a message's payload only once the receiver has posted its receive (the sender announces it,
        the receiver answers when it posts, then the sender's gloo thread writes it). A receive posted at the point
        of need therefore waits for that round trip, and on a machine whose cores are all busy, for the sender's
        gloo thread to be scheduled. Posted ahead, the payload flows as it is sent and is usually there when needed.
        """
        if self.backend != "gloo":
            return None
        buffer = torch.empty(shape, dtype=dtype, device=self.device)
        if buffer.is_complex():
            return None
        try:
            work = self._world_group().recv([buffer], self._group_rank(message.src), self._tag(message))
        except Exception as exc:
            if not _is_peer_error(exc):
                raise
            raise _peer_lost(exc, "receive", message) from None
        return PostedRecv(message, work, buffer)

    def take(self, posted: PostedRecv) -> torch.Tensor:
        """The tensor of a receive `post_recv` posted, once it has arrived (a peer's failure raises PeerLost)."""
        activity = self.activity
        previous, activity.phase = activity.phase, "comm"
        try:
            posted.work.wait()
        except Exception as exc:
            if not _is_peer_error(exc):
                raise
            raise _peer_lost(exc, "receive", posted.message) from None
        finally:
            activity.phase = previous
        return posted.buffer

    def _world_group(self) -> dist.ProcessGroup:
        """This generation's world (the default group), looked up once."""
        world = self._world
        if world is None:
            world = self._world = dist.distributed_c10d._get_default_group()
        return world

    def _group_rank(self, topology_rank: int) -> int:
        """groups.group_rank, looked up once per peer."""
        rank = self._group_ranks.get(topology_rank)
        if rank is None:
            rank = self._group_ranks[topology_rank] = self.groups.group_rank(topology_rank)
        return rank

    def send_to(self, tensor: torch.Tensor, rank: int) -> None:
        """A blocking send to topology rank `rank` (state moved between workers outside the plan's messages)."""
        with _peer_op(self.activity, f"send to rank {rank}"):
            dist.send(tensor, dst=self.groups.group_rank(rank))

    def recv_from(self, tensor: torch.Tensor, rank: int) -> None:
        with _peer_op(self.activity, f"receive from rank {rank}"):
            dist.recv(tensor, src=self.groups.group_rank(rank))

    def stage_broadcast(self, stage: int, tensor: torch.Tensor, src_rank: int) -> None:
        with _peer_op(self.activity, f"stage {stage} broadcast"):
            dist.broadcast(tensor, src=self.groups.group_rank(src_rank), group=self.groups.stage_groups[stage])

    def _tag(self, message: Message) -> int:
        return message_tag(message.channel, message.mb, message.boundary) if self.backend == "gloo" else 0

    def flush(self) -> None:
        """Wait for every send of this iteration."""
        with _peer_op(self.activity, "waiting for this iteration's sends"):
            for work, _ in self._pending:
                work.wait()
        self._pending.clear()

    # -- collectives ----------------------------------------------------------------------------------------------
    def stage_allreduce_sum(self, stage: int, tensor: torch.Tensor) -> None:
        if len(self.groups.stage_ranks[stage]) > 1:
            with _peer_op(self.activity, f"stage {stage} all-reduce"):
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.groups.stage_groups[stage])

    def tied_allreduce_sum(self, tensor: torch.Tensor) -> None:
        """SUM over every live worker of the stages that hold the tied weight (tied_ranks)."""
        if not self.groups.tied_ranks:  # a tied stage on a transport made without tied_stages: a bug, never silent
            raise RuntimeError("a tied-weight all-reduce on a generation formed without tied stages")
        if len(self.groups.tied_ranks) > 1:
            with _peer_op(self.activity, "tied-weight all-reduce"):
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.groups.tied_group)

    def tp_allreduce_sum(self, tensor: torch.Tensor) -> None:
        """SUM over this worker's T ranks (tensor parallelism; nothing to do with one rank)."""
        if self.groups.tp_group is not None:
            with _peer_op(self.activity, "tensor-parallel all-reduce"):
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.groups.tp_group)

    def world_allreduce_sum(self, tensor: torch.Tensor) -> None:
        """SUM over every live process (every worker; with tensor parallelism, each of its T ranks)."""
        if len(self.groups.live_ranks) * self.groups.tp_degree > 1:
            with _peer_op(self.activity, "world all-reduce"):
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    def barrier(self) -> None:
        """All live workers meet here (a one-element all-reduce: works on every backend and honours the timeout)."""
        self.world_allreduce_sum(torch.zeros(1, device=self.device))

    # -- the end of a generation --------------------------------------------------------------------------------
    def abort(self) -> None:
        """Cut the generation's communicators, from any thread; idempotent. Needs nothing from any peer. Under the
        lock, so that close() (and with it the next generation's formation) waits for a cut in progress: a late cut
        can never reach the next generation."""
        with self._lock:
            if self._closed:
                return
            self._aborted = True
            if self._forming:
                interrupt = getattr(self._store, "interrupt", None)
                if interrupt is not None:
                    interrupt()  # a rendezvous wait for a peer that will never come
            if self.backend == "gloo":
                if self._sockets is not None and not _NO_CUT:
                    cut(self._sockets)
            elif dist.is_initialized():
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()  # every communicator of the job (ncclCommAbort), from this thread

    def close(self, abort: bool = False) -> None:
        """Leave this generation's groups. `abort`: after a failure, cut the communicators first (a broken one is
        never destroyed without an abort: NCCL would wait on the dead peer, gloo on a silent one), which is also how
        every peer still blocked on this worker learns at once that the generation is over."""
        self._pending.clear()
        self._world = None  # the last reference to the group must go for gloo to close its sockets (below)
        if abort:
            self.abort()
        with self._lock:
            self._closed = True
        clear = getattr(self._store, "clear_interrupt", None)
        if clear is not None:
            clear()
        if not dist.is_initialized():
            return
        dist.destroy_process_group()
        # gloo closes a group's sockets only when its last reference goes: drop ours (the caller must not keep the
        # exception whose traceback holds the failed op either).
        self.groups.stage_groups.clear()
        self.groups.tied_group = None
        self.groups.tp_group = None


def tied_ranks(stage_ranks: dict[int, list[int]], tied_stages: tuple[int, ...]) -> list[int]:
    """The live topology ranks of the stages that share a tied weight, ascending (none when no weight is tied)."""
    return sorted({r for s in tied_stages for r in stage_ranks.get(s, [])})


class GenerationCut(RuntimeError):
    """The generation was aborted (by this worker's watcher) while it formed."""
