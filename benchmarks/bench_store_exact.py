"""Build a whole plan store with the exact solver (and with the heuristic, side by side); time it, compare periods.

Run: .venv/bin/python benchmarks/bench_store_exact.py [--config configs/gpt3-6.7b-a100.toml] [--max-failures 3]
                                                     [--time-limit 8] [--jobs 1]

D=6, S=4 and up to 3 failures give 35 normalized keys. Each key is planned by `recycle.planner.store.build_store`
(solver "exact": the heuristic plan, then CP-SAT warm-started from it, per-key time limit), then the same store is
built with the heuristic alone. The table shows per key both periods, the lower bound and the solver status.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from recycle.config import load_config, uniform_config
from recycle.planner.api import clear_cache
from recycle.planner.options import PlannerOptions
from recycle.planner.store import INDEX_NAME, build_store

_SECONDS = re.compile(r"key=\(([\d,]+)\).*\(([\d.]+)s\)")


class _Tee(io.TextIOBase):
    """Echo progress lines to stdout while keeping them for the per-key times."""

    def __init__(self, echo: bool) -> None:
        self.lines: list[str] = []
        self.echo = echo

    def write(self, text: str) -> int:
        self.lines.append(text)
        if self.echo:
            sys.stdout.write(text)
        return len(text)


def _build(config, max_failures: int, solver: str, time_limit_s: float, jobs: int, echo: bool
           ) -> tuple[dict, dict[tuple[int, ...], float], float]:
    clear_cache()  # time cold planning: no plan from an earlier build in this process
    progress = _Tee(echo)
    with tempfile.TemporaryDirectory() as out:
        began = time.perf_counter()
        build_store(config, max_failures, out, PlannerOptions(), solver=solver, time_limit_s=time_limit_s,
                    jobs=jobs, progress=progress)
        elapsed = time.perf_counter() - began
        index = json.loads((Path(out) / INDEX_NAME).read_text())
    seconds = {}
    for line in "".join(progress.lines).splitlines():
        match = _SECONDS.search(line)
        if match:
            seconds[tuple(int(k) for k in match.group(1).split(","))] = float(match.group(2))
    return index, seconds, elapsed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="configs/gpt3-6.7b-a100.toml",
                        help="config file; 'uniform' for a D=6, S=4, M=8 unit-cost config")
    parser.add_argument("--max-failures", type=int, default=3)
    parser.add_argument("--time-limit", type=float, default=8.0, help="CP-SAT seconds per key")
    parser.add_argument("--jobs", type=int, default=1, help="keys planned in parallel (processes)")
    parser.add_argument("--quiet", action="store_true", help="no per-key progress lines")
    args = parser.parse_args(argv)
    if args.config == "uniform":
        config = uniform_config(6, 4, 8, optimizer=2.0, name="uniform-6x4x8")
    else:
        config = load_config(args.config)

    exact, exact_seconds, exact_total = _build(config, args.max_failures, "exact", args.time_limit, args.jobs,
                                               not args.quiet)
    heuristic, _, heuristic_total = _build(config, args.max_failures, "heuristic", args.time_limit, args.jobs, False)

    unit = config.time_unit
    print(f"\nconfig {config.name}: D={config.num_replicas} S={config.num_stages} M={config.num_microbatches}, up to "
          f"{args.max_failures} failures, CP-SAT limit {args.time_limit:g}s per key, jobs {args.jobs}")
    print(f"{'key':<14} {'heuristic':>12} {'exact':>12} {'bound':>12} {'exact/heur':>10} {'status':<9} {'s':>6}")
    gains, gaps, statuses = [], [], []
    for name, entry in exact["plans"].items():
        key = tuple(entry["key"])
        h = heuristic["plans"][name]["period"]
        e, bound = entry["period"], entry["lower_bound"]
        gains.append(e / h)
        gaps.append((e - bound) / e if bound > 0 else float("nan"))
        statuses.append(entry["status"])
        print(f"{str(key):<14} {h:>12.6g} {e:>12.6g} {bound:>12.6g} {e / h:>10.4f} {entry['status']:<9} "
              f"{exact_seconds.get(key, float('nan')):>6.2f}")
    keys = len(exact["plans"])
    per_key = list(exact_seconds.values())
    print(f"\nexact store: {keys} keys in {exact_total:.1f}s (per key: mean {statistics.mean(per_key):.2f}s, "
          f"max {max(per_key):.2f}s); heuristic store: {heuristic_total:.2f}s")
    print(f"status: {statuses.count('OPTIMAL')} OPTIMAL, {statuses.count('FEASIBLE')} FEASIBLE, "
          f"{keys - statuses.count('OPTIMAL') - statuses.count('FEASIBLE')} other")
    print(f"exact period / heuristic period: mean {statistics.mean(gains):.4f}, min {min(gains):.4f} "
          f"({sum(g < 1 - 1e-9 for g in gains)} keys improved)")
    finite = [g for g in gaps if g == g]
    print(f"exact period over the stored lower bound ({unit}): mean gap {statistics.mean(finite):.2%}, "
          f"max {max(finite):.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
