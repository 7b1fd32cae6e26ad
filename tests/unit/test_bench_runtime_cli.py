"""The parity benchmark's command line refuses bad input with one error line (it runs nothing)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "benchmarks", "bench_runtime_vs_pipelining.py")


@pytest.mark.parametrize("args,message", [
    (["--compare-with", "/nonexistent-tree"], "--compare-with /nonexistent-tree has no src/recycle"),
    (["--stages", "4", "--microbatches", "2"], "--microbatches 2 is fewer than --stages 4"),
])
def test_bad_arguments_give_one_error_line_and_exit_2(args: list[str], message: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    done = subprocess.run([sys.executable, BENCH, *args], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr
