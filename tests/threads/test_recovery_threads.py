"""The recovery protocol on worker threads (tests/threads/conftest.py): the package's worker code and node 0's
coordination loop on the job's real store, with scripted deaths, freezes, stalls, lost links and re-joins."""

from __future__ import annotations

import pytest

from conftest import Injector

pytestmark = pytest.mark.timeout(20)


def test_a_fault_free_run_finishes_every_step_without_a_recovery(tiny_config, run_cluster) -> None:
    outcome = run_cluster(tiny_config(steps=4))
    assert [m.step for m in outcome.steps] == [1, 2, 3, 4]
    assert not outcome.recoveries and not outcome.failed
    print(f"{outcome.seconds:.3f} s")


def test_a_killed_worker_is_replaced_by_its_stage_replicas_in_the_next_generation(tiny_config, run_cluster) -> None:
    outcome = run_cluster(tiny_config(steps=4), Injector().kill((1, 1), step=1, action=3))
    assert [m.step for m in outcome.steps] == [1, 2, 3, 4]
    (recovery,) = outcome.recoveries
    assert recovery.workers == ("1:1",) and recovery.step == 2 and recovery.generation == 1
    assert "died (killed by SIGKILL) during 1B3" in recovery.causes[0], recovery.causes
    assert outcome.failed == frozenset({(1, 1)})
    print(f"{outcome.seconds:.3f} s")
