"""The recovery protocol on worker threads (tests/threads/conftest.py): the package's worker code and node 0's
coordination loop on the job's real store, with scripted deaths, freezes, stalls, lost links and re-joins."""

from __future__ import annotations

import pytest
from thread_cluster import Injector, job

from recycle.errors import RuntimeFailure
from recycle.runtime.protocol.channels import Channels

# Each takes well under a second; a hang fails fast. Real 2 s heartbeat timeouts: one at a time, in make test's
# timing run, at full CPU priority.
pytestmark = [pytest.mark.timeout(10), pytest.mark.timing]


def test_a_fault_free_run_finishes_every_step_without_a_recovery(tiny_config, run_cluster) -> None:
    outcome = run_cluster(tiny_config(steps=4))
    assert [m.step for m in outcome.steps] == [1, 2, 3, 4]
    assert not outcome.recoveries and not outcome.failed


def test_a_killed_worker_is_replaced_by_its_stage_replicas_in_the_next_generation(tiny_config, run_cluster) -> None:
    outcome = run_cluster(tiny_config(steps=4), Injector().kill((1, 1), step=1, action=3))
    assert [m.step for m in outcome.steps] == [1, 2, 3, 4]
    (recovery,) = outcome.recoveries
    assert recovery.workers == ("1:1",) and recovery.step == 2 and recovery.generation == 1
    assert "died (killed by SIGKILL) during 1B3" in recovery.causes[0], recovery.causes
    assert outcome.failed == frozenset({(1, 1)})


def test_a_frozen_worker_is_told_by_its_silent_heartbeat_fenced_and_recovered_from(tiny_config, run_cluster) -> None:
    outcome = run_cluster(tiny_config(steps=4), Injector().freeze((0, 1), step=1, action=2),
                          heartbeat_timeout_s=1.0)  # 0.3 s fenced a CPU-starved healthy thread under load
    assert [m.step for m in outcome.steps] == [1, 2, 3, 4]
    (recovery,) = outcome.recoveries
    assert recovery.workers == ("0:1",) and recovery.step == 2
    assert "stopped responding (no heartbeat for" in recovery.causes[0], recovery.causes


def test_a_stalled_main_thread_with_a_live_heartbeat_is_hung_fenced_and_recovered_from(tiny_config,
                                                                                      run_cluster) -> None:
    outcome = run_cluster(tiny_config(steps=4), Injector().stall((1, 0), step=2, action=1), hang_timeout_s=0.25)
    assert [m.step for m in outcome.steps] == [1, 2, 3, 4]
    (recovery,) = outcome.recoveries
    assert recovery.workers == ("1:0",) and recovery.step == 3
    assert "is hung (its heartbeat goes on" in recovery.causes[0], recovery.causes


def test_a_lost_link_with_nobody_dead_is_retried_with_the_same_workers(tiny_config, run_cluster) -> None:
    """The transport's typed PeerLost at one op of 1:0's second iteration: every worker stops and reports, the
    next generation keeps all four, and the run completes. The retry is a Recovery record of its own, with no
    worker lost and the stop that caused it as its cause (it costs the run its pause: it must not hide in a step)."""
    outcome = run_cluster(tiny_config(steps=4), Injector().lose_link((1, 0), iteration=1, op=2))
    assert [m.step for m in outcome.steps] == [1, 2, 3, 4]
    (retry,) = outcome.recoveries
    assert retry.workers == () and retry.joined == () and not outcome.failed
    # (the first stop report to arrive names it: 1:0's lost link, or a peer whose op the cut generation ended)
    assert retry.causes[0].startswith("no worker failed: worker ") and " stopped: " in retry.causes[0], retry.causes
    assert "formed their groups again" in retry.line()
    announcement = outcome.jobs.get(Channels.ANNOUNCE, 1)
    assert announcement.live == (0, 1, 2, 3) and announcement.redo_step == 1
    report = outcome.jobs.get(Channels.STOPPED, 0, 2)
    assert "injected loss of a peer at iteration 1, op 2" in report.error


def test_a_worker_killed_and_brought_back_is_admitted_at_a_drain_and_takes_its_state_from_a_replica(
        tiny_config, run_cluster) -> None:
    outcome = run_cluster(tiny_config(steps=8), Injector().kill((1, 1), step=1, action=0).rejoin((1, 1), step=3))
    assert [m.step for m in outcome.steps] == list(range(1, 9))
    death, join = outcome.recoveries
    assert death.workers == ("1:1",) and death.failed == ((1, 1),)
    assert join.workers == () and join.joined == ("1:1",) and join.transfer_bytes > 0 and join.failed == ()
    assert not outcome.failed
    assert len(outcome.steps[-1].digests) == 4  # all four back, replicas checked bit-identical after every step


def test_a_second_death_during_the_recovery_joins_the_same_recovery(tiny_config, run_cluster) -> None:
    outcome = run_cluster(tiny_config(steps=4), Injector().kill((1, 1), step=1, action=3).kill_in_recovery((1, 0), 1))
    assert [m.step for m in outcome.steps] == [1, 2, 3, 4]
    (recovery,) = outcome.recoveries
    assert sorted(recovery.workers) == ["1:0", "1:1"] and recovery.failed == ((1, 0), (1, 1))
    assert "during the recovery from generation 0" in " ".join(recovery.causes), recovery.causes


def test_an_ordinary_exception_in_a_worker_fails_the_run_instead_of_recovering(tiny_config, run_cluster) -> None:
    with pytest.raises(RuntimeFailure, match=r"worker 0:1 .* raised ValueError: injected fault"):
        run_cluster(tiny_config(steps=4), Injector().raise_error((0, 1), step=1, action=2))


def test_losing_a_stage_without_a_checkpoint_fails_the_run_with_its_reason(tiny_config, run_cluster) -> None:
    with pytest.raises(RuntimeFailure, match="last live replica of stage 1.*writes no checkpoints"):
        run_cluster(tiny_config(steps=4), Injector().kill((1, 1), step=1).kill((0, 1), step=2))


def test_a_long_run_keeps_no_per_step_record_in_the_store_or_in_memory(tiny_config, run_cluster, tmp_path,
                                                                         monkeypatch) -> None:
    """Issue 23 item 5: every step reaches the --metrics file (appended), the result keeps the newest REPORTS_KEPT,
    and the store forgets each step's records once they are read."""
    import json

    from recycle.runtime.control import reporter
    from recycle.runtime.protocol.channels import Keys

    monkeypatch.setattr(reporter, "REPORTS_KEPT", 4)
    metrics = tmp_path / "metrics.jsonl"
    outcome = run_cluster(tiny_config(steps=12), metrics_path=str(metrics))
    assert [m.step for m in outcome.steps] == [9, 10, 11, 12]
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, 13))
    left = [(step, rank) for step in range(12) for rank in range(4)
            if outcome.jobs.raw.check([Keys.metrics(step, rank)])]
    assert not left, f"metrics records left in the store: {left}"


def test_a_killed_workers_threads_unwind_silently_at_the_end(tiny_config, monkeypatch, capfd) -> None:
    """At the end, a killed worker's parked main thread is refused by the store as a fenced process is: it ends
    fenced without a traceback (one used to reach the suite's output whenever it unwound after pytest's capture)."""
    config = tiny_config(steps=2)
    monkeypatch.setenv("RECYCLE_TEST_UNFENCEABLE", ",".join(str(r) for r in range(4)))
    cluster = job(config, Injector().kill((1, 1), step=1, action=3))
    try:
        cluster.run()
    finally:
        cluster.close()
    killed = cluster.processes[cluster.rank((1, 1))]
    assert not killed.thread.is_alive()
    assert "Traceback" not in capfd.readouterr().err
