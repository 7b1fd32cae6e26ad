"""One side of bench_runtime_vs_pipelining.py alone (ours or theirs), 25 steps of its default shape with the given D
and S: to run both sides at once under the same load with sitecustomize.py's profiles (start two of these together).

    PYTHONPATH=benchmarks/step_profile:src .venv/bin/python benchmarks/step_profile/one_side.py ours|theirs D S
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_runtime_vs_pipelining as bench  # type: ignore[import-not-found]  # noqa: E402


def main() -> int:
    side, replicas, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    shape = argparse.Namespace(replicas=replicas, stages=stages, microbatches=max(4, stages), microbatch_size=4,
                               seq_len=64, preset="small", steps=25)
    run = bench.run_ours if side == "ours" else bench.run_theirs
    periods, cpu = run(bench.bench_config(shape), 25, 3)
    print(f"{side}: median period {statistics.median(periods) * 1e3:.1f} ms, CPU {statistics.median(cpu) * 1e3:.1f} ms "
          "per step over all workers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
