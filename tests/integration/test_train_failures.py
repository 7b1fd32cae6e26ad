"""When the run cannot go on (no plan provider, a worker that raises, a lost launcher) it stops within seconds, with
a non-zero outcome naming the worker, and leaves no worker process behind."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from recycle.config import parse_config
from recycle.errors import RuntimeFailure
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import ClusterOptions, FaultOptions, LaunchOptions, RecoveryOptions
from recycle.runtime.worker.process import FaultInjection
from recycle.schedules.fault_free import build_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120), pytest.mark.timing]


def tiny_config():
    return parse_config({
        "topology": {"num_replicas": 2, "num_stages": 2},
        "workload": {"num_microbatches": 2, "microbatch_size": 2, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "training": {"steps": 6},
    }, name="failures")


@pytest.mark.parametrize("mode,expected", [("kill", r"worker 1:1 \(rank 3, pid \d+\) died \(killed by SIGKILL\)"),
                                           ("raise", r"worker 1:1 \(rank 3, pid \d+\) raised ValueError: injected")])
def test_without_a_plan_provider_a_failing_worker_stops_the_run_and_is_named(mode: str, expected: str) -> None:
    """A library caller that passes no plan provider gets the old contract: a clean stop naming the worker. An
    ordinary exception stops the run even with a provider (it is a bug, not a lost machine)."""
    config = tiny_config()
    plan = build_schedule(config, "zb-h1", staggered=True)
    reported: list[float] = []
    options = LaunchOptions(faults=FaultOptions(injections=((3, FaultInjection(step=2, index=2, mode=mode)),)),
                            recovery=RecoveryOptions(timeout_s=60), cluster=ClusterOptions(start_method="forkserver"),
                            progress=lambda line: line.startswith("step ") and reported.append(time.monotonic()))
    with pytest.raises(RuntimeFailure, match=expected):
        launch(config, plan, options)
    stopped = time.monotonic()
    assert len(reported) == 2  # steps 1 and 2 completed, the fault hit inside step 3
    # The coordinator sees the death at once; the stop takes reaping, not the 60 s timeout.
    assert stopped - reported[-1] < 15
    assert not mp.active_children()


def test_a_frozen_worker_without_a_plan_provider_is_caught_by_its_heartbeat_and_named() -> None:
    config = tiny_config()
    plan = build_schedule(config, "1f1b", staggered=True)
    options = LaunchOptions(faults=FaultOptions(injections=((2, FaultInjection(step=1, index=1, mode="hang")),)),
                            recovery=RecoveryOptions(timeout_s=30, heartbeat_timeout_s=2.0, heartbeat_s=0.25),
                            cluster=ClusterOptions(start_method="forkserver"), progress=None)
    began = time.monotonic()
    with pytest.raises(RuntimeFailure, match=r"worker 1:0 \(rank 2, pid \d+\) stopped responding"):
        launch(config, plan, options)
    assert time.monotonic() - began < 25  # the heartbeat, not the 30 s collective timeout
    assert not mp.active_children()


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`: its children, and theirs (workers forked by a forkserver are grandchildren)."""
    from pathlib import Path

    parent = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except OSError:
            continue
    found, frontier = [], [pid]
    while frontier:
        below = [child for child, up in parent.items() if up in frontier]
        found += below
        frontier = below
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reaped-later zombie holds no resources)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_workers_exit_when_the_launcher_is_killed(tmp_path) -> None:
    """No orphans: workers watch the launcher and exit within seconds of its death."""
    import signal
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    launcher = subprocess.Popen([sys.executable, "-m", "recycle", "train", "--config", "configs/tiny-gpt.toml",
                                 "--steps", "100000"], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
    try:
        line = launcher.stdout.readline()
        while line and not line.startswith("step "):
            line = launcher.stdout.readline()  # the first progress line: every worker is up and training
        assert line.startswith("step 1/"), line
        workers = _descendants(launcher.pid)  # 4 workers, a forkserver under RECYCLE_START_METHOD=forkserver
        assert len(workers) >= 4
    finally:
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
    deadline = time.monotonic() + 15
    alive = workers
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if _running(p)]
    assert not alive, f"processes {alive} outlived the launcher"
