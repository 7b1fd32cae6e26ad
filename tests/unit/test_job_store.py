"""The job store as an attacker and as torch.distributed see it: only token holders get in, every frame is
authenticated, a fenced process is refused whatever it does, floods and garbage cost bounded resources and at most
one warning line, and c10d's process groups rendezvous through it."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import struct
import threading
import time

import pytest
import torch
import torch.distributed as dist

from recycle.runtime.protocol.store import (LocalStore, StoreAuthError, StoreClient, StoreFenced, StoreInterrupted,
                                            StoreLimits, StoreServer)
from recycle.runtime.protocol.store.wire import (MAGIC, NONCE_BYTES, FrameReader, Op, Session, Status, WireError,
                                                 encode_frame, pack_fields, token_key, unpack_fields)

pytestmark = pytest.mark.timeout(60)

TOKEN = "ab" * 24


@pytest.fixture()
def server():
    srv = StoreServer("127.0.0.1", 0, TOKEN).start()
    yield srv
    srv.close()


def client(srv: StoreServer, identity: str = "worker/0/a", token: str = TOKEN, **kw) -> StoreClient:
    return StoreClient("127.0.0.1", srv.port, token, identity, timeout_s=kw.pop("timeout_s", 5),
                       connect_timeout_s=kw.pop("connect_timeout_s", 5), **kw)


def test_c10d_calls_have_c10d_semantics(server) -> None:
    c = client(server)
    c.set("k", "v")
    assert c.get("k") == b"v" and c.check(["k"]) and not c.check(["k", "missing"])
    assert c.add("n", 2) == 2 and c.add("n", 3) == 5 and c.get("n") == b"5"
    assert c.compare_set("k", "v", "w") == b"w" and c.compare_set("k", "nope", "x") == b"w"
    assert c.compare_set("fresh", "", "y") == b"y"
    assert c.try_get("missing") is None and c.try_get("k") == b"w"
    assert c.delete_key("k") and not c.delete_key("k")
    c.multi_set(["a", "b"], ["1", "2"])
    assert c.multi_get(["a", "b"]) == [b"1", b"2"]
    assert c.num_keys() == 4  # n, fresh, a, b
    with pytest.raises(dist.DistStoreError, match="timed out after 0.2 s"):
        c.wait(["never"], datetime.timedelta(seconds=0.2))


def test_the_coordinators_take_reads_each_key_once_and_a_client_sees_it_gone(server) -> None:
    c, local = client(server), LocalStore(server.data)
    c.set("node_stopped/1/0/0", b"first")
    c.set("node_stopped/1/1/0", b"second")
    assert local.take([b"node_stopped/1/1/0", b"absent", b"node_stopped/1/0/0"]) == [b"second", None, b"first"]
    assert c.try_get("node_stopped/1/0/0") is None and c.num_keys() == 0
    assert local.take([b"node_stopped/1/0/0"]) == [None]


def test_a_wait_is_answered_the_moment_its_key_appears(server) -> None:
    waiter, writer = client(server, "worker/0/a"), client(server, "worker/1/a")
    threading.Timer(0.2, lambda: writer.set("late", "1")).start()
    started = time.monotonic()
    assert waiter.get("late") == b"1"
    assert 0.15 < time.monotonic() - started < 2.0
    local = LocalStore(server.data)
    threading.Timer(0.2, lambda: local.set("other", "2")).start()  # the coordinator's in-process writes wake too
    assert waiter.wait_any(["never", "other"], 5.0) == 1
    assert waiter.wait_any(["never"], 0.1) is None


def test_replies_queued_for_a_client_that_has_not_read_them_stall_no_one(server) -> None:
    """A client that pipelines many requests before it reads (a node's batch) gets its replies as its socket takes
    them; they are not copied whole on every new reply, which made the store's thread quadratic in the backlog and
    stalled every other connection (300 reads of 256 KB: 75 MB queued)."""
    big = os.urandom(256 << 10)
    client(server, "worker/1/a").set("big", big)
    greedy = client(server, "worker/2/a")
    assert greedy.get("big") == big  # (connected)
    sock, session = greedy._sock, greedy._session
    assert sock is not None and session is not None
    sock.sendall(b"".join(encode_frame(session.seal(pack_fields(Op.GET, (b"big", b"0")))) for _ in range(300)))
    time.sleep(0.2)  # the store has read the requests and queued their replies
    started = time.monotonic()
    other = client(server, "worker/3/a")
    other.set("quick", "1")
    assert other.get("quick") == b"1"
    assert time.monotonic() - started < 2.0
    replies: list[bytes] = []
    while len(replies) < 300:  # and the greedy client gets every reply, in order
        for frame in greedy._reader.feed(sock.recv(1 << 20)):
            status, values = unpack_fields(session.open(frame))
            replies.append(values[0] if status == Status.OK else b"")
    assert all(reply == big for reply in replies)


def test_a_wrong_token_is_refused_at_once_with_a_clear_message(server) -> None:
    started = time.monotonic()
    with pytest.raises(StoreAuthError, match="no job there runs with this token"):
        client(server, token="cd" * 24)
    assert time.monotonic() - started < 5


def test_something_that_is_not_a_job_store_is_named() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def answer() -> None:
        conn, _ = listener.accept()
        conn.sendall(struct.pack(">I", 5) + b"hello")
        time.sleep(1)
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(StoreAuthError, match="not as a recycle job store"):
        StoreClient("127.0.0.1", listener.getsockname()[1], TOKEN, "worker/0/a", connect_timeout_s=5)
    listener.close()


def test_a_job_store_of_another_version_is_named() -> None:
    """The wire's version is the hello's last byte: a process of another recycle version is told so, not that the
    frames' MACs are wrong."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    other = MAGIC[:-1] + bytes([MAGIC[-1] - 1])

    def answer() -> None:
        conn, _ = listener.accept()
        conn.sendall(encode_frame(other + os.urandom(NONCE_BYTES)))
        time.sleep(1)
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(StoreAuthError, match=f"another version .*{other.decode()}.*same recycle version"):
        StoreClient("127.0.0.1", listener.getsockname()[1], TOKEN, "worker/0/a", connect_timeout_s=5)
    listener.close()


@pytest.mark.parametrize("where", ["remote", "local"])
def test_a_beat_rides_on_a_wait_in_one_request(server, where) -> None:
    """A node launcher's heartbeat (an add) and its wait on the coordinator's word go as one request: the beat counts
    at once, before the wait ends, and the wait is a wait."""
    store = client(server) if where == "remote" else LocalStore(server.data)
    requests = server.requests
    threading.Timer(0.3, lambda: LocalStore(server.data).set("order", "1")).start()
    seen: list[bytes | None] = []
    threading.Timer(0.15, lambda: seen.append(server.data.get(b"beat/7"))).start()
    assert store.wait_any(["never", "order"], 10.0, beat="beat/7") == 1
    assert seen == [b"1"]
    assert store.wait_any(["never"], 0.05, beat="beat/7") is None
    assert server.data.get(b"beat/7") == b"2"
    assert server.requests - requests == (2 if where == "remote" else 0)
    if where == "remote":
        with pytest.raises(Exception, match="key longer"):
            store.wait_any(["never"], 0.05, beat="b" * 5000)


def test_an_outsider_cannot_list_read_or_forge_keys(server) -> None:
    """torch's TCPStore client (with its list_keys) gets nothing, and a raw peer that fails the proof is cut."""
    job = client(server)
    job.set("metrics/0/0", "real")
    with pytest.raises(Exception):
        dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=2)).list_keys()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
        hello = raw.recv(4 + len(MAGIC) + NONCE_BYTES)
        assert hello[4:].startswith(MAGIC)
        nonce = os.urandom(NONCE_BYTES)
        fields = [nonce, b"worker/0/evil", os.urandom(32)]
        payload = b"\0" + b"".join(struct.pack(">I", len(f)) + f for f in fields)
        raw.sendall(struct.pack(">I", len(payload)) + payload)
        reply = raw.recv(64)
        assert b"AUTH-FAILED" in reply
        assert raw.recv(64) == b""  # and the connection is closed
    assert job.get("metrics/0/0") == b"real"


def test_frames_are_authenticated_in_order() -> None:
    key = token_key(TOKEN)
    server_nonce, client_nonce = os.urandom(NONCE_BYTES), os.urandom(NONCE_BYTES)
    sender = Session(key, server_nonce, client_nonce, client=True)
    receiver = Session(key, server_nonce, client_nonce, client=False)
    first, second = sender.seal(b"\x01set"), sender.seal(b"\x01again")
    with pytest.raises(WireError):
        receiver.open(second)  # reordered (or a replay of a later frame)
    assert receiver.open(first) == b"\x01set"
    with pytest.raises(WireError):
        receiver.open(first)  # replayed
    tampered = bytearray(second)
    tampered[1] ^= 1
    with pytest.raises(WireError):
        receiver.open(bytes(tampered))
    assert receiver.open(second) == b"\x01again"
    other = Session(token_key("ef" * 24), server_nonce, client_nonce, client=True)
    with pytest.raises(WireError):
        Session(key, server_nonce, client_nonce, client=False).open(other.seal(b"\x01x"))


def test_a_batch_of_frames_sealed_at_once_is_each_frame_sealed_in_turn() -> None:
    key = token_key(TOKEN)
    server_nonce, client_nonce = os.urandom(NONCE_BYTES), os.urandom(NONCE_BYTES)
    one, batch = (Session(key, server_nonce, client_nonce, client=True) for _ in range(2))
    payloads = [b"\x01a", b"\x02" + bytes(300), b"\x08c"]
    assert batch.seal(b"\x01first") == one.seal(b"\x01first")
    assert batch.seal_frames(payloads) == b"".join(encode_frame(one.seal(p)) for p in payloads)
    assert batch.seal(b"\x01after") == one.seal(b"\x01after")  # the sequence went on from the batch
    receiver = Session(key, server_nonce, client_nonce, client=False)
    frames = FrameReader(1 << 20).feed(Session(key, server_nonce, client_nonce, client=True).seal_frames(payloads))
    assert [receiver.open(frame) for frame in frames] == payloads


def test_garbage_floods_and_idle_connections_cost_one_warning_and_lock_no_one_out(caplog) -> None:
    srv = StoreServer("127.0.0.1", 0, TOKEN, StoreLimits(max_unauthenticated=16, handshake_timeout_s=1.0)).start()
    try:
        caplog.set_level(logging.WARNING, logger="recycle.runtime.protocol.store.server")
        idle = [socket.create_connection(("127.0.0.1", srv.port)) for _ in range(200)]
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", srv.port)) as junk:
                junk.sendall(os.urandom(4096))
        with socket.create_connection(("127.0.0.1", srv.port)) as huge:
            huge.sendall(struct.pack(">I", 1 << 30))  # announces a 1 GiB frame before authenticating
        c = client(srv, connect_timeout_s=20)  # retries until the flood has been shed
        c.set("k", "v")
        assert c.get("k") == b"v"
        time.sleep(0.3)
        assert len(srv._pending) <= 16
        for sock in idle:
            sock.close()
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(warnings) <= 1, [r.getMessage() for r in warnings]
        assert all("Traceback" not in r.getMessage() for r in warnings)
    finally:
        srv.close()


def test_a_fenced_process_is_refused_whatever_it_was_doing(server) -> None:
    seen: list[str] = []
    frozen = client(server, "worker/3/old", on_fenced=lambda: seen.append("fenced"))
    other = client(server, "worker/3/old")  # a second connection of the same process (its watcher thread)
    result: list[BaseException] = []

    def wait() -> None:
        try:
            other.get("never")
        except BaseException as exc:  # noqa: BLE001 - the test looks at what it was
            result.append(exc)

    waiting = threading.Thread(target=wait)
    waiting.start()
    time.sleep(0.2)
    assert server.fence("worker/3/") == ["worker/3/old"]
    waiting.join(5)
    assert result and isinstance(result[0], StoreFenced)  # its pending wait is answered at once
    with pytest.raises(StoreFenced):
        frozen.set("metrics/0/3", "stale")
    assert seen == ["fenced"]
    assert LocalStore(server.data).try_get("metrics/0/3") is None
    with pytest.raises(StoreFenced):
        client(server, "worker/3/old")  # nor can it come back on a new connection
    replacement = client(server, "worker/3/new")  # its successor (a new incarnation) is let in
    replacement.set("metrics/0/3", "fresh")
    assert LocalStore(server.data).get("metrics/0/3") == b"fresh"


def test_another_thread_can_cut_a_wait_short(server) -> None:
    c = client(server)
    threading.Timer(0.2, c.interrupt).start()
    started = time.monotonic()
    with pytest.raises(StoreInterrupted):
        c.get("never")
    assert time.monotonic() - started < 2
    c.set("after", "1")  # and the next call reconnects
    assert c.get("after") == b"1"


@pytest.mark.parametrize("where", ["remote", "local"])
def test_a_long_wait_ends_when_something_of_this_process_happens_and_the_connection_goes_on(server, where) -> None:
    """A node launcher waits on the coordinator's word until its next beat, woken when one of its workers ends
    (`wake`: file descriptors). The store is told to end the wait (Op.CANCEL); the next calls see their own replies."""
    store = client(server) if where == "remote" else LocalStore(server.data)
    readable, writer = socket.socketpair()
    try:
        threading.Timer(0.2, lambda: writer.send(b"x")).start()
        started = time.monotonic()
        assert store.wait_any(["never"], 30.0, wake=[readable]) is None
        assert time.monotonic() - started < 5.0
        readable.recv(1)
        store.set("k", "v")
        assert store.try_get("k") == b"v"
        # A key that appears still ends the wait with its index, and nothing is left waiting for the cancelled one.
        threading.Timer(0.2, lambda: LocalStore(server.data).set("late", "1")).start()
        assert store.wait_any(["never", "late"], 30.0, wake=[readable]) == 1
        assert server.data._waiters == {}
        assert store.wait_any(["never"], 0.05, wake=[readable]) is None  # and a timeout is a timeout
    finally:
        readable.close()
        writer.close()


def test_a_wait_answered_while_it_is_cancelled_gives_both_replies_in_order(server) -> None:
    """The coordinator's thread sets a key at the moment the client cancels its wait: whichever comes first, the
    client reads the wait's reply (the index, or a timeout), then the cancel's, and the connection stays in step."""
    c = client(server)
    local = LocalStore(server.data)
    outcomes = set()
    for round_ in range(60):
        readable, writer = socket.socketpair()
        key = f"race{round_}"
        go = threading.Barrier(2)

        def both() -> None:
            go.wait()
            writer.send(b"x")
            local.set(key, "1")

        thread = threading.Thread(target=both)
        thread.start()
        go.wait()
        outcomes.add(c.wait_any([key], 30.0, wake=[readable]))
        thread.join()
        readable.close()
        writer.close()
        c.set("after", str(round_))
        assert c.get("after") == str(round_).encode() and c.try_get(key) == b"1"
    assert outcomes <= {0, None}


def test_a_wait_cut_short_on_a_fenced_connection_says_fenced(server) -> None:
    """The store answers a fenced process's wait FENCED and nothing more (not the cancel): the client says fenced,
    as on any other call, not that the store went away."""
    c = client(server, "worker/5/a")
    c.set("up", "1")
    readable, writer = socket.socketpair()
    try:
        writer.send(b"x")  # already woken: the cancel follows the wait at once
        server.fence("worker/5/")
        with pytest.raises(StoreFenced):
            c.wait_any(["never"], 30.0, wake=[readable])
    finally:
        readable.close()
        writer.close()


def test_gloo_process_groups_rendezvous_through_it(server) -> None:
    results: dict[int, torch.Tensor] = {}

    def member(rank: int) -> None:
        # Keep the Python store alive: c10d holds only the C++ side, whose calls need the Python object.
        connection = client(server, f"worker/{rank}/a")
        store = dist.PrefixStore("gen0/pg", connection)
        group = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=10))
        tensor = torch.tensor([float(rank + 1)])
        group.allreduce([tensor]).wait()
        results[rank] = tensor

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {0: torch.tensor([3.0]), 1: torch.tensor([3.0])}


SERVER_WITH_FEW_FDS = """
import resource, sys, time
resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))
from recycle.runtime.protocol.store import StoreServer
server = StoreServer("127.0.0.1", 0, sys.argv[1]).start()
print(server.port, flush=True)
time.sleep(60)
"""


def test_a_server_out_of_file_descriptors_sheds_strangers_and_keeps_serving() -> None:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", SERVER_WITH_FEW_FDS, TOKEN], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]  # more than it has descriptors
        started = time.monotonic()
        c = StoreClient("127.0.0.1", port, TOKEN, "worker/0/a", timeout_s=5, connect_timeout_s=20)
        c.set("k", "v")
        assert c.get("k") == b"v"
        assert time.monotonic() - started < 4  # not after the strangers time out of their handshake (5 s)
        assert proc.poll() is None
        for sock in idle:
            sock.close()
    finally:
        proc.kill()
        proc.wait()
