"""A restartable coordinator (issue 23 item 2): SIGKILL `recycle coordinator` mid-run and start it again with the same
command. The workers train on while it is away; the new coordinator rebuilds the run from what the launchers and
workers tell its empty store, and the run finishes exact. A worker SIGKILLed while the coordinator is away is handled
as soon as it is back."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_separate_coordinator import _close_to_reference, _wait_for
from test_train_multinode import free_port

ROOT = Path(__file__).resolve().parents[2]


def _start(args: list[str], env: dict[str, str], **kwargs: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "recycle", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)  # type: ignore[call-overload]


def _run_with_a_coordinator_restart(tmp_path: Path, config_file: Path, steps: int, node_flags: list[str],
                                    away_s: float) -> tuple[str, str, str, Path]:
    """One training node (D=2 x S=2) against `recycle coordinator`, which is SIGKILLed after step 3 and started again
    `away_s` later. Returns (both coordinators' output, the node's output, stderr of all, the --save file)."""
    save = tmp_path / "final.pt"
    metrics = tmp_path / "metrics.jsonl"
    env = {**os.environ, "RECYCLE_JOB_TOKEN": secrets.token_hex(24)}
    flags = ["--config", str(config_file), "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port",
             str(free_port()), "--timeout", "20", "--heartbeat-timeout", "2", "--save", str(save), "--metrics",
             str(metrics)]
    first = _start(["coordinator", *flags], env)
    node = _start(["train", *flags, "--coordinator", "separate", "--node-rank", "0", "--emulate-costs", "--slot-ms",
                   "60", *node_flags], env)
    second = None
    try:
        before = _wait_for(first, "step 3/", 150)
        first.send_signal(signal.SIGKILL)
        first.wait()
        time.sleep(away_s)
        second = _start(["coordinator", *flags], env)
        out_node, err_node = node.communicate(timeout=180)
        out_second, err_second = second.communicate(timeout=60)
    finally:
        for process in (first, node, second):
            if process is not None and process.poll() is None:
                process.kill()
            if process is not None:
                process.wait()
    assert node.returncode == 0, err_node
    assert second.returncode == 0, out_second + err_second
    steps_reported = [line for line in metrics.read_text().splitlines() if '"event"' not in line]
    assert len(steps_reported) == len(set(steps_reported))  # no step written twice across the restart
    return before + out_second, out_node, err_node + err_second, save


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_coordinator_started_again_finishes_the_run_exact(tmp_path: Path, tiny_config_file) -> None:
    config_file = tiny_config_file(steps=16)
    out, out_node, err, save = _run_with_a_coordinator_restart(tmp_path, config_file, 16, [], away_s=2.0)
    assert "lost the job's coordinator" in out_node
    assert "answers again" in out_node and "(restarted)" in out_node
    assert "this is a restarted coordinator" in out
    assert "took over the run in generation 0 with 4 live worker(s)" in out
    assert "step 16/16" in out
    assert "Traceback" not in err
    _close_to_reference(save, config_file)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_killed_while_the_coordinator_is_away_is_handled_when_it_is_back(tmp_path: Path,
                                                                                  tiny_config_file) -> None:
    config_file = tiny_config_file(steps=20)
    # Worker 1:1 is SIGKILLed in step 8, while the coordinator (killed after step 3) is away for 6 s.
    out, out_node, err, save = _run_with_a_coordinator_restart(tmp_path, config_file, 20,
                                                               ["--inject", "kill:1:1@8"], away_s=6.0)
    assert "this is a restarted coordinator" in out
    assert "worker 1:1" in out and "killed by SIGKILL" in out, out
    assert "generation 1" in out
    assert "step 20/20" in out
    assert "workers down at the end: 1:1" in out
    assert "Traceback" not in err
    _close_to_reference(save, config_file)
