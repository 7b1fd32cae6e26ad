"""A worker's watcher thread on a multi-node run (its beats go to the node's own store, from a thread of their own)
waits on the job's store once per heartbeat timeout while nothing happens, not once per beat, and still sees an
abort at once, in the generation the main thread moved to while it waited."""

from __future__ import annotations

import threading
import time
import types

from recycle.runtime.options import RecoveryOptions
from recycle.runtime.protocol.channels import JobStore, Keys
from recycle.runtime.protocol.records import Announcement, to_json
from recycle.runtime.protocol.store import StoreClient, StoreServer
from recycle.runtime.worker.outbox import Outbox
from recycle.runtime.worker.process import _Watcher, _Worker
from recycle.runtime.worker.transport import Activity

TOKEN = "cd" * 24


def test_an_idle_watcher_costs_the_job_store_one_wait_per_heartbeat_timeout_and_sees_aborts_at_once() -> None:
    job, node = StoreServer("127.0.0.1", 0, TOKEN).start(), StoreServer("127.0.0.1", 0, TOKEN).start()
    aborted: list[tuple[int, float]] = []
    spec = types.SimpleNamespace(
        node_store_port=node.port, tp_rank=0, tp_degree=1, rank=3, incarnation="a",
        recovery=RecoveryOptions(heartbeat_s=0.2, heartbeat_timeout_s=2.0),
        config=types.SimpleNamespace(num_stages=2), cluster=types.SimpleNamespace(token=TOKEN))
    connect = lambda s: StoreClient("127.0.0.1", job.port, TOKEN, "worker/3/a", timeout_s=30)  # noqa: E731
    on_abort = lambda generation: aborted.append((generation, time.monotonic()))  # noqa: E731
    watcher = _Watcher(spec, Activity(), on_abort, connect, Outbox(3))  # type: ignore[arg-type]
    try:
        watcher.start()
        time.sleep(0.5)  # connected, outbox synced
        before = job.requests
        time.sleep(3.0)
        assert job.requests - before <= 3  # was one wait per 0.2 s beat: 15
        assert node.requests > 10  # its beats went on, to the node's store
        watcher.move_to(1)  # the main thread moved on: generation 2's abort is watched from now on
        time.sleep(0.2)
        job.data.set(Keys.abort(2).encode(), b"1")
        set_at = time.monotonic()
        deadline = time.monotonic() + 5.0
        while not aborted and time.monotonic() < deadline:
            time.sleep(0.01)
        assert aborted and aborted[0][0] == 2 and aborted[0][1] - set_at < 1.0
    finally:
        job.fence("worker/3/")  # the watcher thread ends (StoreFenced), as a fenced worker's does
        watcher.join(5.0)
        job.close()
        node.close()
    assert not watcher.is_alive()


def test_a_workers_wait_for_the_next_announcement_is_one_request_and_it_is_kept() -> None:
    """After its stop report a worker waits for the next generation's announcement: one request to the job's store
    (it was a wait and two reads of the key: three per worker and recovery), answered when the key is written."""
    job = StoreServer("127.0.0.1", 0, TOKEN).start()
    try:
        worker = _Worker.__new__(_Worker)  # (its constructor builds a stage: only the store and outbox are used)
        moved: list[int] = []
        store = StoreClient("127.0.0.1", job.port, TOKEN, "worker/3/a", timeout_s=30)
        vars(worker).update(store=store, jobs=JobStore(store), outbox=Outbox(3),
                            heartbeat=types.SimpleNamespace(move_to=moved.append))
        announcement = Announcement(2, (1, 3), redo_step=5, end_step=9, reason="worker 0:1 died")
        worker.store.ping()
        before = job.requests
        threading.Timer(0.3, lambda: job.data.set(Keys.announce(2).encode(), to_json(announcement).encode())).start()
        assert worker._await_announcement(2) == announcement
        assert job.requests - before == 1
        assert moved == [2]
        assert worker.outbox._writes[Keys.announce(2)].value == to_json(announcement).encode()  # for a new store
    finally:
        job.close()
