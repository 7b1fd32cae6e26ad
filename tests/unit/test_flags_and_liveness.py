"""Store flags through JobStore, and what node 0 reads from the heartbeats (Liveness), on an in-process store."""

from __future__ import annotations

import pytest

from recycle.runtime.control.liveness import Liveness
from recycle.runtime.protocol.channels import Channels, Flags, JobStore, Keys
from recycle.runtime.protocol.records import Beat
from recycle.runtime.protocol.store import LocalStore, StoreServer

TOKEN = "ab" * 24


def _jobs() -> tuple[JobStore, StoreServer]:
    server = StoreServer("127.0.0.1", 0, TOKEN).start()
    return JobStore(LocalStore(server.data, 5.0)), server


def test_a_flag_is_raised_tested_read_and_lowered_under_its_key() -> None:
    jobs, server = _jobs()
    try:
        assert not jobs.is_set(Flags.FINISHED) and jobs.flag_text(Flags.EXITED, 3) is None
        jobs.raise_flag(Flags.FINISHED)
        jobs.raise_flag(Flags.EXITED, 3, text="-9")
        jobs.raise_flag(Flags.CHECKPOINTED, 4, 1)
        assert jobs.is_set(Flags.FINISHED) and jobs.flag_text(Flags.EXITED, 3) == "-9"
        assert jobs.raw.try_get(Keys.checkpointed(4, 1)) == b"1"  # the keys the workers read and write
        assert Flags.ABORT.name(2) == Keys.abort(2) and Flags.FINISHED.name() == Keys.FINISHED
        jobs.lower_flag(Flags.EXITED, 3)
        assert not jobs.is_set(Flags.EXITED, 3) and jobs.is_set(Flags.CHECKPOINTED, 4, 1)
    finally:
        server.close()


def _beat(jobs: JobStore, rank: int, beats: int, actions: int, phase: str = "compute") -> None:
    jobs.put(Channels.HEARTBEAT, Beat(beats, actions, phase, "inc"), rank)


def test_silent_and_hung_workers_and_silent_nodes() -> None:
    jobs, server = _jobs()
    try:
        watch = Liveness(jobs, nodes=range(1, 2), heartbeat_s=0.5, timeout_s=2.0)
        assert watch.due(0.0) and not watch.due(0.1) and watch.due(0.25)
        _beat(jobs, 0, 1, 5)
        _beat(jobs, 1, 1, 5)
        jobs.raw.add(Keys.node_heartbeat(1), 1)
        assert watch.silent_workers(frozenset({0, 1, 2}), 0.0) == [] and watch.silent_nodes(0.0) == []
        _beat(jobs, 0, 2, 5)  # beats, but still in the same action
        assert watch.silent_workers(frozenset({0, 1, 2}), 3.0) == [(1, 3.0)]  # 2 never beat: not counted yet
        assert watch.hung_workers(frozenset({0}), 3.0, limit_s=2.5) == [(0, 3.0)]
        assert watch.hung_workers(frozenset({0}), 4.0, limit_s=2.5) == []  # once
        assert watch.silent_nodes(2.5) == [(1, 2.5)] and watch.fenced_nodes == {1}
        assert watch.silent_nodes(5.0) == []  # fenced: not reported again
        jobs.raw.add(Keys.node_heartbeat(1), 1)  # a new launcher of node 1
        assert watch.silent_nodes(5.5) == [] and watch.fenced_nodes == set() and watch.beating_nodes(6.0) == {1}
        watch.admit(1, 6.0)
        assert watch.silent_workers(frozenset({1}), 7.0) == []  # timed from its admission
    finally:
        server.close()


def test_a_frozen_worker_in_a_long_action_is_told_silent_not_hung() -> None:
    """Worker 0's beats showed one action for 1.5 s (a slow first optimizer step under load); then it ran two short
    steps between two beats, unseen, and was SIGSTOPped. At 3.0 s the action its beats last showed is past the 2.5 s
    hang limit counted up to now, but its beats showed it for 1.5 s only: it is not told hung ("its heartbeat goes
    on"), it is told silent once the 2 s heartbeat timeout has passed (CI saw the wrong word before this rule)."""
    jobs, server = _jobs()
    try:
        watch = Liveness(jobs, nodes=range(0), heartbeat_s=0.5, timeout_s=2.0)
        _beat(jobs, 0, 1, 5)
        assert watch.silent_workers(frozenset({0}), 0.0) == []
        _beat(jobs, 0, 2, 5)  # the same action, still beating; then frozen
        assert watch.silent_workers(frozenset({0}), 1.5) == []
        assert watch.silent_workers(frozenset({0}), 3.0) == []
        assert watch.hung_workers(frozenset({0}), 3.0, limit_s=2.5) == []  # last beat 1.5 s ago: going silent
        assert watch.silent_workers(frozenset({0}), 3.6) == [(0, pytest.approx(2.1))]
    finally:
        server.close()


def test_a_watcher_that_was_frozen_itself_does_not_blame_its_peers_for_the_gap() -> None:
    """The coordinator (or a node launcher) SIGSTOPped for 30 s: on waking, its peers' beats are 30 s old, but the
    silence was its own; they are judged from the gap's end, and one that stays silent is still caught."""
    jobs, server = _jobs()
    try:
        watch = Liveness(jobs, nodes=range(1, 2), heartbeat_s=0.5, timeout_s=2.0)
        assert watch.due(0.0)
        _beat(jobs, 0, 1, 5)
        jobs.raw.add(Keys.node_heartbeat(1), 1)
        assert watch.silent_workers(frozenset({0}), 0.0) == [] and watch.silent_nodes(0.0) == []
        assert watch.due(30.0)  # woken after 30 s
        assert watch.silent_workers(frozenset({0}), 30.0) == [] and watch.silent_nodes(30.0) == []
        assert watch.hung_workers(frozenset({0}), 30.0, limit_s=2.5) == []
        for tick in range(1, 9):  # awake, checking every 0.25 s; nothing comes from the peers: now it is theirs
            assert watch.due(30.0 + 0.25 * tick)
        assert [r for r, _ in watch.silent_workers(frozenset({0}), 32.0)] == [0]
        assert [n for n, _ in watch.silent_nodes(32.0)] == [1]
    finally:
        server.close()
