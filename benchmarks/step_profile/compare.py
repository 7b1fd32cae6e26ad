"""Compare the per-step profiles sitecustomize.py here wrote for two sides: per worker and step, the main thread's
CPU and Python calls (cProfile .prof files) or torch ops (.ops.tsv), and the functions or ops that differ most; or
(.threads.tsv) each thread's user and system CPU and the process's page faults and context switches.

    python benchmarks/step_profile/compare.py DIR [--steps 10] [--top 30] [--a ours --b theirs]
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import pstats
import sys
from typing import Mapping


def _load(directory: str, side: str) -> tuple[dict[str, Mapping[str, float]], int, str]:
    """{"calls": ..., "time_ms": ...} summed over the side's workers, the number of workers, and the kind."""
    calls: collections.Counter[str] = collections.Counter()
    time_ms: collections.defaultdict[str, float] = collections.defaultdict(float)
    profiles = glob.glob(os.path.join(directory, f"{side}-*.prof"))
    ops = glob.glob(os.path.join(directory, f"{side}-*.ops.tsv"))
    threads = glob.glob(os.path.join(directory, f"{side}-*.threads.tsv"))
    for path in profiles:
        for (filename, _, name), (_, count, own, _, _) in pstats.Stats(path).stats.items():  # type: ignore[attr-defined]
            key = f"{os.path.basename(filename)}:{name}"
            calls[key] += count
            time_ms[key] += own * 1e3
    for path in ops:
        with open(path) as lines:
            for line in lines:
                key, count, self_us = line.rstrip("\n").split("\t")
                calls[key] += int(count)
                time_ms[key] += float(self_us) / 1e3
    for path in threads:  # "thread NAME", user ms, system ms; or a getrusage count, its value, 0
        with open(path) as lines:
            for line in lines:
                key, user_or_count, system_ms = line.rstrip("\n").split("\t")
                calls[key] += float(user_or_count)  # type: ignore[assignment]
                time_ms[key] += float(system_ms)
    kind = "ops" if ops else "threads (user ms)" if threads else "Python calls"
    return {"calls": calls, "time_ms": time_ms}, len(profiles) + len(ops) + len(threads), kind


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory")
    parser.add_argument("--steps", type=int, default=10, help="RECYCLE_STEP_PROFILE_STEPS of the run")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--a", default="ours")
    parser.add_argument("--b", default="theirs")
    args = parser.parse_args()
    a, workers_a, kind = _load(args.directory, args.a)
    b, workers_b, _ = _load(args.directory, args.b)
    if not workers_a or not workers_b:
        print(f"error: {args.directory} has no profiles of both {args.a!r} and {args.b!r}; run the benchmark with "
              "RECYCLE_STEP_PROFILE set (see sitecustomize.py here)", file=sys.stderr)
        return 2
    per_a, per_b = workers_a * args.steps, workers_b * args.steps
    print(f"per worker and step: {kind} {args.a} {sum(a['calls'].values()) / per_a:.0f}, {args.b} "
          f"{sum(b['calls'].values()) / per_b:.0f}; CPU ms {args.a} {sum(a['time_ms'].values()) / per_a:.2f}, "
          f"{args.b} {sum(b['time_ms'].values()) / per_b:.2f}")
    keys = set(a["calls"]) | set(b["calls"])
    a = {name: collections.defaultdict(float, values) for name, values in a.items()}  # 0 for a key one side lacks
    b = {name: collections.defaultdict(float, values) for name, values in b.items()}
    first, second = ("user ms ", "sys ms ") if kind.startswith("threads") else ("calls ", "ms ")
    print(f"{'':60s} {first + args.a:>12s} {args.b:>8s} {second + args.a:>10s} {args.b:>8s}")
    for key in sorted(keys, key=lambda k: -abs(a["calls"][k] / per_a - b["calls"][k] / per_b))[:args.top]:
        print(f"{key[:60]:60s} {a['calls'][key] / per_a:12.1f} {b['calls'][key] / per_b:8.1f} "
              f"{a['time_ms'][key] / per_a:10.3f} {b['time_ms'][key] / per_b:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
