"""The job store's server: one network thread serving authenticated peers (wire.py's handshake), with bounded
connections, bounded unauthenticated time and size, waits answered the moment their keys appear, and fencing: the
coordinator can shut out a process by its identity, and from then on every request of that process is answered
FENCED, whatever it was doing when it froze."""

from __future__ import annotations

import errno
import heapq
import logging
import selectors
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

from recycle.runtime.protocol.store.data import KeyValue, Waiter, drain_socket
from recycle.runtime.protocol.store.wire import (AUTH_FAILED, MAGIC, MAX_FRAME_BYTES, MAX_HANDSHAKE_BYTES,
                                                 MAX_KEY_BYTES, FrameReader, Op, Session, Status, WireError,
                                                 client_proof, encode_frame, new_nonce, pack_fields, server_proof,
                                                 token_key, unpack_fields, unpack_handshake)

__all__ = ["StoreServer", "StoreLimits"]

_log = logging.getLogger(__name__)
SEND_CHUNK = 1 << 20  # bytes a flush hands the socket at most (the rest when it is writable again)


@dataclass(frozen=True)
class StoreLimits:
    """What the server grants: a flood of idle or hostile connections costs bounded memory and never locks the job's
    own processes out (the oldest unauthenticated connection is dropped for a new one; clients retry)."""

    max_connections: int = 4096
    max_unauthenticated: int = 64
    handshake_timeout_s: float = 5.0


@dataclass(eq=False)
class _Conn:
    sock: socket.socket
    address: str
    reader: FrameReader
    accepted: float
    nonce: bytes
    out: bytearray = field(default_factory=bytearray)
    session: Session | None = None
    identity: str = ""
    closing: bool = False  # close once `out` is flushed
    events: int = selectors.EVENT_READ
    waiter: Waiter | None = None  # the request in progress (one at a time: clients are synchronous)


class StoreServer:
    """Listens on `address:port` (port 0: any free port); `start()` runs the network thread. Every process of the job
    connects with the job token; in the server's own process, `data` is the same store without a socket."""

    def __init__(self, address: str, port: int, token: str, limits: StoreLimits = StoreLimits(),
                 listener: socket.socket | None = None) -> None:
        self.data = KeyValue()
        self.limits = limits
        self._key = token_key(token)
        self._listener = listener if listener is not None else _listen(address, port)
        self._listener.setblocking(False)
        self.address, self.port = self._listener.getsockname()[:2]
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._conns: dict[socket.socket, _Conn] = {}
        self._pending: OrderedDict[socket.socket, _Conn] = OrderedDict()  # unauthenticated, oldest first
        self._deadlines: list[tuple[float, int, _Conn, Waiter]] = []
        self._deadline_seq = 0
        self._lock = threading.Lock()  # guards `_ready` and the fence sets across threads
        self._ready: list[_Conn] = []  # connections with output queued by another thread
        self._identities: set[str] = set()  # every identity that ever authenticated
        self._fenced: set[str] = set()
        self._fences_pending = False  # a fence not yet applied to the open connections
        self._refused: dict[str, int] = {}  # why -> count since the last warning
        self._last_warning = 0.0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.requests = 0  # served, for benchmarks
        self._listen_again_at = 0.0  # the listener is paused (out of descriptors) until then

    # -- life ----------------------------------------------------------------------------------------------------
    def start(self) -> "StoreServer":
        self._selector.register(self._listener, selectors.EVENT_READ, "listen")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = threading.Thread(target=self._serve, daemon=True, name="recycle-store")
        self._thread.start()
        return self

    def close(self) -> None:
        self._stopped.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(5.0)
        for conn in list(self._conns.values()):
            conn.sock.close()
        self._listener.close()
        self._wake_r.close()
        self._wake_w.close()

    # -- fencing -------------------------------------------------------------------------------------------------
    def fence(self, prefix: str) -> list[str]:
        """Shut out every identity seen so far that starts with `prefix` (e.g. "worker/3/": every process that has
        run as rank 3 until now; a replacement started later has a new identity). Its pending waits are answered
        FENCED at once, and so is every later request, on any of its connections."""
        with self._lock:
            fenced = sorted(i for i in self._identities if i.startswith(prefix))
            self._fenced.update(fenced)
            self._fences_pending = True
        self._wake()
        return fenced

    def is_fenced(self, identity: str) -> bool:
        with self._lock:
            return identity in self._fenced

    def connected(self) -> list[str]:
        """The identities with an open authenticated connection (for diagnostics and tests)."""
        return sorted({c.identity for c in list(self._conns.values()) if c.session is not None})

    # -- the network thread --------------------------------------------------------------------------------------
    def _serve(self) -> None:
        while not self._stopped.is_set():
            timeout = self._next_timeout()
            for key, events in self._selector.select(timeout):
                if key.data == "listen":
                    self._accept()
                elif key.data == "wake":
                    drain_socket(self._wake_r)
                else:
                    conn = key.data
                    if events & selectors.EVENT_READ:
                        self._read(conn)
                    if events & selectors.EVENT_WRITE and conn.sock in self._conns:
                        self._flush(conn)
            self._expire()
            self._resume_listening()
            self._apply_fences()
            with self._lock:
                ready, self._ready = self._ready, []
            for conn in ready:
                if conn.sock in self._conns:
                    self._flush(conn)
            self._warn_refusals()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass

    def _next_timeout(self) -> float:
        now = time.monotonic()
        candidates = [1.0, 0.1] if self._listen_again_at else [1.0]
        if self._deadlines:
            candidates.append(self._deadlines[0][0] - now)
        if self._pending:
            first = next(iter(self._pending.values()))
            candidates.append(first.accepted + self.limits.handshake_timeout_s - now)
        return max(0.0, min(candidates))

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # Out of descriptors: free one from the oldest stranger, or stop listening for a moment (the
                    # listener would stay readable and spin this thread).
                    self._refuse("no file descriptors left for a new connection", None)
                    if self._pending:
                        self._drop(self._pending.popitem(last=False)[1])
                        continue
                    self._pause_listening()
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if len(self._conns) >= self.limits.max_connections:
                self._refuse("connection limit reached", sock)
                continue
            if len(self._pending) >= self.limits.max_unauthenticated:
                _, oldest = self._pending.popitem(last=False)
                self._refuse("too many connections still in their handshake (oldest dropped)", None)
                self._drop(oldest)
            conn = _Conn(sock, f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer),
                         FrameReader(MAX_HANDSHAKE_BYTES), time.monotonic(), new_nonce())
            self._conns[sock] = conn
            self._pending[sock] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)
            self._queue(conn, encode_frame(MAGIC + conn.nonce))

    def _pause_listening(self) -> None:
        try:
            self._selector.unregister(self._listener)
        except (KeyError, ValueError):
            return
        self._listen_again_at = time.monotonic() + 0.1

    def _resume_listening(self) -> None:
        if self._listen_again_at and time.monotonic() >= self._listen_again_at:
            self._listen_again_at = 0.0
            self._selector.register(self._listener, selectors.EVENT_READ, "listen")

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 20)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return
        try:
            for frame in conn.reader.feed(data):
                if conn.closing:
                    break
                if conn.session is None:
                    self._handshake(conn, frame)
                else:
                    self._request(conn, conn.session.open(frame))
        except WireError as exc:
            self._refuse(f"a protocol error ({exc})" if conn.session is not None else
                         "a bad handshake (not a recycle peer, or a wrong job token)", None)
            self._drop(conn)

    def _handshake(self, conn: _Conn, frame: bytes) -> None:
        client_nonce, identity, proof = unpack_handshake(frame)
        self._pending.pop(conn.sock, None)
        if not _equal(proof, client_proof(self._key, conn.nonce, client_nonce, identity)):
            self._refuse("a wrong job token", None)
            conn.closing = True
            self._queue(conn, encode_frame(AUTH_FAILED))
            return
        conn.identity = identity.decode("utf-8", "replace")
        conn.session = Session(self._key, conn.nonce, client_nonce, client=False)
        conn.reader.limit = MAX_FRAME_BYTES
        with self._lock:
            self._identities.add(conn.identity)
            fenced = conn.identity in self._fenced
        status = Status.FENCED if fenced else Status.OK
        conn.closing = fenced
        self._queue(conn, encode_frame(bytes((status,)) + server_proof(self._key, conn.nonce, client_nonce,
                                                                       identity)))

    def _request(self, conn: _Conn, payload: bytes) -> None:
        self.requests += 1
        if self.is_fenced(conn.identity):
            self._reply(conn, Status.FENCED, ())
            conn.closing = True
            return
        op, fields = unpack_fields(payload)
        if any(len(f) > MAX_KEY_BYTES for f in _keys_of(op, fields)):
            self._reply(conn, Status.BAD_REQUEST, (b"a key longer than %d bytes" % MAX_KEY_BYTES,))
            return
        try:
            self._dispatch(conn, op, fields)
        except (ValueError, IndexError) as exc:
            self._reply(conn, Status.BAD_REQUEST, (str(exc).encode()[:200],))

    def _dispatch(self, conn: _Conn, op: int, f: list[bytes]) -> None:
        data = self.data
        if op == Op.SET:
            data.set(f[0], f[1])
            self._reply(conn, Status.OK, ())
        elif op == Op.GET:
            value = data.get(f[0])
            if value is not None or int(f[1]) <= 0:
                self._reply(conn, Status.OK if value is not None else Status.NOT_FOUND,
                            (value,) if value is not None else ())
            else:
                key = f[0]
                self._wait(conn, (key,), False, int(f[1]),
                           lambda _i: self._reply(conn, Status.OK, (data.get(key) or b"",)))
        elif op == Op.ADD:
            self._reply(conn, Status.OK, (str(data.add(f[0], int(f[1]))).encode(),))
        elif op == Op.CHECK:
            self._reply(conn, Status.OK, (b"1" if data.check(f) else b"0",))
        elif op in (Op.WAIT, Op.WAIT_ANY, Op.MULTI_GET, Op.WAIT_ANY_BEAT):
            beat = None
            if op == Op.WAIT_ANY_BEAT:
                beat, f, op = f[0], f[1:], Op.WAIT_ANY
            keys = tuple(f[1:])
            if not keys:
                raise ValueError("a wait for no keys")  # (refused before a beat counts)
            if beat is not None:
                data.add(beat, 1)
            if op == Op.MULTI_GET:
                def answer(i: int) -> None:  # i: the key that ended the wait; a multi_get answers every value
                    self._reply(conn, Status.OK, tuple(data.get(k) or b"" for k in keys))
            else:
                def answer(i: int) -> None:
                    self._reply(conn, Status.OK, (str(i).encode(),))
            self._wait(conn, keys, op == Op.WAIT_ANY, int(f[0]), answer)
        elif op == Op.COMPARE_SET:
            self._reply(conn, Status.OK, (data.compare_set(f[0], f[1], f[2]),))
        elif op == Op.DELETE:
            self._reply(conn, Status.OK, (b"1" if data.delete(f[0]) else b"0",))
        elif op == Op.NUM_KEYS:
            self._reply(conn, Status.OK, (str(data.num_keys()).encode(),))
        elif op == Op.MULTI_SET:
            if len(f) % 2:
                raise ValueError("multi_set needs key, value pairs")
            data.multi_set(list(zip(f[0::2], f[1::2])))
            self._reply(conn, Status.OK, ())
        elif op == Op.APPEND:
            data.append(f[0], f[1])
            self._reply(conn, Status.OK, ())
        elif op == Op.PING:
            self._reply(conn, Status.OK, ())
        elif op == Op.CANCEL:
            # Under the data's lock, which a wait's answer is given under (from any thread): the wait's reply, if it
            # was answered, is queued before this one's, and a wait cancelled here can no longer be answered.
            with data.lock:
                waiter = conn.waiter
                if waiter is not None and data.cancel(waiter):
                    conn.waiter = None
                    self._reply(conn, Status.TIMEOUT, ())
                self._reply(conn, Status.OK, ())
        else:
            raise ValueError(f"unknown op {op}")

    def _wait(self, conn: _Conn, keys: tuple[bytes, ...], any_of: bool, timeout_ms: int,
              answer: Callable[[int], None]) -> None:
        def ready(index: int) -> None:
            conn.waiter = None
            answer(index)

        waiter = Waiter(keys, any_of, ready)
        conn.waiter = waiter
        if self.data.register(waiter):
            return
        if timeout_ms <= 0 and self.data.cancel(waiter):
            # A poll (no wait): answered now, in order with the requests pipelined behind it on the connection.
            conn.waiter = None
            self._reply(conn, Status.TIMEOUT, ())
            return
        self._deadline_seq += 1
        deadline = time.monotonic() + max(0, timeout_ms) / 1e3
        heapq.heappush(self._deadlines, (deadline, self._deadline_seq, conn, waiter))

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, conn, waiter = heapq.heappop(self._deadlines)
            if self.data.cancel(waiter) and conn.sock in self._conns:
                conn.waiter = None
                self._reply(conn, Status.TIMEOUT, ())
        while self._pending:
            sock, conn = next(iter(self._pending.items()))
            if now - conn.accepted < self.limits.handshake_timeout_s:
                break
            self._pending.pop(sock)
            self._refuse("a handshake that did not finish in time", None)
            self._drop(conn)

    def _apply_fences(self) -> None:
        with self._lock:
            if not self._fences_pending:
                return
            self._fences_pending = False
            fenced = set(self._fenced)
        for conn in list(self._conns.values()):
            if conn.session is not None and conn.identity in fenced and not conn.closing:
                if conn.waiter is not None and self.data.cancel(conn.waiter):
                    conn.waiter = None
                    self._reply(conn, Status.FENCED, ())
                    conn.closing = True

    # -- output --------------------------------------------------------------------------------------------------
    def _reply(self, conn: _Conn, status: Status, fields: tuple[bytes, ...]) -> None:
        assert conn.session is not None
        # One request at a time per connection, so replies to it never race; a reply may come from another thread
        # (a key set by the coordinator wakes a wait), which hands the flush to the network thread.
        self._queue(conn, encode_frame(conn.session.seal(pack_fields(status, fields))))

    def _queue(self, conn: _Conn, frame: bytes) -> None:
        mine = threading.current_thread() is self._thread
        with self._lock:
            backlog = bool(conn.out)
            conn.out += frame
            if not mine:
                self._ready.append(conn)
        if mine:
            # With replies already waiting, the socket took no more: the selector flushes them all when it can (its
            # write event is on). A flush per reply copied the whole backlog each time: a client that pipelines
            # thousands of requests before reading (a node reading its workers' views) made that quadratic and
            # stalled every connection of the store.
            if not backlog:
                self._flush(conn)
        else:
            self._wake()

    def _flush(self, conn: _Conn) -> None:
        """Send what is queued (network thread only; never under a lock: a failed send drops the connection), at most
        SEND_CHUNK bytes a call: the rest when the socket can take more."""
        with self._lock:
            pending = bytes(conn.out[:SEND_CHUNK])
        sent = 0
        try:
            while sent < len(pending):
                sent += conn.sock.send(pending[sent:])
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._drop(conn)
            return
        with self._lock:
            del conn.out[:sent]
            left = bool(conn.out)
        if conn.sock not in self._conns:
            return
        if not left and conn.closing:
            self._drop(conn)
            return
        events = selectors.EVENT_READ | (selectors.EVENT_WRITE if left else 0)
        if events != conn.events:
            conn.events = events
            try:
                self._selector.modify(conn.sock, events, conn)
            except (KeyError, ValueError):
                pass

    def _drop(self, conn: _Conn) -> None:
        if self._conns.pop(conn.sock, None) is None:
            return
        self._pending.pop(conn.sock, None)
        if conn.waiter is not None:
            self.data.cancel(conn.waiter)
            conn.waiter = None
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # -- what an outsider causes: at most one warning line a minute ----------------------------------------------
    def _refuse(self, why: str, sock: socket.socket | None) -> None:
        if sock is not None:
            sock.close()
        self._refused[why] = self._refused.get(why, 0) + 1

    def _warn_refusals(self) -> None:
        now = time.monotonic()
        if not self._refused or now - self._last_warning < 60.0:
            return
        self._last_warning = now
        summary = "; ".join(f"{count} x {why}" for why, count in sorted(self._refused.items()))
        self._refused.clear()
        _log.warning("job store on %s:%s dropped connections that are not this job's processes: %s",
                     self.address, self.port, summary)


def _keys_of(op: int, fields: list[bytes]) -> list[bytes]:
    if op in (Op.WAIT, Op.WAIT_ANY, Op.MULTI_GET):
        return fields[1:]
    if op == Op.WAIT_ANY_BEAT:
        return fields[:1] + fields[2:]
    if op in (Op.CHECK,):
        return fields
    if op == Op.MULTI_SET:
        return fields[0::2]
    return fields[:1]


def _equal(a: bytes, b: bytes) -> bool:
    import hmac

    return hmac.compare_digest(a, b)


def _listen(address: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((address, port))
    except OSError:
        listener.close()
        raise
    listener.listen(1024)
    return listener
