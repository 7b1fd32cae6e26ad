"""Clients of the job store: `StoreClient`, a `torch.distributed.Store` over an authenticated connection (so the
process groups' own rendezvous runs through it too), and `LocalStore`, the same calls on the server's data in the
server's own process. Both add `try_get` and `wait_any` to c10d's calls."""

from __future__ import annotations

import collections
import contextlib
import datetime
import socket
import threading
import time
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Sequence

import torch.distributed as dist

from recycle.errors import ConfigError
from recycle.runtime.protocol.store.data import KeyValue, Waiter
from recycle.runtime.protocol.store.wire import (AUTH_FAILED, MAGIC, MAGIC_FAMILY, MAX_FRAME_BYTES, NONCE_BYTES,
                                                 FrameReader, Op, Session, Status, WireError, client_proof,
                                                 encode_frame, new_nonce, pack_fields, pack_handshake, server_proof,
                                                 token_key, unpack_fields)

__all__ = ["StoreClient", "LocalStore", "StoreFenced", "StoreAuthError", "StoreUnavailable", "StoreInterrupted"]

Value = str | bytes


class StoreFenced(Exception):
    """The coordinator fenced this process (it was declared dead, e.g. while frozen): it must stop, and it cannot
    read or write anything of the job any more."""


class StoreAuthError(ConfigError):
    """The store and this process do not share the job token (or the address is not a recycle job store)."""


class StoreUnavailable(dist.DistStoreError):
    """The store cannot be reached, or the connection broke in the middle of a request."""


class StoreInterrupted(StoreUnavailable):
    """Another thread of this process cut the request short (the generation it belonged to was aborted)."""


def _bytes(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _ms(timeout: datetime.timedelta | float) -> int:
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    return max(0, int(seconds * 1000))


class StoreClient(dist.Store):
    """One authenticated connection to the job store, for one thread at a time (calls are serialised).

    `identity` ("worker/3/<incarnation>") is what the coordinator fences by. `on_fenced` is called, once, when the
    store says this process is fenced (the worker's watcher uses it to exit with one line); the call then raises
    StoreFenced."""

    # dist.Store's property, which set_timeout sets (c10d's rendezvous may too); torch's stub lacks it.
    timeout: datetime.timedelta

    def __init__(self, host: str, port: int, token: str, identity: str, timeout_s: float = 300.0,
                 connect_timeout_s: float = 60.0, on_fenced: Callable[[], None] | None = None) -> None:
        super().__init__()
        self.set_timeout(datetime.timedelta(seconds=timeout_s))
        self.host, self.port, self.identity = host, port, identity
        self._token = token
        self._key = token_key(token)
        self._connect_timeout_s = connect_timeout_s
        self._on_fenced = on_fenced
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._session: Session | None = None
        self._reader = FrameReader(MAX_FRAME_BYTES)
        self._frames: collections.deque[bytes] = collections.deque()  # read, not yet taken (_recv_frame)
        self._interrupted = False
        self.fenced = False
        with self._lock:
            self._connect()

    def clone(self) -> "StoreClient":
        return StoreClient(self.host, self.port, self._token, self.identity, self.timeout.total_seconds(),
                           self._connect_timeout_s, self._on_fenced)

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    # -- c10d's calls --------------------------------------------------------------------------------------------
    def set(self, key: str, value: Value) -> None:
        self._call(Op.SET, (_bytes(key), _bytes(value)))

    def get(self, key: str) -> bytes:
        """Block until `key` exists (at most the store timeout), as c10d's get does."""
        timeout_ms = _ms(self.timeout)
        status, fields = self._call(Op.GET, (_bytes(key), str(timeout_ms).encode()), wait_ms=timeout_ms)
        if status == Status.TIMEOUT:
            raise dist.DistStoreError(f"timed out after {timeout_ms / 1e3:g} s waiting for key {key!r} in the "
                                      f"job store at {self.where}")
        return fields[0]

    def add(self, key: str, value: int) -> int:
        return int(self._call(Op.ADD, (_bytes(key), str(int(value)).encode()))[1][0])

    def check(self, keys: list[str]) -> bool:
        return self._call(Op.CHECK, tuple(_bytes(k) for k in keys))[1][0] == b"1"

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        timeout_ms = _ms(self.timeout if timeout is None else timeout)
        status, _ = self._call(Op.WAIT, (str(timeout_ms).encode(), *(_bytes(k) for k in keys)), wait_ms=timeout_ms)
        if status == Status.TIMEOUT:
            raise dist.DistStoreError(f"timed out after {timeout_ms / 1e3:g} s waiting for {len(keys)} key(s) "
                                      f"({', '.join(keys[:3])}{', ...' if len(keys) > 3 else ''}) in the job store "
                                      f"at {self.where}")

    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
        return self._call(Op.COMPARE_SET, (_bytes(key), _bytes(expected_value), _bytes(desired_value)))[1][0]

    def delete_key(self, key: str) -> bool:
        return self._call(Op.DELETE, (_bytes(key),))[1][0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(Op.NUM_KEYS, ())[1][0])

    def multi_set(self, keys: list[str], values: list[Value]) -> None:
        fields: list[bytes] = []
        for key, value in zip(keys, values, strict=True):
            fields += [_bytes(key), _bytes(value)]
        self._call(Op.MULTI_SET, tuple(fields))

    def multi_get(self, keys: list[str]) -> list[bytes]:
        timeout_ms = _ms(self.timeout)
        status, fields = self._call(Op.MULTI_GET, (str(timeout_ms).encode(), *(_bytes(k) for k in keys)),
                                    wait_ms=timeout_ms)
        if status == Status.TIMEOUT:
            raise dist.DistStoreError(f"timed out after {timeout_ms / 1e3:g} s waiting for {len(keys)} key(s) in "
                                      f"the job store at {self.where}")
        return fields

    def append(self, key: str, value: Value) -> None:
        self._call(Op.APPEND, (_bytes(key), _bytes(value)))

    # -- recycle's calls -----------------------------------------------------------------------------------------
    def try_get(self, key: str) -> bytes | None:
        """The value of `key`, or None when it does not exist (one round trip, no wait)."""
        status, fields = self._call(Op.GET, (_bytes(key), b"0"))
        return fields[0] if status == Status.OK else None

    def wait_any(self, keys: list[str], timeout_s: float, wake: Sequence[Any] = (),
                 beat: str | None = None) -> int | None:
        """Block until one of `keys` exists: its index, or None after `timeout_s`, or sooner once one of `wake`
        (file descriptors, or objects with a fileno(): a process sentinel, a pipe) is readable: the store is then
        told to end the wait, one more request, so a long wait costs the store nothing while nothing happens.
        `beat`: a key the store adds 1 to first, in the same request (a node launcher's heartbeat)."""
        timeout_ms = _ms(timeout_s)
        head = (Op.WAIT_ANY_BEAT, (_bytes(beat),)) if beat is not None else (Op.WAIT_ANY, ())
        status, fields = self._call(head[0], (*head[1], str(timeout_ms).encode(), *(_bytes(k) for k in keys)),
                                    wait_ms=timeout_ms, wake=wake)
        return int(fields[0]) if status == Status.OK else None

    def ping(self) -> None:
        self._call(Op.PING, ())

    def interrupt(self) -> None:
        """From another thread: make the call in progress (and the next one) raise StoreInterrupted; later calls
        reconnect."""
        self._interrupted = True
        sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def clear_interrupt(self) -> None:
        """Forget an interrupt that came after the call it was meant for had already returned."""
        with self._lock:
            if self._interrupted:
                self._interrupted = False
                self._disconnect()

    def close(self) -> None:
        with self._lock:
            self._disconnect()

    # -- the connection ------------------------------------------------------------------------------------------
    def _call(self, op: Op, fields: tuple[bytes, ...], wait_ms: int = 0,
              wake: Sequence[Any] = ()) -> tuple[Status, list[bytes]]:
        with self._lock:
            if self._interrupted:
                self._interrupted = False
                self._disconnect()
                raise StoreInterrupted(f"a call to the job store at {self.where} was interrupted")
            if self.fenced:
                raise StoreFenced(f"this process ({self.identity}) was fenced by the job's coordinator")
            if self._sock is None:
                self._connect()
            assert self._sock is not None and self._session is not None
            try:
                self._sock.settimeout(wait_ms / 1e3 + max(30.0, self._connect_timeout_s))
                self._sock.sendall(encode_frame(self._session.seal(pack_fields(op, fields))))
                if wake and not self._answered_before(wake, wait_ms / 1e3):
                    self._sock.sendall(encode_frame(self._session.seal(pack_fields(Op.CANCEL, ()))))
                    reply = self._session.open(self._recv_frame())  # the wait's (answered, or cut short)
                    if reply[:1] != bytes((Status.FENCED,)):  # (a fenced connection answers nothing more)
                        self._session.open(self._recv_frame())  # the cancel's
                else:
                    reply = self._session.open(self._recv_frame())
            except (OSError, WireError, EOFError) as exc:
                interrupted, self._interrupted = self._interrupted, False
                self._disconnect()
                if interrupted:
                    raise StoreInterrupted(f"a call to the job store at {self.where} was interrupted") from None
                raise StoreUnavailable(f"lost the connection to the job store at {self.where} "
                                       f"({_describe(exc)})") from None
            status_byte, values = unpack_fields(reply)
            status = Status(status_byte)
            if status == Status.FENCED:
                self._disconnect()
                self._fence()
            if status == Status.BAD_REQUEST:
                raise ValueError(f"the job store refused a request: {values[0].decode(errors='replace')}")
            return status, values

    def _fence(self) -> None:
        first = not self.fenced
        self.fenced = True
        if first and self._on_fenced is not None:
            self._on_fenced()
        raise StoreFenced(f"this process ({self.identity}) was fenced by the job's coordinator")

    def _answered_before(self, wake: Sequence[Any], timeout_s: float) -> bool:
        """Wait until the store's reply starts to arrive (True) or one of `wake` is readable or `timeout_s` (and the
        socket's own slack) passes (False)."""
        assert self._sock is not None
        if self._frames or self._reader.buffer:
            return True
        ready = mp_connection.wait([self._sock, *wake], timeout=timeout_s + max(30.0, self._connect_timeout_s))
        return self._sock in ready

    def _recv_frame(self) -> bytes:
        """The next reply: one request at a time, and a cancelled wait's two replies are read one at a time too, so
        the reader holds at most one more."""
        assert self._sock is not None
        self._frames.extend(self._reader.feed(b""))
        while not self._frames:
            data = self._sock.recv(1 << 20)
            if not data:
                raise EOFError("the store closed the connection")
            self._frames.extend(self._reader.feed(data))
        return self._frames.popleft()

    def _disconnect(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            except OSError:
                pass
        self._sock, self._session = None, None
        self._reader = FrameReader(MAX_FRAME_BYTES)
        self._frames.clear()

    def _connect(self) -> None:
        """Connect and authenticate, retrying a refused, reset or dropped attempt (the store may be starting, or busy
        shedding a flood of foreign connections) until the connect timeout."""
        deadline = time.monotonic() + self._connect_timeout_s
        delay, last = 0.02, "no attempt"
        while True:
            try:
                self._handshake(socket.create_connection((self.host, self.port),
                                                         timeout=max(0.1, min(5.0, deadline - time.monotonic()))))
                return
            except (StoreAuthError, StoreFenced):
                raise
            except (OSError, WireError, EOFError) as exc:
                self._disconnect()
                last = _describe(exc)
            if time.monotonic() + delay > deadline:
                raise StoreUnavailable(f"cannot reach the job store at {self.where} within "
                                       f"{self._connect_timeout_s:g} s ({last}); check that the job's first node "
                                       "(or its coordinator) runs and that --master-addr/--master-port point at it")
            time.sleep(delay)
            delay = min(1.0, delay * 2)

    def _handshake(self, sock: socket.socket) -> None:
        self._sock = sock
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._reader = FrameReader(64)
        hello = self._recv_frame()
        if not hello.startswith(MAGIC) or len(hello) != len(MAGIC) + NONCE_BYTES:
            self._disconnect()
            if hello.startswith(MAGIC_FAMILY):
                raise StoreAuthError(f"{self.where} is a recycle job store of another version (its wire protocol is "
                                     f"{hello[:len(MAGIC)].decode('ascii', 'replace')!r}, this process speaks "
                                     f"{MAGIC.decode()!r}); every process of a run must be the same recycle version")
            raise StoreAuthError(f"{self.where} answered, but not as a recycle job store; check --master-addr and "
                                 "--master-port")
        server_nonce, client_nonce = hello[len(MAGIC):], new_nonce()
        identity = self.identity.encode()
        sock.sendall(encode_frame(pack_handshake(client_nonce, identity,
                                                 client_proof(self._key, server_nonce, client_nonce, identity))))
        reply = self._recv_frame()
        if reply == AUTH_FAILED:
            self._disconnect()
            raise StoreAuthError(f"the job store at {self.where} refused this process's job token: no job there "
                                 "runs with this token. Give every node the same RECYCLE_JOB_TOKEN or --token-file")
        if len(reply) != 33 or not _same(reply[1:], server_proof(self._key, server_nonce, client_nonce, identity)):
            self._disconnect()
            raise StoreAuthError(f"the process at {self.where} could not prove that it knows the job token: it is "
                                 "not this job's store; check --master-addr and --master-port")
        self._session = Session(self._key, server_nonce, client_nonce, client=True)
        self._reader = FrameReader(MAX_FRAME_BYTES)
        if reply[0] == Status.FENCED:
            self._disconnect()
            self._fence()


class _Signal:
    """A socket pair that turns readable when a wrapped callback runs: a wait in this process can sleep on it beside
    other file descriptors (multiprocessing.connection.wait)."""

    def __enter__(self) -> "_Signal":
        self._reader, self._writer = socket.socketpair()
        return self

    def __exit__(self, *exc: object) -> None:
        self._reader.close()
        self._writer.close()

    def fileno(self) -> int:
        return self._reader.fileno()

    def wrap(self, callback: Callable[[int], None]) -> Callable[[int], None]:
        def called(index: int) -> None:
            self._writer.send(b"x")  # first: once the callback has run, the pair may be closed
            callback(index)
        return called


def _same(a: bytes, b: bytes) -> bool:
    import hmac

    return hmac.compare_digest(a, b)


def _describe(exc: BaseException) -> str:
    if isinstance(exc, socket.timeout):
        return "timed out"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


class LocalStore:
    """The job store's calls on its data in the server's own process (the coordinator's view: no socket, no
    fencing, the same semantics)."""

    def __init__(self, data: KeyValue, timeout_s: float = 300.0) -> None:
        self.data = data
        self.timeout = datetime.timedelta(seconds=timeout_s)

    def set(self, key: str, value: Value) -> None:
        self.data.set(_bytes(key), _bytes(value))

    def get(self, key: str) -> bytes:
        if self._wait_for([_bytes(key)], False, self.timeout.total_seconds()) is None:
            raise dist.DistStoreError(f"timed out after {self.timeout.total_seconds():g} s waiting for key {key!r}")
        return self.data.get(_bytes(key)) or b""

    def try_get(self, key: str) -> bytes | None:
        return self.data.get(_bytes(key))

    def add(self, key: str, value: int) -> int:
        return self.data.add(_bytes(key), int(value))

    def check(self, keys: list[str]) -> bool:
        return self.data.check([_bytes(k) for k in keys])

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        seconds = (self.timeout if timeout is None else timeout).total_seconds()
        if self._wait_for([_bytes(k) for k in keys], False, seconds) is None:
            raise dist.DistStoreError(f"timed out after {seconds:g} s waiting for {len(keys)} key(s)")

    def wait_any(self, keys: list[str], timeout_s: float, wake: Sequence[Any] = (),
                 beat: str | None = None) -> int | None:
        if beat is not None:
            self.data.add(_bytes(beat), 1)
        return self._wait_for([_bytes(k) for k in keys], True, timeout_s, wake)

    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
        return self.data.compare_set(_bytes(key), _bytes(expected_value), _bytes(desired_value))

    def delete_key(self, key: str) -> bool:
        return self.data.delete(_bytes(key))

    def take(self, keys: list[bytes]) -> list[bytes | None]:
        """The values of `keys` (None where absent), deleted: records each read once (the coordinator's digests)."""
        return self.data.take(keys)

    def num_keys(self) -> int:
        return self.data.num_keys()

    def multi_set(self, keys: list[str], values: list[Value]) -> None:
        # (a recovery's thousands of views: str keys and bytes values, converted with no call per item)
        self.data.multi_set([(k.encode() if type(k) is str else _bytes(k), v if type(v) is bytes else _bytes(v))
                             for k, v in zip(keys, values, strict=True)])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        return [self.data.get(_bytes(k)) or b"" for k in keys]

    def _wait_for(self, keys: list[bytes], any_of: bool, timeout_s: float, wake: Sequence[Any] = ()) -> int | None:
        event, found = threading.Event(), []

        def ready(index: int) -> None:
            found.append(index)
            event.set()

        with contextlib.ExitStack() as cleanup:
            signal = cleanup.enter_context(_Signal()) if wake else None
            waiter = Waiter(tuple(keys), any_of, ready if signal is None else signal.wrap(ready))
            if self.data.register(waiter):
                return found[0]
            if signal is not None:
                mp_connection.wait([signal.fileno(), *wake], timeout=max(0.0, timeout_s))
            else:
                event.wait(max(0.0, timeout_s))
            if not event.is_set() and self.data.cancel(waiter):
                return None
            event.wait()  # it fired (the signal is written first, so this is at most a moment)
            return found[0]
