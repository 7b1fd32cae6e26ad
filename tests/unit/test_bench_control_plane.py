"""benchmarks/bench_control_plane.py at a tiny size (stand-in nodes as threads): the real supervisor and store see a
failure, announce the next generation and admit a repaired node, and the JSON carries the issue's fields, so the
benchmark cannot rot unnoticed. Also: the benchmark's plan provider makes valid plans."""

from __future__ import annotations

import gc
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from recycle.ir import validate_plan
from recycle.schedules.fault_free import build_schedule

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_control_plane.py"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_control_plane", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_control_plane"] = module
    spec.loader.exec_module(module)
    return module


def test_the_rerouting_provider_makes_valid_plans_without_the_failed_workers(bench: ModuleType) -> None:
    base = build_schedule(bench.bench_config(4, 3, 3), "gpipe")
    failed = frozenset({(1, 0), (2, 0), (3, 2)})
    plan = validate_plan(bench.rerouted_plan(base, failed))
    assert plan.failed == failed
    assert set(plan.live_ranks()) == set(range(12)) - {base.rank(1, 0), base.rank(2, 0), base.rank(3, 2)}
    assert all(plan.host[0][mb] in (0, 3) for mb in range(plan.total_microbatches))  # stage 0's survivors


def test_a_tiny_run_announces_each_failure_admits_the_repaired_node_and_prints_the_json(bench: ModuleType,
                                                                                       capsys) -> None:
    # (--event-timeout-s below the test's own timeout: a phase that never ends is reported by the benchmark, with
    # where the coordinator stood, not cut short by pytest-timeout)
    code = bench.main(["--ranks", "32", "--stages", "4", "--microbatches", "2", "--failures", "2",
                       "--silent-failures", "0", "--standins", "0", "--steady-s", "0.5", "--step-s", "0.2",
                       "--heartbeat-s", "0.1", "--heartbeat-timeout-s", "0.5", "--event-timeout-s", "30"])
    assert code == 0
    lines = capsys.readouterr().out.strip().splitlines()
    (run,) = json.loads(lines[-1])["runs"]
    for key in ("ranks", "detect_to_announce_s", "join_s", "store_ops_per_s", "coordinator_cpu_fraction"):
        assert run[key] is not None, key
    assert run["ranks"] == 32 and run["failures"] == 2
    assert 0 < run["detect_to_announce_s"] < 5.0  # a failure was announced, well before any heartbeat timeout
    # The coordinator's own part is a part: the survivors' reports are left out of it, nothing else.
    assert 0 < run["coordinator_announce_s"] <= run["detect_to_announce_s"] + 1e-6
    assert run["coordinator_announce_without_plan_s"] <= run["coordinator_announce_s"]
    assert 0 <= run["plan_on_path_s"] <= run["plan_s"]
    assert 0 < run["join_s"] < 30.0
    assert run["store_ops_per_s"] > 0 and 0 < run["coordinator_cpu_fraction"] < 1.5
    assert run["recoveries"] == 4  # two kills, the node's loss, its join
    assert len(run["rss_after_each_failure_mb"]) == len(run["store_keys_after_each_failure"]) == 2
    assert 0 < max(run["rss_after_each_failure_mb"]) <= run["coordinator_peak_rss_mb"] + 0.1  # (rounded to 0.1)
    assert any("failure (exit flag) -> announce" in line for line in lines)


def test_a_recoverys_views_are_written_with_the_collector_paused_and_it_is_on_again_after(
        bench: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """Supervisor._announce pauses Python's cyclic collector from the plan to the announcement (its views' tens of
    thousands of young objects at scale), and turns it on again."""
    seen: list[bool] = []
    real = bench.CoordinatorStore.multi_set

    def multi_set(self, keys: list[str], values: list) -> None:
        if keys and "/plan/" in keys[0]:
            seen.append(gc.isenabled())
        real(self, keys, values)

    monkeypatch.setattr(bench.CoordinatorStore, "multi_set", multi_set)
    assert gc.isenabled()
    code = bench.main(["--ranks", "32", "--stages", "4", "--microbatches", "2", "--failures", "1",
                       "--silent-failures", "0", "--no-join", "--standins", "0", "--steady-s", "0.3",
                       "--step-s", "0.2", "--heartbeat-s", "0.1", "--heartbeat-timeout-s", "0.5"])
    capsys.readouterr()
    assert code == 0 and seen and not any(seen) and gc.isenabled()


def test_the_stand_ins_records_are_the_workers_records_byte_for_byte(bench: ModuleType) -> None:
    from control_plane_nodes import beat_json, node_steps_json, node_stops_json, step_json, stopped_json

    from recycle.runtime.protocol.records import (Beat, NodeSteps, NodeStops, StepRecord, StepRows, StoppedReport,
                                                  to_json)

    assert beat_json(7, "compute", "1f") == to_json(Beat(7, 7, "compute", "1f")).encode()
    assert step_json(3, 1, 2, 1.25, 3.5, False) == \
        to_json(StepRecord(3, 1, 2, 1.25, 3.5, 0.0, None, None, None, 1.0)).encode()
    assert step_json(0, 3, 0, 0.1, 0.30000000000000004, True) == \
        to_json(StepRecord(0, 3, 0, 0.1, 0.30000000000000004, 0.0, 1.0, 1.0, None, 1.0)).encode()
    records = [StepRecord(r, s, 2, 1.25, 3.5, 0.0, *([1.0, 1.0] if s == 3 else [None, None]), None, 1.0)
               for r, s in ((0, 2), (0, 3), (1, 0))]
    assert node_steps_json(5, 7, [(0, 2), (0, 3), (1, 0)], 2, 1.25, 3.5, 3) == \
        NodeSteps(5, 7, StepRows.of(records)).encode()
    error = 'generation 3 was aborted by the coordinator "quoted" \u00e9'
    assert stopped_json(17, 3, 4, 5, error, 1700000000.123) == \
        to_json(StoppedReport(17, 3, 4, 5, 0, 0.0, 0, 0.0, error, 1700000000.123)).encode()
    assert node_stops_json(2, 3, [16, 17], 4, 5, error, 1.5) == \
        to_json(NodeStops(2, 3, tuple(StoppedReport(r, 3, 4, 5, 0, 0.0, 0, 0.0, error, 1.5)
                                      for r in (16, 17)))).encode()


def test_a_size_the_failures_do_not_fit_is_refused_with_one_line(bench: ModuleType) -> None:
    with pytest.raises(SystemExit, match=r"^error: --ranks 32 / --stages 8 = 4 replicas per stage, fewer than the 8"):
        bench.main(["--ranks", "32", "--failures", "5"])
    with pytest.raises(SystemExit, match=r"^error: --ranks-per-node 0 must be at least 1"):
        bench.main(["--ranks", "32", "--ranks-per-node", "0"])


def test_a_stand_in_nodes_step_records_from_its_writer_are_the_records_byte_for_byte(bench: ModuleType) -> None:
    from control_plane_nodes import NodeStepsWriter

    from recycle.runtime.protocol.records import NodeSteps, StepRecord, StepRows

    workers = [(0, 2), (0, 3), (1, 0)]
    writer = NodeStepsWriter(5, workers, 2, 3)
    for step, start, end in ((7, 1.25, 3.5), (8, 0.1, 0.30000000000000004)):
        records = [StepRecord(r, s, 2, start, end, 0.0, *([1.0, 1.0] if s == 3 else [None, None]), None, 1.0)
                   for r, s in workers]
        assert writer(step, start, end) == NodeSteps(5, step, StepRows.of(records)).encode()


def test_workers_lost_that_the_benchmark_did_not_fail_stop_the_measurements(bench: ModuleType) -> None:
    """Stand-ins behind their heartbeats on an overloaded machine make the coordinator declare nodes lost (at 16,384
    ranks hundreds at once): the benchmark says so and stops, instead of timing a mass failure of its own making."""
    from types import SimpleNamespace

    state = SimpleNamespace(live=set(range(16)) - {3}, done=set())
    cluster = SimpleNamespace(supervisor=SimpleNamespace(coordinator=SimpleNamespace(state=state)),
                              settings=SimpleNamespace(ranks=16), failed_by_us={3},
                              node_of={r: r // 4 for r in range(16)})
    bench._unplanned_losses(cluster)  # only the benchmark's own kill: fine
    state.live -= {8, 9, 10, 11}  # node 2 declared lost
    with pytest.raises(RuntimeError, match="declared 4 workers on 1 nodes lost that the benchmark did not fail"):
        bench._unplanned_losses(cluster)
