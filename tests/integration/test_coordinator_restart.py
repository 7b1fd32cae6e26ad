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
from reference_check import LONG_RUN_TOLERANCE
from test_separate_coordinator import _close_to_reference, _wait_for
from test_train_multinode import free_port

pytestmark = [pytest.mark.timing]
ROOT = Path(__file__).resolve().parents[2]


def _start(args: list[str], env: dict[str, str], **kwargs: object) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "recycle", *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, **kwargs)  # type: ignore[call-overload]


def _run_with_a_coordinator_restart(tmp_path: Path, config_file: Path, common_flags: list[str], node_flags: list[str],
                                    away_s: float) -> tuple[str, str, str, Path]:
    """One training node (D=2 x S=2) against `recycle coordinator`, which is SIGKILLed after step 3 and started again
    `away_s` later. Returns (both coordinators' output, the node's output, stderr of all, the --save file)."""
    save = tmp_path / "final.pt"
    metrics = tmp_path / "metrics.jsonl"
    env = {**os.environ, "RECYCLE_JOB_TOKEN": secrets.token_hex(24)}
    flags = ["--config", str(config_file), "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port",
             str(free_port()), "--timeout", "20", "--heartbeat-timeout", "2", "--save", str(save), "--metrics",
             str(metrics), *common_flags]
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
def test_a_restarted_coordinator_takes_the_run_over_and_a_node_rejoins_it(tmp_path: Path, tiny_config_file) -> None:
    """Two nodes. The coordinator is SIGKILLed after step 2 and started again 2 s later: it takes the run over. Then
    node 1 (its launcher and workers) is SIGKILLed, and started again: it re-joins the restarted coordinator, and the
    run ends with every worker up and the fault-free parameters."""
    # 28 steps of about 0.9 s: long enough for node 1 to start again on 2 busy cores (float64 rounding: see
    # reference_check).
    config_file = tiny_config_file(steps=28)
    save = tmp_path / "final.pt"
    env = {**os.environ, "RECYCLE_JOB_TOKEN": secrets.token_hex(24)}
    flags = ["--config", str(config_file), "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port",
             str(free_port()), "--timeout", "20", "--heartbeat-timeout", "2", "--save", str(save)]
    node = ["train", *flags, "--coordinator", "separate", "--emulate-costs", "--slot-ms", "120"]
    first = _start(["coordinator", *flags], env)
    node0 = _start([*node, "--node-rank", "0"], env)
    node1 = _start([*node, "--node-rank", "1"], env, start_new_session=True)
    second = repaired = None
    try:
        before = _wait_for(first, "step 2/", 150)
        first.send_signal(signal.SIGKILL)
        first.wait()
        time.sleep(2.0)
        second = _start(["coordinator", *flags], env)
        taken = _wait_for(second, "took over the run", 60)
        os.killpg(node1.pid, signal.SIGKILL)
        lost = _wait_for(second, "node 1 stopped responding", 60)
        repaired = _start([*node, "--node-rank", "1"], env)
        out, err = second.communicate(timeout=180)
        out0, err0 = node0.communicate(timeout=60)
        out1, err1 = repaired.communicate(timeout=60)
    finally:
        for process in (first, node0, node1, second, repaired):
            if process is not None and process.poll() is None:
                process.kill()
            if process is not None:
                process.wait()
    output = before + taken + lost + out
    assert second.returncode == 0, output + err
    assert node0.returncode == 0 and repaired.returncode == 0, err0 + err1
    assert "this is a restarted coordinator" in output
    assert "took over the run in generation 0 with 4 live worker(s)" in output
    assert "(restarted)" in out0
    rejoined = {w for line in output.splitlines() if "re-joined" in line
                for w in line.split("re-joined")[0].split(";")[-1].replace(",", " ").split()}
    assert {"1:0", "1:1"} <= rejoined, output
    assert "every worker is up at the end" in output
    assert "step 28/28" in output
    assert "Traceback" not in err + err0 + err1
    _close_to_reference(save, config_file, LONG_RUN_TOLERANCE)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_killed_while_the_coordinator_is_away_is_handled_when_it_is_back(tmp_path: Path,
                                                                                  tiny_config_file) -> None:
    config_file = tiny_config_file(steps=20)
    checkpoints = tmp_path / "ckpt"
    # Worker 1:1 is SIGKILLed in step 8, while the coordinator (killed after step 3) is away for 6 s; checkpoints are
    # written meanwhile, and the restarted coordinator completes them.
    out, out_node, err, save = _run_with_a_coordinator_restart(
        tmp_path, config_file, ["--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3"],
        ["--inject", "kill:1:1@8"], away_s=6.0)
    assert "this is a restarted coordinator" in out
    assert "worker 1:1" in out and "killed by SIGKILL" in out, out
    assert "generation 1" in out
    assert "step 20/20" in out
    assert "workers down at the end: 1:1" in out
    assert (checkpoints / "latest").read_text().strip() == "step000018"
    assert "Traceback" not in err
    _close_to_reference(save, config_file)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_coordinator_frozen_for_a_while_blames_nobody_when_it_wakes(tmp_path: Path, tiny_config_file) -> None:
    """`recycle coordinator` SIGSTOPped for 8 s (four heartbeat timeouts) and continued: on waking it finds every
    beat old, but the silence was its own; nobody is declared dead and the run ends exact."""
    config_file = tiny_config_file(steps=24)
    save = tmp_path / "final.pt"
    env = {**os.environ, "RECYCLE_JOB_TOKEN": secrets.token_hex(24)}
    flags = ["--config", str(config_file), "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port",
             str(free_port()), "--heartbeat-timeout", "2", "--save", str(save)]
    coordinator = _start(["coordinator", *flags], env)
    node = _start(["train", *flags, "--coordinator", "separate", "--node-rank", "0", "--emulate-costs", "--slot-ms",
                   "60"], env)
    try:
        before = _wait_for(coordinator, "step 4/", 150)
        coordinator.send_signal(signal.SIGSTOP)
        time.sleep(8.0)
        coordinator.send_signal(signal.SIGCONT)
        out, err = coordinator.communicate(timeout=150)
        out_node, err_node = node.communicate(timeout=60)
    finally:
        for process in (coordinator, node):
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()
            process.wait()
    assert coordinator.returncode == 0 and node.returncode == 0, err + err_node
    output = before + out
    assert "step 24/24" in output and "survived" not in output and "stopped responding" not in output, output
    _close_to_reference(save, config_file)
