"""The launcher's own-stall clock: a gap between its ticks is a stall only when much longer than a tick, and a
stall counts for the marks it ended after (or is still going on); what a node launcher says when its store is lost."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from recycle.errors import RuntimeFailure
from recycle.runtime.control.launcher import _check_not_shut_out, _check_not_stalled, _store_contact
from recycle.runtime.control.stall import StallClock
from recycle.runtime.options import LaunchOptions, RecoveryOptions, with_keywords
from recycle.runtime.protocol.store import StoreFenced, StoreUnavailable
from recycle.runtime.worker.process import EXIT_FENCED


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _ticks(stalls: StallClock, clock: _Clock, *gaps: float) -> None:
    for gap in gaps:
        clock.now += gap
        stalls.tick()


def test_scheduling_noise_is_not_a_stall_and_a_freeze_is() -> None:
    clock = _Clock()
    stalls = StallClock(tick_s=0.25, clock=clock)
    _ticks(stalls, clock, 0.25, 0.4, 0.9, 0.25)  # late ticks on a loaded machine
    assert stalls.longest_since(0.0) == 0.0
    mark = clock.now
    _ticks(stalls, clock, 12.25, 0.25)  # SIGSTOPped for 12 s
    assert stalls.longest_since(mark) == pytest.approx(12.0)
    assert stalls.longest_since(clock.now) == 0.0  # it ended before this mark


def test_a_stall_the_clock_thread_has_not_ticked_past_yet_counts() -> None:
    clock = _Clock()
    stalls = StallClock(tick_s=0.25, clock=clock)
    _ticks(stalls, clock, 0.25)
    mark = clock.now
    clock.now += 30.0  # woken: the caller looks before the clock's thread has run
    assert stalls.longest_since(mark) == pytest.approx(29.75)


def test_the_gaps_kept_are_bounded() -> None:
    clock = _Clock()
    stalls = StallClock(tick_s=0.25, clock=clock, keep=3)
    _ticks(stalls, clock, *[5.0] * 10)
    assert len(stalls._gaps) == 3


def test_a_clock_thread_ticks() -> None:
    stalls = StallClock(tick_s=0.01).start()
    try:
        assert stalls.longest_since(0.0) < 5.0
    finally:
        stalls.stop()


class _Workers:
    def __init__(self) -> None:
        self.stopped = False

    def stop(self) -> None:
        self.stopped = True


def test_a_launcher_stalled_past_the_node_timeout_stops_its_workers_and_says_why() -> None:
    options = LaunchOptions(recovery=RecoveryOptions(heartbeat_timeout_s=5.0))
    workers = _Workers()
    _check_not_stalled(4.9, workers, options)  # type: ignore[arg-type]
    assert not workers.stopped
    with pytest.raises(RuntimeFailure, match=r"did not run for 7\.0 s .* longer than the 5 s .* re-join"):
        _check_not_stalled(7.0, workers, options)  # type: ignore[arg-type]
    assert workers.stopped


class _Ended:
    """WorkerProcesses' view of a node whose workers have ended with `codes` (rank -> exit code; None: running)."""

    def __init__(self, codes: dict[int, int | None]) -> None:
        self.ranks = sorted(codes)
        self.codes = codes

    def exitcodes(self) -> dict[int, int]:
        return {rank: code for rank, code in self.codes.items() if code is not None}


def test_a_launcher_whose_workers_were_all_shut_out_stops_waiting_for_a_lost_coordinator() -> None:
    """A node cut off until its run ended: its workers learnt they were fenced (EXIT_FENCED) when the network came
    back, its launcher finds the coordinator gone; it says so instead of waiting out --coordinator-grace. Any worker
    still running, or ended otherwise, keeps it waiting."""
    options = with_keywords(LaunchOptions(), {"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1",
                                              "master_port": 29500, "coordinator": "separate", "token": "ab" * 24})
    for codes in ({2: EXIT_FENCED, 3: None}, {2: EXIT_FENCED, 3: 0}, {2: EXIT_FENCED, 3: -9}, {}):
        _check_not_shut_out(_Ended(codes), options)  # type: ignore[arg-type]
    with pytest.raises(RuntimeFailure, match=r"every worker of node 1 was shut out .* 10\.0\.0\.1:29500 no longer "
                                             r"answers.* re-join"):
        _check_not_shut_out(_Ended({2: EXIT_FENCED, 3: EXIT_FENCED}), options)  # type: ignore[arg-type]


@pytest.mark.parametrize("coordinator,raised,says", [
    ("separate", StoreUnavailable("cannot reach the job store at 10.0.0.1:29500 within 60 s (refused); check that "
                                  "the job's first node (or its coordinator) runs"),
     "node 1: cannot reach the job store at 10.0.0.1:29500 within 60 s"),
    ("separate", StoreUnavailable("lost the connection to the job store at 10.0.0.1:29500 (closed)"),
     "node 1 lost contact with the job's store on the coordinator (10.0.0.1:29500): the run has ended or the "
     "coordinator is gone"),
    ("node0", dist.DistStoreError("timed out after 60 s waiting for key 'job'"),
     "node 1 lost contact with the job's store on node 0 (10.0.0.1:29500)"),
    ("node0", StoreFenced("this process (launcher/1/ab) was fenced by the job's coordinator"),
     "node 1 was declared dead by the job's coordinator"),
])
def test_a_node_launchers_lost_or_refused_store_is_one_error_naming_the_node_and_the_store(
        coordinator: str, raised: Exception, says: str) -> None:
    """From its first connection to its last call (start-up included), what a node launcher's store contact can
    raise ends as a RuntimeFailure (the CLI's one `error:` line), never as the store client's own exception."""
    options = with_keywords(LaunchOptions(), {"nnodes": 2, "node_rank": 1, "master_addr": "10.0.0.1",
                                              "master_port": 29500, "coordinator": coordinator, "token": "ab" * 24})
    with pytest.raises(RuntimeFailure) as failure:
        with _store_contact(options):
            raise raised
    assert says in str(failure.value)
    assert failure.value.__cause__ is None and failure.value.__suppress_context__
