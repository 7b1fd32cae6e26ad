"""Cutting a generation's connections from another thread: an op blocked on a silent peer raises at once, a
listening socket and the job store's connections are left alone."""

from __future__ import annotations

import datetime
import socket
import threading
import time

import pytest
import torch
import torch.distributed as dist

from recycle.runtime.protocol.store import StoreClient, StoreServer
from recycle.runtime.worker.group_sockets import SocketSet, cut
from recycle.runtime.worker.transport import _is_peer_error

pytestmark = pytest.mark.timeout(60)

TOKEN = "ab" * 24


def test_cut_wakes_a_blocked_receive_and_spares_listeners_and_kept_peers() -> None:
    kept_listener = socket.create_server(("127.0.0.1", 0))
    sockets = SocketSet.start({("127.0.0.1", kept_listener.getsockname()[1])})
    listener = socket.create_server(("127.0.0.1", 0))
    near = socket.create_connection(listener.getsockname())
    far, _ = listener.accept()
    kept = socket.create_connection(kept_listener.getsockname())
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(near.recv(10)))
    reader.start()
    time.sleep(0.1)
    started = time.monotonic()
    assert cut(sockets) == 2  # near and far: both ends of the generation's connection live in this process
    reader.join(2)
    assert got == [b""] and time.monotonic() - started < 1
    kept.sendall(b"x")  # the kept peer's connection still works
    with pytest.raises(OSError):
        near.sendall(b"y" * 100000)
    listener.settimeout(0.2)
    with socket.create_connection(listener.getsockname()):  # and the listener still accepts
        listener.accept()[0].close()
    for s in (near, far, kept, listener, kept_listener):
        s.close()


def test_a_gloo_op_blocked_on_a_silent_peer_raises_when_cut() -> None:
    """Two members of a gloo group in one process; one never joins the all-reduce (alive, sockets open: a frozen
    peer). Without the cut the op would wait for the group's 20 s timeout."""
    server = StoreServer("127.0.0.1", 0, TOKEN).start()
    connections = [StoreClient("127.0.0.1", server.port, TOKEN, f"worker/{r}/a", timeout_s=20) for r in range(2)]
    # After the store connections: the server runs in this process here, and its side of them must stay too.
    sockets = SocketSet.start({("127.0.0.1", server.port)})
    groups: dict[int, object] = {}

    def form(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("g", connections[rank]), rank, 2,
                                             datetime.timedelta(seconds=20))

    formers = [threading.Thread(target=form, args=(r,)) for r in range(2)]
    for t in formers:
        t.start()
    for t in formers:
        t.join(20)
    errors: list[BaseException] = []

    def blocked() -> None:
        try:
            groups[0].allreduce([torch.ones(4)]).wait()
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            errors.append(exc)

    op = threading.Thread(target=blocked)
    op.start()
    time.sleep(0.3)
    assert op.is_alive()  # really blocked on the silent member
    started = time.monotonic()
    assert cut(sockets) >= 1  # one end may close by itself once the other is cut (both live in this process)
    op.join(5)
    assert not op.is_alive() and time.monotonic() - started < 2
    assert errors and _is_peer_error(errors[0]), errors  # what the transport turns into PeerLost
    connections[0].set("still", "there")  # the store connections were not cut
    assert connections[1].get("still") == b"there"
    server.close()


def test_a_settled_generation_never_cuts_a_later_generations_sockets() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    forming = SocketSet.start(set())
    mine = socket.create_connection(listener.getsockname())
    mine_far, _ = listener.accept()
    settled = forming.settled()
    later = socket.create_connection(listener.getsockname())  # the next generation's, opened after
    later_far, _ = listener.accept()
    assert cut(settled) == 2
    later.sendall(b"still open")
    assert later_far.recv(32) == b"still open"
    assert mine_far.recv(8) == b""
    for s in (mine, mine_far, later, later_far, listener):
        s.close()


def test_a_peer_failure_comes_out_of_the_transport_as_peer_lost_and_nothing_else_does() -> None:
    from recycle.runtime.worker.transport import Activity, PeerLost, _peer_op, is_comm_error

    activity = Activity()
    activity.phase = "compute"
    with pytest.raises(PeerLost, match="stage 1 all-reduce: .*Connection closed by peer") as info:
        with _peer_op(activity, "stage 1 all-reduce"):
            assert activity.phase == "comm"
            raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:4242")
    assert info.value.__suppress_context__  # one error, not torch's and ours
    assert is_comm_error(info.value) and activity.phase == "compute"
    with pytest.raises(ValueError):  # a bug is not a lost peer
        with _peer_op(activity, "send"):
            raise ValueError("shape mismatch")
    assert not is_comm_error(RuntimeError("CUDA out of memory"))
