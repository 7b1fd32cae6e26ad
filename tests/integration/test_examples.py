"""Every script in examples/ runs and says what it promised (the multi-process ones and the 1,024-GPU planning are
slow tests)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(*argv: str, timeout: int = 240) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MPLBACKEND": "Agg"}
    done = subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr  # issue 21 item 8 (tqdm's lock in the workers)
    return done.stdout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_own_training_loop_then_the_metrics_plot(tmp_path) -> None:
    out = _run("examples/train_loop.py", "--out", str(tmp_path))
    assert re.search(r"round 1: steps 1\.\.2 \(workers down: none\) losses \d", out), out
    assert re.search(r"round 2: steps 3\.\.4 \(workers down: 1:1\) losses \d", out), out
    png = tmp_path / "metrics.png"
    out = _run("examples/plot_metrics.py", str(tmp_path / "metrics-round1.jsonl"),
               str(tmp_path / "metrics-round2.jsonl"), "--out", str(png), timeout=120)
    assert out.startswith("4 steps (loss ") and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_pipelining_split_example_matches_its_reference(tmp_path) -> None:
    out = _run("examples/pipelining_split.py", "--out", str(tmp_path))
    worst = float(re.search(r"trained in one process: (\S+) \(float64\)", out).group(1))
    assert worst <= 1e-9, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hugging_face_example_matches_its_reference(tmp_path) -> None:
    pytest.importorskip("transformers")
    out = _run("examples/hf_gpt2.py", "--out", str(tmp_path))
    worst = float(re.search(r"trained whole in one process: (\S+)$", out, re.M).group(1))
    assert worst <= 1e-9, out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_planning_and_simulating_a_1024_gpu_job() -> None:
    out = _run("examples/plan_1024.py")
    assert re.search(r"^1024 workers, 8 down .* planned [\d,]+ actions", out, re.M), out
    goodput = dict(re.findall(r"^(\S+)\s+goodput\s+([\d.]+)%", out, re.M))
    assert set(goodput) == {"recycle", "checkpoint-restart"}
    assert float(goodput["recycle"]) >= float(goodput["checkpoint-restart"])
