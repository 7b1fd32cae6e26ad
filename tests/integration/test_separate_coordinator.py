"""`recycle coordinator` (issue 23 item 1): the store and the coordinator in a process of their own; every training
node, node 0 included, runs `recycle train --coordinator separate` against it, so losing node 0 (its launcher and its
workers, SIGKILLed together) is an ordinary node failure: the other node trains to the end, exact; and a coordinator
cut off from every node by the network declares none of them dead."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from network_cut import namespace_link
from reference_check import LONG_RUN_TOLERANCE
from test_train_multinode import free_port

from recycle.config import load_config
from recycle.runtime.tools.reference import reference_train

pytestmark = [pytest.mark.timing]
ROOT = Path(__file__).resolve().parents[2]


def _close_to_reference(save: Path, config_file: Path, tolerance: float = 1e-9) -> None:
    got = torch.load(save, weights_only=True)["model"]
    ref, _ = reference_train(load_config(config_file))
    for key in ref:
        error = float((got[key] - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-12))
        assert error < tolerance, (key, error)


def _wait_for(process: subprocess.Popen, text: str, timeout_s: float) -> str:
    """Read `process`'s stdout until a line holds `text`; the lines read so far."""
    seen: list[str] = []
    deadline = time.time() + timeout_s
    assert process.stdout is not None
    while time.time() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return "".join(seen)
    raise AssertionError(f"no line with {text!r} within {timeout_s} s; saw:\n{''.join(seen)}")


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_losing_node_0_with_a_separate_coordinator_is_an_ordinary_node_failure(tmp_path: Path, tiny_config_file,
                                                                               fault: str) -> None:
    """Node 0 SIGKILLed, or SIGSTOPped (frozen) until the run has ended: node 1 trains to the end either way, and a
    frozen node 0 woken after the end (the coordinator and its store gone) stops at once and says why, rather than
    waiting out --coordinator-grace for a coordinator that will not come back."""
    config_file = tiny_config_file(steps=14)
    save = tmp_path / "final.pt"
    port = str(free_port())
    env = {**os.environ, "RECYCLE_JOB_TOKEN": secrets.token_hex(24)}
    flags = ["--config", str(config_file), "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", port,
             "--timeout", "20", "--heartbeat-timeout", "2", "--save", str(save)]
    coordinator = subprocess.Popen([sys.executable, "-m", "recycle", "coordinator", *flags],
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    node = [sys.executable, "-m", "recycle", "train", *flags, "--coordinator", "separate", "--emulate-costs",
            "--slot-ms", "40"]
    # Node 0 in a session of its own, so that one signal takes its launcher and every worker it started.
    node0 = subprocess.Popen([*node, "--node-rank", "0"], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    node1 = subprocess.Popen([*node, "--node-rank", "1"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    try:
        before = _wait_for(coordinator, "step 4/14", 150)
        os.killpg(node0.pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        out1, err1 = node1.communicate(timeout=150)
        out_c, err_c = coordinator.communicate(timeout=60)
        if fault == "freeze":
            woken = time.monotonic()
            os.killpg(node0.pid, signal.SIGCONT)
            _, err0 = node0.communicate(timeout=60)
            assert time.monotonic() - woken < 20, "the woken node waited for the coordinator to come back"
            assert node0.returncode != 0
            assert "did not run for" in err0 and "re-join" in err0, err0
            assert "Traceback" not in err0
    finally:
        for process in (coordinator, node0, node1):
            if process.poll() is None:
                os.killpg(node0.pid, signal.SIGCONT) if process is node0 else None
                process.kill()
            process.wait()
    out_c = before + out_c
    assert coordinator.returncode == 0, err_c
    assert node1.returncode == 0, err1
    assert "step 14/14" in out_c
    assert "node 0 stopped responding" in out_c, out_c
    assert "worker 0:0" in out_c and "worker 0:1" in out_c
    assert "workers down at the end: 0:0 0:1" in out_c
    assert "the coordinator reports" in out1
    assert "Traceback" not in err_c + err1
    _close_to_reference(save, config_file)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_coordinator_cut_off_from_every_node_declares_none_dead_and_the_run_goes_on(tmp_path: Path,
                                                                                      tiny_config_file) -> None:
    """`recycle coordinator` in a network namespace of its own whose link goes down for ~5 s (over twice the
    heartbeat timeout) mid-run: it hears no node any more, holds off rather than declaring them all dead (which would end the
    run), and when the link is back every node answers again; the nodes train on meanwhile, the run ends exact with
    nobody declared dead."""
    # 24 steps of ~0.9 s: the run goes on for a while after the link is back (float64 rounding: see reference_check)
    config_file = tiny_config_file(steps=24)
    save = tmp_path / "final.pt"
    with namespace_link() as link:
        env = {**os.environ, "RECYCLE_JOB_TOKEN": secrets.token_hex(24)}
        flags = ["--config", str(config_file), "--nnodes", "2", "--master-addr", link.inner_ip, "--master-port",
                 str(free_port()), "--timeout", "20", "--heartbeat-timeout", "2", "--save", str(save)]
        coordinator = subprocess.Popen([*link.command(sys.executable), "-m", "recycle", "coordinator", *flags],
                                       cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        node = [sys.executable, "-m", "recycle", "train", *flags, "--coordinator", "separate", "--emulate-costs",
                "--slot-ms", "120"]
        nodes = [subprocess.Popen([*node, "--node-rank", str(rank)], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env={**env, "GLOO_SOCKET_IFNAME": "lo"})
                 for rank in (0, 1)]
        try:
            before = _wait_for(coordinator, "step 4/24", 150)
            link.cut()
            before += _wait_for(coordinator, "stopped responding at once", 30)
            time.sleep(3.0)
            link.restore()
            # (a node's beat comes back when TCP retransmits its launcher's request: seconds after the link)
            before += _wait_for(coordinator, "the nodes answer again", 60)
            out_c, err_c = coordinator.communicate(timeout=150)
            ends = [process.communicate(timeout=60) for process in nodes]
        finally:
            for process in (coordinator, *nodes):
                if process.poll() is None:
                    process.kill()
                process.wait()
    out_c = before + out_c
    assert coordinator.returncode == 0, err_c
    assert [process.returncode for process in nodes] == [0, 0], ends
    assert "every node (2) stopped responding at once" in out_c, out_c
    assert "the nodes answer again" in out_c and "none was declared dead" in out_c, out_c
    assert "step 24/24" in out_c and "died" not in out_c and "fenced" not in out_c, out_c
    assert "Traceback" not in err_c + "".join(err for _, err in ends)
    _close_to_reference(save, config_file, LONG_RUN_TOLERANCE)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_node_whose_job_store_goes_away_while_it_starts_says_so_in_one_line(tiny_config_file) -> None:
    """A repaired node started just as the run ends: the job's store answers its first word, then closes (the
    coordinator finished) before the node has started its workers. The launcher ends with one `error:` line naming
    the store, not a traceback, and leaves no worker behind."""
    from recycle.runtime.protocol.channels import Keys, host_store

    token = secrets.token_hex(24)
    server = host_store("127.0.0.1", 0, token)
    node = subprocess.Popen([sys.executable, "-m", "recycle", "train", "--config", str(tiny_config_file(steps=4)),
                             "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1", "--master-port",
                             str(server.port), "--coordinator", "separate", "--timeout", "20"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RECYCLE_JOB_TOKEN": token})
    try:
        deadline = time.monotonic() + 60
        while server.data.get(Keys.node_hello(1).encode()) is None:  # it said hello; it now waits for the settings
            assert node.poll() is None and time.monotonic() < deadline, node.communicate()
            time.sleep(0.05)
        server.close()
        out, err = node.communicate(timeout=60)
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()
        server.close()
    assert node.returncode == 2, (out, err)
    assert "Traceback" not in err, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "node 1 lost contact with the job's store on the coordinator" in errors[0], err
    assert f"127.0.0.1:{server.port}" in errors[0]
