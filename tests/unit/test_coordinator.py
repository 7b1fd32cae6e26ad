"""The coordinator's decisions with plain facts (no processes), in the style of torchft's manager tests: who is
fenced, when a generation is announced, from which step everyone redoes, and when the run must stop."""

from __future__ import annotations

import pytest

from recycle.runtime.control.coordinator import (AbortGeneration, Announce, Coordinator, Drain, FailRun, Fence,
                                                 MarkLatest, Move, Respawn, describe_exit, stale_heartbeats)
from recycle.runtime.protocol.records import StoppedReport

D, S = 3, 2  # ranks: replica * S + stage -> (0,0)=0 (0,1)=1 (1,0)=2 (1,1)=3 (2,0)=4 (2,1)=5
ALL = frozenset(range(D * S))


def coordinator(live=ALL, failed=frozenset(), end_step=10) -> Coordinator:
    return Coordinator(D, S, live, failed, end_step=end_step, report_timeout_s=10.0)


def report(rank: int, applied: int, generation: int = 0, iteration: int | None = None, current: int = 2,
           previous: int = 7) -> StoppedReport:
    return StoppedReport(rank, generation, applied, applied + 1 if iteration is None else iteration, current, 0.5,
                         previous, 1.0, "Connection closed by peer", 100.0)


def kinds(commands) -> list[type]:
    return [type(c) for c in commands]


def test_a_death_aborts_the_generation_and_waits_for_every_survivor() -> None:
    c = coordinator()
    commands = c.on_death(3, "worker 1:1 died (killed by SIGKILL)", now=1.0)
    assert kinds(commands) == [AbortGeneration]
    assert commands[0].generation == 0
    assert c.state.live == ALL - {3} and c.state.failed == {(1, 1)} and c.state.recovering
    for rank in (0, 1, 2, 4):
        assert c.on_stopped(report(rank, applied=4), now=1.1) == []  # still waiting for rank 5
    (announce,) = c.on_stopped(report(5, applied=4), now=1.2)
    assert isinstance(announce, Announce)
    assert announce.live == ALL - {3}
    assert announce.facts.generation == 1 and announce.facts.failed == {(1, 1)} and announce.facts.redo_step == 5
    assert announce.facts.lost_contact == ""  # a death explains it
    assert c.state.generation == 1 and not c.state.recovering


@pytest.mark.parametrize("death", [True, False])
def test_reports_taken_together_decide_as_one_at_a_time(death: bool) -> None:
    """on_stopped_all (what the supervisor calls with the reports of one look) = one on_stopped per report: the same
    commands and state, stale and dead workers' reports left out, the first report's error as the cause."""
    reports = [report(0, applied=4, current=3), report(1, applied=5, current=1), report(2, applied=4),
               report(3, applied=4), report(4, applied=4, generation=1), report(5, applied=4)]
    one, together = coordinator(), coordinator()
    for c in (one, together):
        if death:
            c.on_death(3, "worker 1:1 died (killed by SIGKILL)", now=1.0)
    expected = [command for r in reports for command in one.on_stopped(r, now=1.1)]
    # rank 4's report is of another generation: nothing is announced until it reports in generation 0.
    assert together.on_stopped_all(reports, now=1.1) == expected
    assert together.state == one.state
    expected = one.on_stopped(report(4, applied=4), now=1.2)
    assert together.on_stopped_all([report(4, applied=4)], now=1.2) == expected
    assert kinds(expected)[-1:] == [Announce] and together.state == one.state


def test_redo_starts_at_the_oldest_unapplied_iteration_and_counts_rolled_back_work() -> None:
    """Staggered optimizer: stage 1 already stepped iteration 5, stage 0 had not; everyone redoes iteration 5."""
    c = coordinator()
    c.on_death(3, "died", now=0.0)
    c.on_stopped(report(0, applied=4, current=3), 0.1)  # stage 0: in iteration 5, 3 actions done
    c.on_stopped(report(2, applied=4, current=3), 0.1)
    c.on_stopped(report(4, applied=4, current=3), 0.1)
    c.on_stopped(report(1, applied=5, current=1, previous=7), 0.1)  # stage 1: stepped 5, 1 action into 6
    (announce,) = c.on_stopped(report(5, applied=5, current=1, previous=7), 0.1)
    facts = announce.facts
    assert facts.redo_step == 5
    assert facts.rolled_back == 2
    assert facts.redone_actions == 3 * 3 + 2 * (1 + 7)


def test_late_report_of_an_old_generation_is_ignored() -> None:
    c = coordinator()
    c.on_death(3, "died", 0.0)
    for rank in (0, 1, 2, 4, 5):
        c.on_stopped(report(rank, applied=1), 0.1)
    assert c.state.generation == 1
    assert c.on_stopped(report(0, applied=1, generation=0), 0.2) == []
    assert not c.state.recovering


def test_a_second_death_during_a_recovery_joins_it() -> None:
    c = coordinator()
    c.on_death(3, "died", 0.0)
    c.on_stopped(report(0, applied=2), 0.1)
    assert c.on_death(5, "died", 0.2) == []  # same recovery: no second abort
    for rank in (1, 2):
        assert c.on_stopped(report(rank, applied=2), 0.3) == []
    (announce,) = c.on_stopped(report(4, applied=2), 0.3)
    assert announce.facts.failed == {(1, 1), (2, 1)}
    assert [d.rank for d in announce.facts.deaths] == [3, 5]
    assert announce.live == frozenset({0, 1, 2, 4})


def test_a_dead_worker_that_reported_before_dying_is_not_waited_for() -> None:
    c = coordinator()
    c.on_stopped(report(0, applied=1), 0.0)  # rank 0 saw the failure first
    assert c.state.recovering
    c.on_death(3, "died", 0.1)
    for rank in (1, 2, 4):
        c.on_stopped(report(rank, applied=1), 0.1)
    (announce,) = c.on_stopped(report(5, applied=1), 0.1)
    assert announce.live == ALL - {3}


def test_losing_the_last_replica_of_a_stage_fails_the_run() -> None:
    c = coordinator(live=frozenset({0, 1, 3, 5}), failed=frozenset({(1, 0), (2, 0)}))
    (fail,) = c.on_death(0, "worker 0:0 died (killed by SIGKILL)", 0.0)
    assert isinstance(fail, FailRun)
    assert "last live replica of stage 0" in fail.message and "--resume" in fail.message
    assert c.state.finished
    assert c.on_death(1, "died", 0.1) == []  # nothing after the end


def test_a_hung_worker_is_fenced_and_one_that_never_reports_is_fenced_at_the_deadline() -> None:
    c = coordinator()
    commands = c.on_death(2, "stopped responding", 0.0, fence=True)
    assert kinds(commands) == [Fence, AbortGeneration]
    for rank in (0, 1, 3, 4):
        c.on_stopped(report(rank, applied=0), 1.0)
    assert c.on_tick(5.0) == []  # within the report timeout
    commands = c.on_tick(10.5)  # rank 5 never reported
    assert kinds(commands) == [Fence, Announce]
    assert commands[0].rank == 5
    assert commands[1].live == frozenset({0, 1, 3, 4})


def test_an_ordinary_exception_fails_the_run() -> None:
    c = coordinator()
    (fail,) = c.on_error(3, "worker 1:1 raised ValueError: bad")
    assert fail == FailRun("worker 1:1 raised ValueError: bad")


def test_recoveries_without_a_death_are_retried_then_fail() -> None:
    c = coordinator()
    for attempt in range(4):
        g = c.state.generation
        commands = []
        for rank in sorted(ALL):
            commands += c.on_stopped(report(rank, applied=3, generation=g), float(attempt))
        if attempt < 3:
            assert kinds(commands) == [AbortGeneration, Announce]
            assert commands[1].live == ALL and commands[1].facts.deaths == ()
            # Why, for the report: the first stop's error (a recovery without a death costs the run its timeout)
            assert commands[1].facts.lost_contact == "worker 0:0 stopped: Connection closed by peer"
        else:
            assert kinds(commands) == [AbortGeneration, FailRun]
            assert "without any worker failing" in commands[1].message


def test_workers_that_finished_count_as_reported_with_every_step_applied() -> None:
    """A death in the final barrier: some workers already exited 0; the rest only need to finish."""
    c = coordinator(end_step=10)
    c.on_done(0, 0.0)
    c.on_done(1, 0.0)
    c.on_death(3, "died", 0.1)
    for rank in (2, 4):
        c.on_stopped(report(rank, applied=9), 0.2)
    (announce,) = c.on_stopped(report(5, applied=9), 0.2)
    assert announce.facts.redo_step == 10
    assert announce.live == frozenset({2, 4, 5})


def test_exit_descriptions_and_stale_heartbeats() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-19) == "killed by SIGSTOP"
    assert describe_exit(3) == "exited with code 3"
    beats = {0: 10.0, 1: 7.0, 2: 4.0}
    assert stale_heartbeats(beats, frozenset({0, 1, 2, 3}), now=10.0, timeout_s=5.0) == [2]


@pytest.mark.parametrize("rank", [0, 5])
def test_deaths_of_unknown_or_dead_ranks_change_nothing(rank: int) -> None:
    c = coordinator(live=ALL - {rank})
    assert c.on_death(rank, "died", 0.0) == []
    assert not c.state.recovering


def test_a_replacement_is_admitted_at_an_iteration_boundary_and_leaves_the_failed_set() -> None:
    c = coordinator(live=ALL - {3}, failed=frozenset({(1, 1)}))
    (drain,) = c.on_join_ready(3, now=5.0)
    assert isinstance(drain, Drain) and drain.generation == 0
    assert c.on_join_ready(3, now=5.1) == []  # once
    for rank in (0, 1, 2, 4):
        assert c.on_stopped(report(rank, applied=6, current=0, previous=7), 5.2) == []
    (announce,) = c.on_stopped(report(5, applied=6, current=0, previous=7), 5.2)
    facts = announce.facts
    assert announce.live == ALL and facts.joining == {3} and facts.failed == frozenset()
    assert facts.redo_step == 7 and facts.redone_actions == 0 and facts.restore_step is None
    assert c.state.failed == frozenset() and c.state.live == ALL


def test_a_live_or_unknown_rank_cannot_join() -> None:
    c = coordinator()
    assert c.on_join_ready(3, 0.0) == []  # live
    c = coordinator(live=ALL - {3}, failed=frozenset({(1, 1)}))
    assert c.on_join_ready(5, 0.0) == []  # not down


def test_a_death_while_a_joiner_waits_aborts_at_once_and_admits_it_too() -> None:
    c = coordinator(live=ALL - {3}, failed=frozenset({(1, 1)}))
    c.on_join_ready(3, 1.0)
    commands = c.on_death(4, "died", 1.5)
    assert kinds(commands) == [AbortGeneration]
    for rank in (0, 1, 2):
        c.on_stopped(report(rank, applied=2), 1.6)
    (announce,) = c.on_stopped(report(5, applied=2), 1.6)
    assert announce.live == ALL - {4} and announce.facts.joining == {3} and announce.facts.failed == {(2, 0)}


def test_a_joiner_that_dies_before_admission_is_forgotten() -> None:
    c = coordinator(live=ALL - {3}, failed=frozenset({(1, 1)}))
    c.on_join_ready(3, 1.0)
    assert c.on_death(3, "died", 1.1) == []
    for rank in (0, 1, 2, 4):
        c.on_stopped(report(rank, applied=2, current=0), 1.2)
    (announce,) = c.on_stopped(report(5, applied=2, current=0), 1.2)
    assert announce.facts.joining == frozenset() and announce.live == ALL - {3}


def test_a_lost_stage_restores_the_latest_checkpoint_with_replacements() -> None:
    c = Coordinator(D, S, ALL - {1, 3}, frozenset({(0, 1), (1, 1)}), end_step=20, report_timeout_s=10.0,
                    checkpoint_every=1, reshape=False)
    c.on_checkpoint(8)
    c.on_checkpoint(4)  # an older one reported late does not move it back
    commands = c.on_death(5, "worker 2:1 died", 3.0)
    assert kinds(commands) == [Respawn, AbortGeneration]
    assert commands[0].ranks == {1, 3, 5} and "checkpoint step 8" in commands[0].reason
    for rank in (0, 2, 4):
        assert c.on_stopped(report(rank, applied=10), 3.1) == []
    (announce,) = c.on_join_ready(3, 4.0)  # reports are in, and now stage 1 has a replacement
    facts = announce.facts
    assert facts.restore_step == 8 and facts.redo_step == 8 and facts.steps_lost == 3
    assert facts.joining == {3} and announce.live == {0, 2, 3, 4}
    assert facts.failed == {(0, 1), (2, 1)}
    (drain,) = c.on_join_ready(5, 4.1)  # a later replacement joins the ordinary way
    assert isinstance(drain, Drain) and drain.generation == 1


@pytest.mark.parametrize("every,message", [(0, "writes no checkpoints"), (1, "no checkpoint is complete")])
def test_a_lost_stage_without_a_checkpoint_fails_with_a_clear_message(every: int, message: str) -> None:
    c = Coordinator(D, S, ALL - {1, 3}, frozenset({(0, 1), (1, 1)}), end_step=20, report_timeout_s=10.0,
                    checkpoint_every=every)
    (fail,) = c.on_death(5, "worker 2:1 died", 3.0)
    assert isinstance(fail, FailRun) and message in fail.message and "--resume" in fail.message


def test_a_restore_without_any_replacement_gives_up_after_the_report_timeout() -> None:
    c = Coordinator(D, S, ALL - {1, 3}, frozenset({(0, 1), (1, 1)}), end_step=20, report_timeout_s=10.0,
                    checkpoint_every=1, reshape=False)
    c.on_checkpoint(4)
    c.on_death(5, "died", 0.0)
    for rank in (0, 2, 4):
        c.on_stopped(report(rank, applied=5), 0.1)
    assert c.on_tick(5.0) == []
    (fail,) = c.on_tick(10.5)
    assert isinstance(fail, FailRun) and "no replacement worker came up" in fail.message


def test_a_lost_stage_is_refilled_by_moving_a_worker_of_the_stage_with_the_most_replicas() -> None:
    """Reshape: stage 1 loses its last replica while stage 0 has three; worker 2:0 (the last replica of stage 0) is
    stopped and its pipeline's stage-1 slot (2:1, rank 5) started in its place: no spare machine needed."""
    c = Coordinator(D, S, ALL - {1, 3}, frozenset({(0, 1), (1, 1)}), end_step=20, report_timeout_s=10.0,
                    checkpoint_every=1)
    c.on_checkpoint(8)
    commands = c.on_death(5, "worker 2:1 died", 3.0)
    assert kinds(commands) == [Move, AbortGeneration]
    move = commands[0]
    assert (move.donor, move.rank) == (4, 5) and "checkpoint step 8" in move.reason and "moves to stage 1" in move.reason
    assert c.state.live == {0, 2} and (2, 0) in c.state.failed
    for rank in (0, 2):
        assert c.on_stopped(report(rank, applied=10), 3.1) == []
    assert c.on_stopped(report(4, applied=10), 3.1) == []  # the donor's report is not waited for, nor counted
    assert c.on_death(4, "fenced for the move", 3.2) == []  # ... and its exit is no new failure
    (announce,) = c.on_join_ready(5, 4.0)
    facts = announce.facts
    assert facts.restore_step == 8 and facts.moved == ((4, 5),) and facts.deaths[0].rank == 5
    assert announce.live == {0, 2, 5} and facts.failed == {(0, 1), (1, 1), (2, 0)}


def test_a_lost_stage_with_a_replacement_already_waiting_needs_no_respawn() -> None:
    c = Coordinator(D, S, ALL - {1, 3}, frozenset({(0, 1), (1, 1)}), end_step=20, report_timeout_s=10.0,
                    checkpoint_every=1)
    c.on_checkpoint(8)
    c.on_join_ready(1, 2.0)  # 0:1 is repaired and waits for an iteration boundary
    commands = c.on_death(5, "worker 2:1 died", 3.0)
    assert not [cmd for cmd in commands if isinstance(cmd, Respawn)]
    # Stage 0 would hold 3 workers and stage 1 only the replacement: 2:0 still moves to even them out (2 and 2).
    assert [(m.donor, m.rank) for m in commands if isinstance(m, Move)] == [(4, 5)]
    for rank in (0, 2):
        assert c.on_stopped(report(rank, applied=10), 3.1) == []
    assert c.on_death(4, "fenced for the move", 3.2) == []  # the donor's exit is no new failure
    (announce,) = c.on_join_ready(5, 3.5)  # the restore waited for the moved worker
    assert announce.facts.restore_step == 8 and announce.facts.joining == {1, 5}
    assert announce.live == {0, 1, 2, 5} and announce.facts.moved == ((4, 5),)


def test_reshape_falls_back_to_respawn_when_no_stage_has_a_replica_to_spare() -> None:
    # Stage 0 keeps only worker 0:0: moving it would lose stage 0 too.
    c = Coordinator(D, S, frozenset({0, 5}), frozenset({(1, 0), (2, 0), (0, 1), (1, 1)}), end_step=20,
                    report_timeout_s=10.0, checkpoint_every=1)
    c.on_checkpoint(4)
    commands = c.on_death(5, "worker 2:1 died", 1.0)
    assert kinds(commands) == [Respawn, AbortGeneration] and commands[0].ranks == {1, 3, 5}


def test_the_donor_comes_from_the_fullest_stage() -> None:
    # D=4, S=3. Stage 0 keeps only 0:0; stage 1 has 4 live replicas (ranks 1, 4, 7, 10), stage 2 has 3.
    c = Coordinator(4, 3, frozenset(range(12)) - {3, 6, 9, 2}, frozenset({(1, 0), (2, 0), (3, 0), (0, 2)}),
                    end_step=20, report_timeout_s=10.0, checkpoint_every=1)
    c.on_checkpoint(2)
    moves = [cmd for cmd in c.on_death(0, "worker 0:0 died", 1.0) if isinstance(cmd, Move)]
    # 3:1 moves into 3:0 (counts 0/4/3 -> 1/3/3), then 2:1 into 2:0 (-> 2/2/3): within one of each other.
    assert [(m.donor, m.rank) for m in moves] == [(10, 9), (7, 6)]


def test_reshape_evens_out_the_stages_and_waits_for_every_moved_worker() -> None:
    """D=4, S=2: stage 1 loses all four replicas. Two workers of stage 0 move (3:0 -> 3:1, 2:0 -> 2:1), as a
    D' = live // S = 2 pipeline layout would hold them; the restore waits for both."""
    c = Coordinator(4, 2, frozenset({0, 2, 4, 6, 7}), frozenset({(0, 1), (1, 1), (2, 1)}), end_step=20,
                    report_timeout_s=10.0, checkpoint_every=1)
    c.on_checkpoint(6)
    commands = c.on_death(7, "worker 3:1 died", 1.0)
    assert [(m.donor, m.rank) for m in commands if isinstance(m, Move)] == [(6, 7), (4, 5)]
    assert "moves to stage 1" in commands[0].reason and c.state.live == {0, 2}
    for rank in (0, 2):
        assert c.on_stopped(report(rank, applied=7), 1.1) == []
    assert c.on_join_ready(7, 2.0) == []  # one moved worker is up: the other is still awaited
    (announce,) = c.on_join_ready(5, 2.1)
    assert announce.live == {0, 2, 5, 7} and announce.facts.moved == ((6, 7), (4, 5))
    assert announce.facts.failed == {(0, 1), (1, 1), (2, 0), (3, 0)} and announce.facts.restore_step == 6


def _stage_1_lost_with_one_mover_up() -> Coordinator:
    """D=4, S=2: stage 1's last replica (3:1) dies after a checkpoint of step 6; 3:0 -> 3:1 and 2:0 -> 2:1 move; the
    survivors have reported and 3:1's new process is up, 2:1's (rank 5) not yet."""
    c = Coordinator(4, 2, frozenset({0, 2, 4, 6, 7}), frozenset({(0, 1), (1, 1), (2, 1)}), end_step=20,
                    report_timeout_s=10.0, checkpoint_every=1)
    c.on_checkpoint(6)
    c.on_death(7, "worker 3:1 died", 0.0)
    for rank in (0, 2):
        c.on_stopped(report(rank, applied=7), 0.1)
    assert c.on_join_ready(7, 1.0) == []
    return c


def test_a_slow_moved_worker_is_not_waited_for_past_the_timeout_once_every_stage_is_held() -> None:
    c = _stage_1_lost_with_one_mover_up()
    assert c.on_tick(5.0) == []
    (announce,) = c.on_tick(10.5)  # 2:1 (rank 5) is not up: go on with 0:0, 1:0 and 3:1
    assert announce.live == {0, 2, 7} and announce.facts.joining == {7}
    (drain,) = c.on_join_ready(5, 11.0)  # ... and admit it later like any replacement
    assert isinstance(drain, Drain)


def test_a_moved_worker_that_dies_while_starting_is_forgotten() -> None:
    c = _stage_1_lost_with_one_mover_up()
    (announce,) = c.on_death(5, "worker 2:1 died while starting", 1.5)
    assert announce.live == {0, 2, 7} and (2, 1) in announce.facts.failed


def test_joiners_are_not_admitted_when_no_step_is_left() -> None:
    c = coordinator(live=ALL - {3}, failed=frozenset({(1, 1)}), end_step=10)
    c.on_join_ready(3, 0.0)
    for rank in (0, 1, 2, 4):
        c.on_done(rank, 0.1)
    (announce,) = c.on_done(5, 0.1)
    assert announce.facts.redo_step == 10 and announce.facts.joining == frozenset() and 3 not in announce.live


def test_a_joiner_that_gets_ready_after_every_worker_finished_is_not_drained_for() -> None:
    c = coordinator(live=ALL - {3}, failed=frozenset({(1, 1)}), end_step=10)
    for rank in (0, 1, 2, 4, 5):
        assert c.on_done(rank, 0.1) == []
    assert c.on_join_ready(3, 0.2) == []  # a drain now would wait for reports that never come
    assert not c.state.recovering and 3 not in c.state.joining


# -- hang detection: progress, not heartbeats --------------------------------------------------------------------
def test_progress_restarts_its_clock_only_when_the_main_thread_moves() -> None:
    from recycle.runtime.control.coordinator import track_progress

    first = track_progress(None, actions=3, phase="compute", now=10.0)
    assert track_progress(first, 3, "compute", 12.0) is first  # a beat with no progress keeps the old time
    assert track_progress(first, 4, "compute", 12.0).since == 12.0
    assert track_progress(first, 3, "comm", 12.0).since == 12.0


def test_only_a_worker_stuck_computing_is_hung() -> None:
    from recycle.runtime.control.coordinator import Progress, hung_workers

    progress = {0: Progress(5, "compute", 0.0),  # one action for 20 s: hung
                1: Progress(5, "comm", 0.0),  # waiting on a peer for 20 s: the peer is the one to blame
                2: Progress(9, "compute", 15.0),  # slow but moving
                3: Progress(1, "idle", 0.0)}  # between steps (saving, waiting for an announcement)
    seen = dict.fromkeys(progress, 20.0)  # each one's last beat read at 20 s
    assert hung_workers(progress, seen, limit_s=10.0) == [0]
    assert hung_workers(progress, {r: seen[r] for r in (1, 2, 3)}, limit_s=10.0) == []
    assert hung_workers(progress, {0: 20.0}, limit_s=25.0) == []
    assert hung_workers(progress, {0: 8.0}, limit_s=10.0) == []  # its last beat showed 8 s of that action


def test_the_hang_limit_follows_the_run_speed_with_a_floor() -> None:
    from recycle.runtime.control.coordinator import HANG_FLOOR_S, HANG_MARGIN, hang_limit_s

    assert hang_limit_s(3.0, [100.0], 30.0) == 3.0  # --hang-timeout wins
    assert hang_limit_s(None, [], 30.0) == 30.0  # before the first step: the op timeout
    assert hang_limit_s(None, [], 1.0) == HANG_FLOOR_S
    assert hang_limit_s(None, [0.01, 0.02, 0.03], 30.0) == HANG_FLOOR_S
    assert hang_limit_s(None, [1.0, 2.0, 50.0], 30.0) == HANG_MARGIN * 2.0  # the median, not one slow step


def test_a_replacement_that_dies_after_the_run_finished_is_not_a_crash() -> None:
    """Issue 21 item 2: every other worker finished while a replacement was getting ready; it (or a stale ready key
    of it) is seen again and dies: no generation is announced and nothing raises."""
    c = coordinator(live=ALL - {5}, failed=frozenset({(2, 1)}))
    assert kinds(c.on_join_ready(5, 1.0)) == [Drain]
    commands = []
    for rank in sorted(ALL - {5}):
        commands += c.on_done(rank, 2.0)
    (announce,) = commands
    assert isinstance(announce, Announce) and announce.live == frozenset()  # redo is the end: nobody runs again
    c.on_join_ready(5, 3.0)
    assert c.on_death(5, "killed by SIGKILL", 4.0) == []
    assert not c.state.recovering and c.state.joining == frozenset()


# -- checkpoints, repairs, reporting and the plan check ------------------------------------------------------------
def test_a_checkpoint_is_marked_only_once_every_stage_shard_is_written_and_until_it_is_marked() -> None:
    c = Coordinator(D, S, ALL, frozenset(), end_step=6, report_timeout_s=10.0, checkpoint_every=2, start_step=0)
    assert c.awaited_shards() == [(2, 0), (2, 1)]  # next_step 0: no worker can have written step 4 yet
    assert c.on_shards_written([(2, 0)]) == []
    assert c.awaited_shards() == [(2, 1)]
    assert c.on_shards_written([(2, 1)]) == [MarkLatest(2)]
    assert c.on_shards_written([]) == [MarkLatest(2)]  # not marked yet (a shard was being written again): again
    c.on_checkpoint(2)
    assert c.state.latest_checkpoint == 2 and c.on_shards_written([]) == [] and c.awaited_shards() == []


def test_only_the_newest_complete_checkpoint_is_marked_and_older_pending_ones_go_with_it() -> None:
    c = Coordinator(D, S, ALL, frozenset(), end_step=8, report_timeout_s=10.0, checkpoint_every=2, start_step=0)
    for step in range(4):
        c.on_step_reported(step)
    assert c.awaited_shards() == [(d, s) for d in (2, 4, 6) for s in range(S)]
    assert c.on_shards_written([(2, 0), (4, 0), (4, 1), (6, 1)]) == [MarkLatest(4)]  # step 2 lacks stage 1
    c.on_checkpoint(4)
    assert c.awaited_shards() == [(6, 0)]  # step 2 can no longer be completed: its writer moved on


def test_a_dead_local_worker_is_respawned_once_its_repair_is_due() -> None:
    c = Coordinator(D, S, ALL, frozenset(), end_step=10, report_timeout_s=10.0, local=ALL, respawn_after_s=2.0)
    c.on_death(3, "died", 1.0)
    c.on_crashed(3, 1.0)
    c.on_crashed(9, 1.0)  # not this node's: its own launcher repairs it
    assert c.on_repair_check(2.5, running=ALL - {3}) == []
    (respawn,) = c.on_repair_check(3.0, running=ALL - {3})
    assert isinstance(respawn, Respawn) and respawn.ranks == {3}
    assert c.on_repair_check(4.0, running=ALL - {3}) == []  # once


def test_a_repair_waits_for_a_frozen_worker_to_be_declared_dead_and_is_dropped_when_nothing_is_down() -> None:
    c = Coordinator(D, S, ALL, frozenset(), end_step=10, report_timeout_s=10.0, local=ALL)
    c.on_repair_planned(3, at=1.0)  # chaos froze it: its process still runs
    c.on_repair_planned(4, at=1.0)  # chaos killed it, but its exit was fenced, not a failure
    assert c.on_repair_check(2.0, running=ALL - {4}) == []
    assert c.repairs.at == {3: 1.0}
    c.on_death(3, "stopped responding", 2.5, fence=True)
    assert [r.ranks for r in c.on_repair_check(3.0, running=ALL - {4})] == [{3}]


def test_a_repaired_machine_takes_the_slot_a_reshape_donor_left() -> None:
    c = Coordinator(D, S, ALL - {1, 3}, frozenset({(0, 1), (1, 1)}), end_step=20, report_timeout_s=10.0,
                    checkpoint_every=1, local=ALL, respawn_after_s=1.0)
    c.on_checkpoint(8)
    (move, _) = c.on_death(5, "worker 2:1 died", 3.0)
    assert (move.donor, move.rank) == (4, 5)
    c.on_crashed(5, 3.0)
    (respawn,) = c.on_repair_check(4.5, running=ALL - {1, 3, 4, 5})
    assert respawn.ranks == {4}  # 2:0, the donor's slot, not 2:1, which the moved worker fills


def test_a_scripted_rejoin_comes_once_the_reports_reach_its_step() -> None:
    c = Coordinator(D, S, ALL - {3}, frozenset({(1, 1)}), end_step=10, report_timeout_s=10.0, local=ALL - {5},
                    rejoins=[(5, 1), (3, 2)])
    c.on_step_reported(0)
    assert c.on_repair_check(0.0, running=ALL - {3}) == []  # step 1: worker 5 is not down, nothing to bring back
    c.on_step_reported(1)
    assert [r.ranks for r in c.on_repair_check(0.0, running=ALL - {3})] == [{3}]
    assert c.repairs.rejoins == []


def test_a_drain_stops_the_workers_past_the_step_they_can_have_reached() -> None:
    c = coordinator(live=ALL - {3}, failed=frozenset({(1, 1)}))
    c.on_step_reported(4)
    (drain,) = c.on_join_ready(3, 1.0)
    assert drain.stop_before == 5 + 3  # every worker is at most in step 6


def _admit_replacement(c: Coordinator) -> Announce:
    c.on_join_ready(3, 1.0)
    for rank in (0, 1, 2, 4):
        c.on_stopped(report(rank, applied=4, current=0), 1.1)
    (announce,) = c.on_stopped(report(5, applied=4, current=0), 1.1)
    return announce


def test_a_replacement_counts_from_its_redo_step_once_the_plan_is_accepted() -> None:
    c = coordinator(live=ALL - {3}, failed=frozenset({(1, 1)}))
    assert c.members(0) == [0, 1, 2, 4, 5]
    announce = _admit_replacement(c)
    assert announce.facts.redo_step == 5
    assert c.on_plan_chosen(sorted(ALL)) == []
    assert c.members(4) == [0, 1, 2, 4, 5] and c.members(5) == sorted(ALL)


def test_a_plan_for_other_workers_than_the_generation_is_refused() -> None:
    c = coordinator(live=ALL - {3}, failed=frozenset({(1, 1)}))
    _admit_replacement(c)
    (fail,) = c.on_plan_chosen([0, 1, 2, 4, 5])
    assert isinstance(fail, FailRun) and "live workers [0, 1, 2, 4, 5] are not the live workers [0, 1, 2, 3, 4, 5]" \
        in fail.message
    assert c.state.finished


def test_workers_that_finished_belong_to_the_plan_of_a_last_recovery() -> None:
    c = coordinator(end_step=10)
    c.on_done(0, 1.0)
    c.on_done(1, 1.0)
    c.on_death(3, "died", 1.1)
    for rank in (2, 4, 5):
        c.on_stopped(report(rank, applied=8), 1.2)
    assert c.participants() == ALL - {3}
    assert c.on_plan_chosen([0, 1, 2, 4, 5]) == []


def test_an_accepted_restore_reports_and_checkpoints_the_steps_after_its_checkpoint_again() -> None:
    c = Coordinator(D, S, ALL - {1, 3}, frozenset({(0, 1), (1, 1)}), end_step=20, report_timeout_s=10.0,
                    checkpoint_every=4, reshape=False, start_step=0)
    for step in range(10):
        c.on_step_reported(step)
    c.on_shards_written([(8, 0), (8, 1), (12, 0)])
    c.on_checkpoint(8)
    c.on_death(5, "worker 2:1 died", 3.0)
    for rank in (0, 2, 4):
        c.on_stopped(report(rank, applied=10), 3.1)
    (announce,) = c.on_join_ready(3, 4.0)
    assert announce.facts.restore_step == 8 and c.next_step == 10  # not before the plan is accepted
    assert c.on_plan_chosen([0, 2, 3, 4]) == []
    assert c.next_step == 8 and c.checkpoints.pending == [12, 16, 20]
    c.on_step_reported(8)
    c.on_step_reported(9)
    assert c.awaited_shards() == [(12, 0), (12, 1)]  # step 12's old shard is stale: it is written again

