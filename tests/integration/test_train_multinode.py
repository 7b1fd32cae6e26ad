"""Two launchers on 127.0.0.1 act as two nodes: node 0 hosts the store, node 1 joins it; the job trains to the
same parameters as the single-process reference."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from recycle.config import load_config
from recycle.runtime.tools.reference import reference_train

pytestmark = [pytest.mark.timing]
ROOT = Path(__file__).resolve().parents[2]

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _two_nodes_end_cleanly(common: list[str], node0_flags: tuple[str, ...] = ()) -> str:
    """Run `common` as node 0 (with `node0_flags`) and node 1 under one fresh job secret; both must exit 0. Node 0's
    stdout."""
    env = {**os.environ, "RECYCLE_JOB_TOKEN": secrets.token_hex(24)}
    node0 = subprocess.Popen([*common, "--node-rank", "0", *node0_flags], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    node1 = subprocess.Popen([*common, "--node-rank", "1"], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    _, err1 = node1.communicate(timeout=150)
    out0, err0 = node0.communicate(timeout=150)
    assert node0.returncode == 0, err0
    assert node1.returncode == 0, err1
    return out0


def _assert_like_the_reference(save: Path, config_file: Path) -> None:
    """The saved parameters equal the single-process reference's to 1e-9 (relative, per tensor)."""
    got = torch.load(save, weights_only=True)["model"]
    ref, _ = reference_train(load_config(config_file))
    for key in ref:
        assert float((got[key] - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-12)) < 1e-9, key


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_launchers_train_like_the_reference(tmp_path: Path, tiny_config_file) -> None:
    config_file = tiny_config_file(steps=2)
    save = tmp_path / "final.pt"
    port = str(free_port())
    common = [sys.executable, "-m", "recycle", "train", "--config", str(config_file), "--nnodes", "2",
              "--master-addr", "127.0.0.1", "--master-port", port, "--save", str(save), "--timeout", "20"]
    out0 = _two_nodes_end_cleanly(common)
    assert "step 2/2" in out0
    _assert_like_the_reference(save, config_file)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_node_without_metrics_computes_the_grad_norm_node_0_reports(tmp_path: Path, tiny_config_file) -> None:
    """D=1 x S=2 on two nodes: stage 1 runs only on node 1, started without --metrics; its worker follows the job's
    choice (node 0's --metrics wants the norm), so every step's norm is in node 0's file."""
    config_file = tiny_config_file(steps=2)
    metrics = tmp_path / "metrics.jsonl"
    port = str(free_port())
    common = [sys.executable, "-m", "recycle", "train", "--config", str(config_file), "--set",
              "topology.num_replicas=1", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
              "--timeout", "20"]
    _two_nodes_end_cleanly(common, node0_flags=("--metrics", str(metrics)))
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "event" not in r]
    assert len(steps) == 2 and all(r["grad_norm"] is not None and r["grad_norm"] > 0 for r in steps), steps


def test_a_node_without_the_job_secret_is_refused(tmp_path: Path, tiny_config_file) -> None:
    config_file = tiny_config_file(steps=2)
    env = {k: v for k, v in os.environ.items() if k != "RECYCLE_JOB_TOKEN"}
    run = subprocess.run([sys.executable, "-m", "recycle", "train", "--config", str(config_file), "--nnodes", "2",
                          "--node-rank", "0", "--master-port", str(free_port())], cwd=ROOT, capture_output=True,
                         text=True, env=env, timeout=60)
    assert run.returncode == 2
    assert "RECYCLE_JOB_TOKEN" in run.stderr and "Traceback" not in run.stderr


def _two_nodes_with_a_fault(config_file: Path, save: Path, fault: str, *flags: str) -> str:
    """Both nodes of a two-node run with one scripted fault (`--inject fault`); node 0's output. Both end cleanly and
    the saved parameters equal the single-process reference."""
    common = [sys.executable, "-m", "recycle", "train", "--config", str(config_file), "--nnodes", "2",
              "--master-port", str(free_port()), "--save", str(save), "--inject", fault, *flags]
    out0 = _two_nodes_end_cleanly(common)
    _assert_like_the_reference(save, config_file)
    return out0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_worker_killed_on_the_other_node_is_survived(tmp_path: Path, tiny_config_file) -> None:
    """Worker 1:1 runs on node 1; its launcher reports the SIGKILL through the store and node 0 re-routes."""
    out0 = _two_nodes_with_a_fault(tiny_config_file(steps=4), tmp_path / "final.pt", "kill:1:1@3.2")
    assert "worker 1:1 (rank 3" in out0 and "died (killed by SIGKILL) during" in out0 and "step 4/4" in out0


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault", ["hang", "stall"])
def test_a_worker_frozen_or_stuck_on_the_other_node_is_told_by_its_launcher(tmp_path: Path, tiny_config_file,
                                                                            fault: str) -> None:
    """Worker 1:1 runs on node 1 and beats to node 1's own store. Frozen (SIGSTOP: its beats stop) or stuck (its
    main thread computes one action forever while it beats): node 1's launcher sees it and raises one flag; the
    coordinator on node 0 fences it, node 1's launcher kills it, and the run ends exact."""
    out0 = _two_nodes_with_a_fault(tiny_config_file(steps=8), tmp_path / "final.pt", f"{fault}:1:1@3.2",
                                   "--heartbeat-timeout", "2", "--hang-timeout", "3", "--emulate-costs", "--slot-ms",
                                   "20")
    told = "stopped responding (no heartbeat for" if fault == "hang" else "is hung (its heartbeat goes on"
    assert "worker 1:1 (rank 3" in out0 and told in out0 and "step 8/8" in out0, out0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_with_another_token_is_told_at_once_that_no_job_runs_with_it(tmp_path: Path, tiny_config_file) -> None:
    """Issue 21 item 1: it used to wait 85 s and then say that node 0 was gone."""
    config_file = tiny_config_file(steps=200)
    port = str(free_port())
    common = [sys.executable, "-m", "recycle", "train", "--config", str(config_file), "--nnodes", "2",
              "--master-port", port]
    node0 = subprocess.Popen([*common, "--node-rank", "0"], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env={**os.environ, "RECYCLE_JOB_TOKEN": secrets.token_hex(24)})
    try:
        time.sleep(2)
        wrong = subprocess.run([*common, "--node-rank", "1"], cwd=ROOT, capture_output=True, text=True, timeout=60,
                               env={**os.environ, "RECYCLE_JOB_TOKEN": secrets.token_hex(24)})
    finally:
        node0.kill()
        node0.wait()
    assert wrong.returncode == 2
    assert "no job there runs with this token" in wrong.stderr and "Traceback" not in wrong.stderr
    assert wrong.stderr.count("\n") <= 3  # the error line (and at most the start-up lines)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_started_with_other_flags_is_refused_at_once_saying_what_differs(tmp_path: Path,
                                                                                 tiny_config_file) -> None:
    """Every launcher checks the run's settings that node 0 (or the separate coordinator) published before it starts
    a worker: here node 1 asks for other --steps and no --save."""
    config_file = tiny_config_file(steps=200)
    port = str(free_port())
    env = {**os.environ, "RECYCLE_JOB_TOKEN": secrets.token_hex(24)}
    common = [sys.executable, "-m", "recycle", "train", "--config", str(config_file), "--nnodes", "2",
              "--master-port", port]
    node0 = subprocess.Popen([*common, "--node-rank", "0", "--save", str(tmp_path / "final.pt")], cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        other = subprocess.run([*common, "--node-rank", "1", "--steps", "7"], cwd=ROOT, capture_output=True,
                               text=True, timeout=90, env=env)
    finally:
        node0.kill()
        node0.wait()
    assert other.returncode == 2, other.stderr
    assert "node 1 was started with other settings than the job's coordinator" in other.stderr
    assert "--steps: 7 here, 200 at the coordinator" in other.stderr and "--save: '' here" in other.stderr
    assert "Traceback" not in other.stderr
