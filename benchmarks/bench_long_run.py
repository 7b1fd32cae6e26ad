"""Long runs (issue 23 item 5): node 0's memory and the --metrics cost per record over many tiny real steps.

A real `recycle.train` run (D=1 x S=2 worker processes, a 2-layer GPT of width 16, one micro-batch per step) for
--steps steps with --metrics; node 0 (this process: the launcher, the coordinator and the store) samples its RSS
through an event sink. Beside it, in the same run, the per-record cost of the --metrics file as it is written now
(one append per record) against the previous way (the whole file rewritten atomically per record), at the same
file sizes. Last line: a JSON summary.

Run: .venv/bin/python benchmarks/bench_long_run.py [--steps 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from recycle.api import config_from_dict, train  # noqa: E402
from recycle.fileio import append_text, atomic_write_text  # noqa: E402


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class RssSampler:
    """An event sink: node 0's RSS every `every` steps."""

    def __init__(self, every: int) -> None:
        self.every, self.samples = every, []  # (step, rss MB)

    def on_step(self, metrics) -> None:
        if metrics.step % self.every == 0:
            self.samples.append((metrics.step, rss_mb()))

    def on_recovery(self, recovery) -> None:
        pass

    def on_chaos(self, event) -> None:
        pass


def record_costs(sizes: list[int], line: str, repeats: int = 20) -> list[tuple[int, float, float]]:
    """(records already in the file, seconds per append, seconds per whole-file rewrite) at each size."""
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "metrics.jsonl"
        for size in sizes:
            text = line * size
            atomic_write_text(path, text)
            t0 = time.perf_counter()
            for _ in range(repeats):
                append_text(path, line)
            append_s = (time.perf_counter() - t0) / repeats
            t0 = time.perf_counter()
            for _ in range(repeats):
                atomic_write_text(path, text + line)
            rewrite_s = (time.perf_counter() - t0) / repeats
            out.append((size, append_s, rewrite_s))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20000, help="training steps (default 20000)")
    args = parser.parse_args()
    config = config_from_dict({
        "name": "long-run", "time_unit": "slot",
        "topology": {"num_replicas": 1, "num_stages": 2},
        "workload": {"num_microbatches": 1, "microbatch_size": 1, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1, "optimizer": 1},
        "model": {"n_layer": 2, "n_embd": 16, "n_head": 2},
        "training": {"steps": args.steps, "lr": 1e-3, "seed": 0},
    })
    sampler = RssSampler(max(args.steps // 20, 1))
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        started = time.perf_counter()
        result = train(config, metrics_path=str(metrics), sink=sampler, recover=False)
        wall = time.perf_counter() - started
        lines = metrics.read_text().splitlines()
        line = lines[-1] + "\n"
    print(f"{args.steps} steps in {wall:.1f} s ({wall / args.steps * 1e3:.2f} ms/step); metrics lines {len(lines)}; "
          f"steps kept in the result {len(result.steps)}")
    print("node 0 RSS (MB) by step:", " ".join(f"{s}:{m:.0f}" for s, m in sampler.samples))
    sizes = [1000, 10000, 100000]
    costs = record_costs(sizes, line)
    print(f"{'records in file':>16} {'append (ms)':>12} {'rewrite (ms)':>13} {'rewrite/append':>15}")
    for size, append_s, rewrite_s in costs:
        print(f"{size:>16} {append_s * 1e3:>12.3f} {rewrite_s * 1e3:>13.3f} {rewrite_s / append_s:>15.1f}")
    half = len(sampler.samples) // 2
    growth = (sampler.samples[-1][1] - sampler.samples[half][1]) if sampler.samples else float("nan")
    print(json.dumps({"steps": args.steps, "wall_s": round(wall, 1), "metrics_lines": len(lines),
                      "rss_first_mb": round(sampler.samples[0][1], 1) if sampler.samples else None,
                      "rss_last_mb": round(sampler.samples[-1][1], 1) if sampler.samples else None,
                      "rss_growth_second_half_mb": round(growth, 1),
                      "append_ms_at": {str(s): round(a * 1e3, 3) for s, a, _ in costs},
                      "rewrite_ms_at": {str(s): round(r * 1e3, 3) for s, _, r in costs}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
