"""Transports without a network, shipped for tests and tools: in-memory wires between workers of one process, a
faulty wrapper that loses a peer at a scripted point, and the transport of a stage run alone."""

from __future__ import annotations

import threading
import time
from collections import defaultdict, deque
from typing import Any, Callable, Hashable, Mapping

import torch

from recycle.ir import Plan
from recycle.runtime.protocol.messages import Channel, Message
from recycle.runtime.worker.transport import Activity, GenerationCut, PeerLost, tied_ranks

__all__ = ["MemoryFabric", "MemoryComm", "MemoryNetwork", "FaultyComm", "LoneComm", "run_ranks_in_threads"]


def run_ranks_in_threads(ranks: Any, work: Callable[[int], Any], on_error: Callable[[], Any] = lambda: None,
                         timeout_s: float = 60.0) -> None:
    """work(rank) on a thread per rank, as the workers of one in-memory job. A rank's exception calls `on_error`
    (e.g. cut the fabric, so that the peers blocked on it raise at once) and is raised here after every thread ended,
    with the others'."""
    errors: list[tuple[int, BaseException]] = []

    def run(rank: int) -> None:
        try:
            work(rank)
        except BaseException as exc:  # surfaced in the caller's thread
            errors.append((rank, exc))
            on_error()

    threads = [threading.Thread(target=run, args=(r,)) for r in ranks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    if errors:
        raise AssertionError(f"a worker thread failed: {errors}") from errors[0][1]


class MemoryFabric:
    """The wires of one generation of in-process workers: a FIFO per ordered pair and rank-ordered SUM
    collectives. Every wait ends: with the data, with PeerLost after `timeout_s`, or with PeerLost at once when the
    fabric is `cut` (what a worker's abort of its generation does to every peer blocked on it)."""

    def __init__(self, live_ranks: list[int], stage_ranks: Mapping[int, list[int]], timeout_s: float = 20.0,
                 generation: int = 0, tied_stages: tuple[int, ...] = ()) -> None:
        self.live_ranks = sorted(live_ranks)
        self.stage_ranks = {s: sorted(r) for s, r in stage_ranks.items()}
        self.tied_ranks = tied_ranks(self.stage_ranks, tied_stages)
        self.timeout_s = timeout_s
        self.generation = generation
        self._cond = threading.Condition()
        self._queues: dict[tuple[Hashable, int, int], deque[tuple[Any, torch.Tensor]]] = defaultdict(deque)
        self._parts: dict[tuple[Hashable, int], dict[int, torch.Tensor]] = defaultdict(dict)
        self._results: dict[tuple[Hashable, int], tuple[torch.Tensor, set[int]]] = {}
        self._cut = False

    @classmethod
    def for_plan(cls, plan: Plan, timeout_s: float = 20.0, tied_stages: tuple[int, ...] = ()) -> "MemoryFabric":
        """The fabric of `plan`'s live workers."""
        stages = {s: [plan.rank(p, s) for p in plan.live_replicas(s)] for s in range(plan.num_stages)}
        return cls(plan.live_ranks(), stages, timeout_s, tied_stages=tied_stages)

    def endpoint(self, rank: int, activity: Activity | None = None) -> "MemoryComm":
        return MemoryComm(self, rank, activity)

    def cut(self) -> None:
        with self._cond:
            self._cut = True
            self._cond.notify_all()

    @property
    def is_cut(self) -> bool:
        return self._cut

    # -- what the endpoints call ---------------------------------------------------------------------------------
    def put(self, wire: Hashable, src: int, dst: int, label: Any, tensor: torch.Tensor) -> None:
        with self._cond:
            self._check(f"send {label}")
            self._queues[(wire, src, dst)].append((label, tensor.detach().clone()))
            self._cond.notify_all()

    def take(self, wire: Hashable, src: int, dst: int, what: str) -> tuple[Any, torch.Tensor]:
        with self._cond:
            # Looked up under the lock: a defaultdict inserts on a miss, and a sender's first put racing this
            # lookup would otherwise leave the receiver waiting on a deque nobody fills.
            queue = self._queues[(wire, src, dst)]
            self._wait(lambda: bool(queue), what)
            return queue.popleft()

    def reduce(self, group: Hashable, members: list[int], count: int, rank: int, tensor: torch.Tensor,
               combine: Callable[[dict[int, torch.Tensor]], torch.Tensor], what: str) -> None:
        """The `count`-th collective of `group` among `members`: `tensor` becomes combine(every member's part)."""
        key = (group, count)
        with self._cond:
            self._check(what)
            self._parts[key][rank] = tensor.detach().clone()
            if len(self._parts[key]) == len(members):
                self._results[key] = (combine(self._parts.pop(key)), set())
                self._cond.notify_all()
            self._wait(lambda: key in self._results, what)
            result, taken = self._results[key]
            tensor.copy_(result)
            taken.add(rank)
            if len(taken) == len(members):
                del self._results[key]

    def _check(self, what: str) -> None:
        if self._cut:
            raise PeerLost(f"{what}: generation {self.generation} was cut")

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            self._check(what)
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerLost(f"{what}: timed out after {self.timeout_s:g} s waiting for a peer")
            self._cond.wait(left)


def _rank_ordered_sum(parts: dict[int, torch.Tensor]) -> torch.Tensor:
    """The same sum on every member, whatever the arrival order: deterministic replicas."""
    ranks = sorted(parts)
    total = parts[ranks[0]].clone()
    for rank in ranks[1:]:
        total += parts[rank]
    return total


class MemoryComm:
    """One worker's end of a MemoryFabric: the executor's Comm, and the rest of a generation's transport the worker
    uses (form, abort, close, state moved by rank, the stage broadcast). Receives check the per-pair order: a
    message taken out of its sender's order is an error, as it would be on NCCL."""

    def __init__(self, fabric: MemoryFabric, rank: int, activity: Activity | None = None) -> None:
        self.fabric = fabric
        self.rank = rank
        self.generation = fabric.generation
        self.activity = activity if activity is not None else Activity()
        self.formation_s = 0.0
        self._counts: dict[Hashable, int] = defaultdict(int)

    # -- Comm ------------------------------------------------------------------------------------------------------
    def send(self, message: Message, tensor: torch.Tensor) -> None:
        self.fabric.put("plan", message.src, message.dst, message, tensor)

    def recv(self, message: Message, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        got, tensor = self._waiting(lambda: self.fabric.take("plan", message.src, self.rank, f"receive {message}"))
        if got != message:
            raise RuntimeError(f"rank {self.rank} expected {message} next from {message.src} but got {got}")
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise RuntimeError(f"{message}: got {tuple(tensor.shape)} {tensor.dtype}, expected {shape} {dtype}")
        return tensor

    def flush(self) -> None:
        pass  # a send is complete when it returns

    def stage_allreduce_sum(self, stage: int, tensor: torch.Tensor) -> None:
        members = self.fabric.stage_ranks[stage]
        if len(members) > 1:
            self._collective(("stage", stage), members, tensor, _rank_ordered_sum, f"stage {stage} all-reduce")

    def tied_allreduce_sum(self, tensor: torch.Tensor) -> None:
        members = self.fabric.tied_ranks
        if not members:
            raise RuntimeError("a tied-weight all-reduce on a fabric made without tied stages")
        if len(members) > 1:
            self._collective("tied", members, tensor, _rank_ordered_sum, "tied-weight all-reduce")

    def world_allreduce_sum(self, tensor: torch.Tensor) -> None:
        members = self.fabric.live_ranks
        if len(members) > 1:
            self._collective("world", members, tensor, _rank_ordered_sum, "world all-reduce")

    def barrier(self) -> None:
        self.world_allreduce_sum(torch.zeros(1))

    # -- the rest of a generation's transport ----------------------------------------------------------------------
    def form(self) -> None:
        """Meet every live worker of the generation (a real formation is collective over them too)."""
        started = time.perf_counter()
        if self.fabric.is_cut:
            raise GenerationCut(f"generation {self.generation} was aborted before it formed")
        try:
            self._collective("form", self.fabric.live_ranks, torch.zeros(1), _rank_ordered_sum,
                             f"forming generation {self.generation}")
        except PeerLost:
            if self.fabric.is_cut:
                raise GenerationCut(f"generation {self.generation} was aborted while it formed") from None
            raise
        self.formation_s = time.perf_counter() - started

    def abort(self) -> None:
        self.fabric.cut()

    def close(self, abort: bool = False) -> None:
        if abort:
            self.abort()

    def send_to(self, tensor: torch.Tensor, rank: int) -> None:
        self.fabric.put("state", self.rank, rank, None, tensor)

    def recv_from(self, tensor: torch.Tensor, rank: int) -> None:
        _, got = self._waiting(lambda: self.fabric.take("state", rank, self.rank, f"receive from rank {rank}"))
        tensor.copy_(got)

    def stage_broadcast(self, stage: int, tensor: torch.Tensor, src_rank: int) -> None:
        def from_source(parts: dict[int, torch.Tensor]) -> torch.Tensor:
            return parts[src_rank]

        self._collective(("broadcast", stage), self.fabric.stage_ranks[stage], tensor, from_source,
                         f"stage {stage} broadcast")

    def _collective(self, group: Hashable, members: list[int], tensor: torch.Tensor,
                    combine: Callable[[dict[int, torch.Tensor]], torch.Tensor], what: str) -> None:
        self._counts[group] += 1
        count = self._counts[group]
        self._waiting(lambda: self.fabric.reduce(group, members, count, self.rank, tensor, combine, what))

    def _waiting(self, op: Callable[[], Any]) -> Any:
        """An op whose wait is on a peer: the watcher's beats say "comm" meanwhile, as the real transport's do."""
        previous = self.activity.phase
        self.activity.phase = "comm"
        try:
            return op()
        finally:
            self.activity.phase = previous


class MemoryNetwork:
    """A MemoryFabric per generation, made on first use: `transport` has the signature of runtime.transport.Transport,
    so a worker run in a thread takes it as its transport factory (runtime.worker.Hooks)."""

    def __init__(self, timeout_s: float | None = None) -> None:
        self.timeout_s = timeout_s  # None: each worker's own op timeout
        self._lock = threading.Lock()
        self.fabrics: dict[int, MemoryFabric] = {}

    def transport(self, store: Any, generation: int, rank: int, live_ranks: list[int],
                  stage_ranks: dict[int, list[int]], timeout_s: float, backend: str, device: torch.device,
                  activity: Activity | None = None, store_peers: Any = None,
                  tied_stages: tuple[int, ...] = ()) -> MemoryComm:
        with self._lock:
            fabric = self.fabrics.get(generation)
            if fabric is None:
                fabric = MemoryFabric(live_ranks, stage_ranks, self.timeout_s or timeout_s, generation, tied_stages)
                self.fabrics[generation] = fabric
        return fabric.endpoint(rank, activity)


class FaultyComm:
    """A transport that loses its peer at one point: the `op`-th communication call (0-based: sends, receives,
    collectives, barriers) of its `iteration`-th iteration (0-based, counted by flush(), which the executor calls
    at the end of each) raises PeerLost instead of running. Everything else goes to `inner`."""

    def __init__(self, inner: Any, fail_at: tuple[int, int]) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.iteration = 0
        self.ops = 0
        self.fired = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # form, abort, close, generation, ...: the inner transport's own

    def _op(self, what: str) -> None:
        if not self.fired and (self.iteration, self.ops) == self.fail_at:
            self.fired = True
            raise PeerLost(f"{what}: injected loss of a peer at iteration {self.iteration}, op {self.ops}")
        self.ops += 1

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        self._op(f"send {message}")
        self.inner.send(message, tensor)

    def recv(self, message: Message, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self._op(f"receive {message}")
        return self.inner.recv(message, shape, dtype)

    def flush(self) -> None:
        self.inner.flush()
        self.iteration += 1
        self.ops = 0

    def stage_allreduce_sum(self, stage: int, tensor: torch.Tensor) -> None:
        self._op(f"stage {stage} all-reduce")
        self.inner.stage_allreduce_sum(stage, tensor)

    def tied_allreduce_sum(self, tensor: torch.Tensor) -> None:
        self._op("tied-weight all-reduce")
        self.inner.tied_allreduce_sum(tensor)

    def world_allreduce_sum(self, tensor: torch.Tensor) -> None:
        self._op("world all-reduce")
        self.inner.world_allreduce_sum(tensor)

    def barrier(self) -> None:
        self._op("barrier")
        self.inner.barrier()


class LoneComm:
    """The transport of a worker with no peers (a stage profiled alone, an executor tested alone): a receive is a
    fresh copy of the tensor given for its channel (zeros when none), as a real receive fills a fresh buffer; sends
    and collectives cost nothing. It keeps the messages sent and the last tensors received and sent."""

    def __init__(self, incoming: Mapping[Channel, torch.Tensor | None] | None = None) -> None:
        self.incoming = dict(incoming or {})
        self.sent: list[Message] = []
        self.last_received: torch.Tensor | None = None
        self.last_sent: torch.Tensor | None = None

    def recv(self, message: Message, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        given = self.incoming.get(message.channel)
        self.last_received = given.clone() if given is not None else torch.zeros(shape, dtype=dtype)
        return self.last_received

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        self.sent.append(message)
        self.last_sent = tensor.detach()  # the same storage, without keeping the micro-batch's graph alive

    def flush(self) -> None:
        pass

    def stage_allreduce_sum(self, stage: int, tensor: torch.Tensor) -> None:
        pass

    def tied_allreduce_sum(self, tensor: torch.Tensor) -> None:
        pass

    def world_allreduce_sum(self, tensor: torch.Tensor) -> None:
        pass

    def barrier(self) -> None:
        pass
