"""Two launchers on 127.0.0.1 that get their roles only from cluster environment variables (torchrun's env:// names,
SLURM's), and `recycle train --tensorboard` end to end."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recycle.config import load_config
from recycle.runtime.control.cluster_env import slurm_port
from recycle.runtime.tools.reference import reference_train

ROOT = Path(__file__).resolve().parents[2]
CLUSTER_VARS = ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def clean_env() -> dict[str, str]:
    """This process's environment without any cluster convention (the suite may itself run under SLURM)."""
    return {k: v for k, v in os.environ.items()
            if k not in CLUSTER_VARS and not k.startswith(("SLURM_", "PET_"))}


def run_two_nodes(config_file: Path, save: Path, node_env: list[dict[str, str]]) -> str:
    """Start node 1 then node 0 with no role flag at all; return node 0's stdout once both succeeded."""
    command = [sys.executable, "-m", "recycle", "train", "--config", str(config_file), "--save", str(save),
               "--timeout", "20", "--start-method", "forkserver"]
    token = secrets.token_hex(24)
    nodes = [subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**clean_env(), **env, "RECYCLE_JOB_TOKEN": token})
             for env in reversed(node_env)]
    try:
        outputs = [node.communicate(timeout=150) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, err
    return outputs[-1][0]


def assert_reference(config_file: Path, save: Path) -> None:
    got = torch.load(save, weights_only=True)["model"]
    ref, _ = reference_train(load_config(config_file))
    for key in ref:
        assert float((got[key] - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-12)) < 1e-9, key


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_nodes_from_torchrun_env_names(tmp_path: Path, tiny_config_file) -> None:
    config_file = tiny_config_file(steps=2)
    port = str(free_port())
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "NNODES": "2"}
    out0 = run_two_nodes(config_file, tmp_path / "final.pt",
                         [{**common, "NODE_RANK": "0"}, {**common, "NODE_RANK": "1"}])
    assert "step 2/2" in out0
    assert_reference(config_file, tmp_path / "final.pt")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_two_nodes_from_slurm_variables(tmp_path: Path, tiny_config_file) -> None:
    config_file = tiny_config_file(steps=2)
    # The port is derived from the job id on every node; pick a job id whose port is free here.
    job_id = next(str(j) for j in range(os.getpid() % 10_000, 10**6) if _port_free(slurm_port(str(j))))
    common = {"SLURM_JOB_ID": job_id, "SLURM_NNODES": "2", "SLURM_NTASKS": "2",
              "SLURM_JOB_NODELIST": "localhost,node[02]"}
    out0 = run_two_nodes(config_file, tmp_path / "final.pt",
                         [{**common, "SLURM_NODEID": "0"}, {**common, "SLURM_NODEID": "1"}])
    assert "step 2/2" in out0
    assert_reference(config_file, tmp_path / "final.pt")


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_tensorboard_from_the_cli_and_grad_norm_without_clipping(tmp_path: Path, tiny_config_file) -> None:
    """The norm from the stages' squares (no clipping) equals the clipping path's global norm, step by step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    runs = {}
    for name, training in (("plain", ""), ("clipped", "grad_clip = 1e9")):  # 1e9: computed, never applied
        config_file = tiny_config_file(steps=3, training=training, file=f"{name}.toml")
        board, metrics = tmp_path / f"tb-{name}", tmp_path / f"{name}.jsonl"
        run = subprocess.run([sys.executable, "-m", "recycle", "train", "--config", str(config_file), "--tensorboard",
                              str(board), "--metrics", str(metrics), "--start-method", "forkserver",
                              "--inject", "kill:1:1@1.2"],
                             cwd=ROOT, capture_output=True, text=True, env=clean_env(), timeout=150)
        assert run.returncode == 0, run.stderr
        assert "step 3/3" in run.stdout  # the CLI's progress lines still reach stdout through logging
        steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r and "loss" in r]
        runs[name] = [s["grad_norm"] for s in steps]
        events = EventAccumulator(str(board))
        events.Reload()
        tags = events.Tags()["scalars"]
        for tag in ("train/loss", "train/tokens_per_s", "train/period_s", "train/grad_norm", "workers/live",
                    "recovery/count", "recovery/resumed_s"):
            assert tag in tags, tag
        assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3]
        # Live workers as the coordinator knew them when each step was reported: 1:1 dies in step 2 (step 1 may be
        # reported after the death was seen).
        live = [e.value for e in events.Scalars("workers/live")]
        assert live[0] in (3, 4) and live[1:] == [3, 3]
        assert [e.value for e in events.Scalars("recovery/count")] == [1]
        assert [e.value for e in events.Scalars("train/grad_norm")] == pytest.approx(runs[name], rel=1e-6)
    assert all(n is not None and n > 0 for n in runs["plain"])
    assert runs["plain"] == pytest.approx(runs["clipped"], rel=1e-9)


FAKE_SRUN = """#!/bin/bash
# Stand-in for `srun --ntasks-per-node=1` on a 2-node allocation: the command once per node, SLURM_NODEID set.
while [[ $1 == --* ]]; do shift; done
pids=()
for node in 0 1; do SLURM_NODEID=$node SLURM_NTASKS=2 "$@" > "$RUN_DIR/node$node.out" 2>&1 & pids+=($!); done
rc=0
for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
exit $rc
"""


def _run_sbatch(tmp_path: Path, config_file: Path, first_job_id: int,
                **extra_env: str) -> tuple[subprocess.CompletedProcess, Path, dict[str, str]]:
    """examples/slurm/train.sbatch as sbatch would run it on a 2-node allocation, with the stand-in srun: the run,
    its RUN_DIR and each node's log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "srun").chmod(0o755)
    job_id = next(str(j) for j in range(first_job_id, 10**6) if _port_free(slurm_port(str(j))))
    run_dir = tmp_path / "run"
    env = {**clean_env(), "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "CONFIG": str(config_file), "RUN_DIR": str(run_dir), "CHECKPOINT_EVERY": "1", "SLURM_JOB_ID": job_id,
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "localhost,node02", **extra_env}
    run = subprocess.run(["bash", str(ROOT / "examples" / "slurm" / "train.sbatch")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=180)
    logs = {name: (run_dir / f"{name}.out").read_text() for name in ("node0", "node1")
            if (run_dir / f"{name}.out").exists()}
    return run, run_dir, logs


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_slurm_example_script_trains_on_two_nodes(tmp_path: Path, tiny_config_file) -> None:
    """examples/slurm/train.sbatch as sbatch would run it, with a stand-in srun: two launchers, the job secret in a
    mode-600 file that is gone afterwards, the reference parameters."""
    config_file = tiny_config_file(steps=2)
    run, run_dir, logs = _run_sbatch(tmp_path, config_file, os.getpid() % 10_000 + 1)
    assert run.returncode == 0, (run.stderr, logs)
    assert "step 2/2" in logs["node0"] and "SLURM_NNODES=2" in logs["node0"]
    assert not list(run_dir.glob("*.token"))
    assert (run_dir / "ckpt" / "latest").is_file() and (run_dir / "metrics.jsonl").is_file()
    assert_reference(config_file, run_dir / "final.pt")


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_the_slurm_example_script_with_a_separate_coordinator(tmp_path: Path, tiny_config_file) -> None:
    """COORDINATOR=separate: `recycle coordinator` on the batch host (here: the script's shell), both stand-in nodes
    ordinary training nodes; the coordinator reports the steps and merges --save."""
    config_file = tiny_config_file(steps=2)
    run, run_dir, logs = _run_sbatch(tmp_path, config_file, os.getpid() % 10_000 + 7, COORDINATOR="separate",
                                     MASTER_ADDR="127.0.0.1")
    assert run.returncode == 0, (run.stdout, run.stderr, logs)
    assert "step 2/2" in run.stdout and "coordinator: the job's store listens on 127.0.0.1" in run.stdout
    assert all("the coordinator reports the steps" in log for log in logs.values()), logs
    assert not list(run_dir.glob("*.token"))
    assert (run_dir / "ckpt" / "latest").is_file() and (run_dir / "metrics.jsonl").is_file()
    assert_reference(config_file, run_dir / "final.pt")
