"""The job store's keys and values, and the waits on them: thread-safe, with no sockets, so the server's network
thread and an in-process coordinator share one copy and every operation is unit-tested on its own."""

from __future__ import annotations

import socket
import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, TypeVar

__all__ = ["Waiter", "KeyValue", "Feed", "drain_socket"]

F = TypeVar("F", bound="Feed")


def drain_socket(reader: socket.socket) -> None:
    """Read a non-blocking wake-up socket empty (a socket pair whose writer says "look again")."""
    try:
        while reader.recv(4096):
            pass
    except BlockingIOError:
        pass


@dataclass(eq=False)
class Waiter:
    """A pending wait for keys: every one of them (`any_of=False`) or the first that exists. `ready` is called once,
    under the store's lock, with the index of the key that satisfied an any-wait (0 for an all-wait)."""

    keys: tuple[bytes, ...]
    any_of: bool
    ready: Callable[[int], None]
    done: bool = field(default=False)

    def satisfied(self, data: dict[bytes, bytes]) -> int | None:
        if self.any_of:
            return next((i for i, key in enumerate(self.keys) if key in data), None)
        return 0 if all(key in data for key in self.keys) else None


class Feed:
    """The keys written under some prefixes, in order, for a reader in the store's own process (the coordinator):
    it learns what changed instead of polling one key per worker. `fileno()` turns readable when a key is queued, so
    the reader can sleep on it beside other events (multiprocessing.connection.wait).

    Keys under the `quiet` prefixes are only noted, once each until taken (`touched`), and wake nobody: the node
    launchers' heartbeats, thousands a second at scale, which the reader looks at on its own schedule."""

    def __init__(self, prefixes: tuple[bytes, ...], quiet: tuple[bytes, ...] = ()) -> None:
        self.prefixes = prefixes
        self.quiet = quiet
        self._keys: deque[bytes] = deque()
        self._touched: set[bytes] = set()
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._signalled = False
        self._lock = threading.Lock()

    def fileno(self) -> int:
        return self._reader.fileno()

    def publish(self, key: bytes) -> None:
        if not key.startswith(self.prefixes):
            if key.startswith(self.quiet):
                with self._lock:
                    self._touched.add(key)
            return
        with self._lock:
            self._keys.append(key)
            if not self._signalled:
                self._signalled = True
                try:
                    self._writer.send(b"k")
                except BlockingIOError:
                    pass  # already readable

    def publish_many(self, keys: list[bytes]) -> None:
        """publish each of `keys`, in order (a recovery's multi-set writes a key per worker, under no prefix of the
        feed's: that is found from the keys' common prefix, with no look at each key)."""
        if not keys:
            return
        watched = self.prefixes + self.quiet
        # Every key starts with `common`; one that starts with a watched prefix too has one of the two as a prefix
        # of the other.
        low, high = min(keys), max(keys)
        common = low[:next((i for i, (a, b) in enumerate(zip(low, high)) if a != b), min(len(low), len(high)))]
        if any(common.startswith(p) or p.startswith(common) for p in watched):
            for key in keys:
                if key.startswith(watched):
                    self.publish(key)

    def drain(self) -> list[bytes]:
        """The keys written since the last drain (a key written twice comes twice)."""
        with self._lock:
            keys = list(self._keys)
            self._keys.clear()
            if self._signalled:
                self._signalled = False
                drain_socket(self._reader)
        return keys

    def touched(self) -> set[bytes]:
        """The keys under the quiet prefixes written since the last call (each once)."""
        with self._lock:
            keys, self._touched = self._touched, set()
        return keys

    def close(self) -> None:
        self._reader.close()
        self._writer.close()


class KeyValue:
    """c10d store semantics on a dict: `add` keeps decimal text, `compare_set` sets when the value is the expected
    one (or the key is missing and the expected value is empty), waits fire when their keys appear."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._data: dict[bytes, bytes] = {}
        self._waiters: dict[bytes, set[Waiter]] = {}
        self._feeds: list[Feed] = []

    def subscribe(self, prefixes: tuple[bytes, ...], quiet: tuple[bytes, ...] = ()) -> Feed:
        """A feed of the keys written from now on under `prefixes` (and, noted without a wake-up, under `quiet`)."""
        return self.attach(Feed(prefixes, quiet))

    def attach(self, feed: F) -> F:
        """Hand `feed.publish` every key written from now on, under the store's lock, as it is written."""
        with self.lock:
            self._feeds.append(feed)
        return feed

    # -- writes (each wakes the waits on its key) ------------------------------------------------------------------
    def set(self, key: bytes, value: bytes) -> None:
        with self.lock:
            self._data[key] = value
            self._notify(key)

    def multi_set(self, items: list[tuple[bytes, bytes]]) -> None:
        with self.lock:
            self._data.update(items)
            keys = [key for key, _ in items]
            for feed in self._feeds:
                feed.publish_many(keys)
            if self._waiters:  # (thousands of keys, few of them waited on)
                for key in keys:
                    if key in self._waiters:
                        self._wake(key)

    def append(self, key: bytes, value: bytes) -> None:
        with self.lock:
            self._data[key] = self._data.get(key, b"") + value
            self._notify(key)

    def add(self, key: bytes, delta: int) -> int:
        with self.lock:
            current = self._data.get(key, b"0")
            try:
                value = int(current) + delta
            except ValueError:
                raise ValueError(f"key {key[:80]!r} holds a value that is not an integer") from None
            self._data[key] = str(value).encode()
            self._notify(key)
            return value

    def compare_set(self, key: bytes, expected: bytes, desired: bytes) -> bytes:
        with self.lock:
            current = self._data.get(key)
            if (current is None and expected == b"") or current == expected:
                self._data[key] = desired
                self._notify(key)
                return desired
            return expected if current is None else current

    def delete(self, key: bytes) -> bool:
        with self.lock:
            return self._data.pop(key, None) is not None

    def take(self, keys: list[bytes]) -> list[bytes | None]:
        """Each key's value (None where absent), deleted: records read once, many under one hold of the lock."""
        with self.lock:
            pop = self._data.pop
            return [pop(key, None) for key in keys]

    # -- reads ---------------------------------------------------------------------------------------------------
    def get(self, key: bytes) -> bytes | None:
        with self.lock:
            return self._data.get(key)

    def check(self, keys: list[bytes]) -> bool:
        with self.lock:
            return all(key in self._data for key in keys)

    def num_keys(self) -> int:
        with self.lock:
            return len(self._data)

    # -- waits ---------------------------------------------------------------------------------------------------
    def register(self, waiter: Waiter) -> bool:
        """Start `waiter`; True when it is satisfied at once (its `ready` has then been called)."""
        with self.lock:
            index = waiter.satisfied(self._data)
            if index is not None:
                waiter.done = True
                waiter.ready(index)
                return True
            for key in waiter.keys:
                self._waiters.setdefault(key, set()).add(waiter)
            return False

    def cancel(self, waiter: Waiter) -> bool:
        """Stop a wait that has not fired; False when it already fired."""
        with self.lock:
            if waiter.done:
                return False
            waiter.done = True
            self._unregister(waiter)
            return True

    def _unregister(self, waiter: Waiter) -> None:
        for key in waiter.keys:
            waiting = self._waiters.get(key)
            if waiting is not None:
                waiting.discard(waiter)
                if not waiting:
                    del self._waiters[key]

    def _notify(self, key: bytes) -> None:
        for feed in self._feeds:
            feed.publish(key)
        self._wake(key)

    def _wake(self, key: bytes) -> None:
        for waiter in list(self._waiters.get(key, ())):
            index = waiter.satisfied(self._data)
            if index is not None and not waiter.done:
                waiter.done = True
                self._unregister(waiter)
                waiter.ready(index)
