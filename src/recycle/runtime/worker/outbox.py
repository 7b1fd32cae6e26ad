"""A worker's writes to the job store, kept so that training never waits for the control plane: while the store is
away (its coordinator died) they wait here and the worker trains on; when the store answers again they are written,
and when it is another store (a restarted coordinator's, which starts empty) the worker first writes again what that
store lacks (its announcement, stop report, recent step records, checkpoint flags) and says where it stands. Step
records go through a writer thread of their own (`start_writer`), so that a step never waits for a round trip."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from recycle.runtime.protocol.channels import Channel, Keys
from recycle.runtime.protocol.records import WorkerResync, to_json
from recycle.runtime.protocol.store import StoreUnavailable

__all__ = ["Outbox", "SilentOutbox", "KEPT"]

# How many writes of each kind are kept to be written again to a restarted coordinator's store; a kind not named here
# is written once and forgotten. 64 step records cover a coordinator that is back within 64 steps; records older than
# that are reported lost (Outbox.dropped) rather than held without bound.
KEPT = {"metrics": 64, "checkpointed": 8, "eval": 4, "announce": 1, "stopped": 1, "join": 1}


@dataclass
class _Write:
    op: str  # "set" or "add"
    value: bytes
    kind: str  # a KEPT kind, or "" (not kept once written)
    order: int  # the step of a step record (the oldest one kept is reported), else 0
    sent: bool
    local: bool = False  # to the node launcher's own store (which forwards it), not the job's


def _apply(store: Any, key: str, write: _Write) -> None:
    if write.op == "add":
        store.add(key, int(write.value))
    else:
        store.set(key, write.value)


class Outbox:
    """Writes of one worker, from any of its threads, each on that thread's own store connection.

    While the store answers and nothing waits, a write goes straight through. Once a write finds the store away
    (`down`), later ones queue behind it in order; the watcher thread calls `sync` until the store answers, which
    writes the queue (and, to a new store, everything kept, then `status()`).

    A `background` write (a step record, once `start_writer` has run) is queued and written by the writer thread on
    its own connection. Writes after it queue behind it until it is in, so the store sees every write in the order
    it was made. With a node store (`start_writer(store, node_store)`), background writes go there instead: the node
    launcher forwards them (control.node_steps), and writes them again to a restarted coordinator itself."""

    def __init__(self, rank: int, status: Callable[[], WorkerResync] | None = None) -> None:
        self.rank = rank
        self._lock = threading.RLock()  # sync calls status(), which reads oldest_record()
        self._writes: OrderedDict[str, _Write] = OrderedDict()
        self._unsent = 0
        self.down = False
        self.instance: bytes | None = None  # the store's instance id, as last seen
        self._seen = False  # the instance has been read once
        self.status = status
        self.dropped = 0  # writes pushed out unsent by KEPT's bound (an outage longer than it)
        self.resyncs = 0  # new stores this worker told where it stands
        self._io = threading.Lock()  # one thread at a time writes the queue (the writer or the watcher's sync)
        self._queued = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self._node_store: Any = None
        self._writer_error: BaseException | None = None  # what stopped the writer (the store fenced this worker)

    # -- writes --------------------------------------------------------------------------------------------------
    def put(self, store: Any, channel: Channel[Any], record: Any, *key: int, kind: str = "", order: int = 0,
            background: bool = False) -> None:
        self.write(store, channel.key(*key), to_json(record).encode(), kind=kind, order=order, background=background)

    def write(self, store: Any, key: str, value: bytes | str, kind: str = "", op: str = "set", order: int = 0,
              background: bool = False) -> None:
        write = _Write(op, value.encode() if isinstance(value, str) else value, kind, order, False)
        with self._lock:
            if self._writer_error is not None:
                raise self._writer_error
            if background and self._writer is not None:
                write.local = self._node_store is not None
                self._keep(key, write)
                self._queued.notify()
                return
            if not self.down and not self._unsent:
                try:
                    _apply(store, key, write)
                    write.sent = True
                except StoreUnavailable:
                    self.down = True  # the watcher writes it once the store answers
            if write.sent and not kind:
                return
            self._keep(key, write)
            if not write.sent and self._writer is not None:
                self._queued.notify()  # it queued behind a background write: the writer takes it too

    def start_writer(self, store: Any, node_store: Any = None) -> None:
        """Write background writes from a thread of its own, on `store` or, given one, on `node_store` (connections
        no other thread uses)."""
        with self._lock:
            if self._writer is None:
                self._node_store = node_store
                self._writer = threading.Thread(target=self._write_forever, args=(store,), daemon=True,
                                                name="recycle-outbox")
                self._writer.start()

    def _write_forever(self, store: Any) -> None:
        while True:
            with self._lock:
                while not self._unsent or (self.down and not self._unsent_local()):
                    self._queued.wait(1.0)
            try:
                self._flush(store)
            except StoreUnavailable:
                with self._lock:
                    self.down = True  # the watcher's sync writes the queue once the store answers again
            except BaseException as exc:  # the store fenced this worker: its next write raises it
                with self._lock:
                    self._writer_error = exc
                return

    def _flush(self, store: Any) -> None:
        """Write the queue in order, each write outside the lock: the training thread queues meanwhile."""
        with self._io:
            while True:
                with self._lock:
                    pending = next(((k, w) for k, w in self._writes.items()
                                    if not w.sent and (w.local or not self.down)), None)
                    if pending is None:
                        return
                key, write = pending
                _apply(self._node_store if write.local else store, key, write)
                with self._lock:
                    if self._writes.get(key) is write:  # not replaced or pushed out meanwhile (_keep counted those)
                        write.sent = True
                        self._unsent -= 1
                        if not write.kind:
                            del self._writes[key]

    def remember(self, key: str, value: bytes, kind: str) -> None:
        """A record this worker read and a restarted coordinator's store would lack (the announcement it runs in)."""
        with self._lock:
            self._keep(key, _Write("set", value, kind, 0, True))

    def forget(self, key: str) -> None:
        with self._lock:
            write = self._writes.pop(key, None)
            if write is not None and not write.sent:
                self._unsent -= 1

    def _keep(self, key: str, write: _Write) -> None:
        old = self._writes.pop(key, None)
        if old is not None and not old.sent:
            self._unsent -= 1
        self._writes[key] = write
        self._unsent += not write.sent
        if write.kind:
            same = [k for k, w in self._writes.items() if w.kind == write.kind]
            for stale in same[:max(0, len(same) - KEPT[write.kind])]:
                pushed = self._writes.pop(stale)
                if not pushed.sent:
                    self._unsent -= 1
                    self.dropped += 1

    # -- the watcher's side ----------------------------------------------------------------------------------------
    def needs_sync(self) -> bool:
        return self.down or self._unsent > 0 or not self._seen

    def sync(self, store: Any) -> bool:
        """Write what waits (to a new store: everything kept first, then where this worker stands); True when the
        store is another than before. Raises StoreUnavailable while the store is still away."""
        # Outside the lock: while the store is away this call waits for it (reconnecting), and the training thread
        # must be able to queue its writes meanwhile.
        instance = store.try_get(Keys.STORE_INSTANCE)
        with self._io, self._lock:
            fresh = self._seen and instance != self.instance
            for key, write in list(self._writes.items()):
                if write.local:
                    continue  # the node launcher writes these again to a new store; the writer sends them
                if fresh or not write.sent:
                    _apply(store, key, write)
                    if not write.sent:
                        write.sent = True
                        self._unsent -= 1
                    if not write.kind:
                        del self._writes[key]
            if fresh and self.status is not None:
                store.set(Keys.resync(self.rank), to_json(self.status()))
                self.resyncs += 1
            self.instance, self._seen = instance, True
            self.down = False
            self._queued.notify()
            return fresh

    def _unsent_local(self) -> bool:
        return any(w.local and not w.sent for w in self._writes.values())

    def oldest_record(self) -> int | None:
        """The oldest step whose record is kept (written again to a new store), None when none is."""
        with self._lock:
            steps = [w.order for w in self._writes.values() if w.kind == "metrics"]
        return min(steps) if steps else None

    def flush(self, timeout_s: float = 5.0, poll_s: float = 0.005) -> None:
        """Wait until the queued writes are in the store, unless it is away (that may last) or `timeout_s` passes:
        for a write that must land before what the caller does next (a fault record before the fault)."""
        deadline = time.monotonic() + timeout_s
        self._wait_until(lambda: not self._unsent or self.down or time.monotonic() >= deadline, poll_s)

    def wait_sent(self, poll_s: float = 0.01) -> None:
        """Block until every write has reached the store (the watcher writes them once it answers again)."""
        self._wait_until(lambda: not self.down and not self._unsent, poll_s)

    def _wait_until(self, done: Callable[[], bool], poll_s: float) -> None:
        """Poll `done`; a fence the writer thread met is raised here."""
        while not done():
            if self._writer_error is not None:
                raise self._writer_error
            time.sleep(poll_s)


class SilentOutbox(Outbox):
    """The outbox of a tensor-parallel worker's rank other than 0: the worker speaks to the job through its rank 0
    (the coordinator counts one record per worker), so these ranks write nothing; every rank reads alike."""

    def write(self, store: Any, key: str, value: bytes | str, kind: str = "", op: str = "set", order: int = 0,
              background: bool = False) -> None:
        return

    def remember(self, key: str, value: bytes, kind: str) -> None:
        return

    def needs_sync(self) -> bool:
        return False
