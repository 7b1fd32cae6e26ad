"""ReCycle's reshape policy: goodput of every system on every shipped trace (and a few synthetic spot traces), with the
policy off and on side by side, and the hours ReCycle spent under each policy.

Run: nice -n 15 .venv/bin/python benchmarks/bench_reshape.py [--config configs/gpt3-6.7b-a100.toml] [--synthetic 3]

Job: the config sized to each trace (`--replicas auto`: D = most live nodes // S, extra nodes are spares), the
default costs (docs/traces.md); "off" is `recycle simulate --no-reshape`, "on" the default. The other systems do
not depend on the policy (they are run once, in the "on" replay).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from recycle.config import load_config
from recycle.traces.experiments import SYSTEM_NAMES, JobSetup, find_traces_dir, run_job
from recycle.traces.generate import parse_generate_spec
from recycle.traces.model import JobCosts
from recycle.traces.reader import read_trace

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ("fault-scaled", "checkpoint-restart", "oobleck", "bamboo")


def policy_hours(log: list[dict], end_s: float) -> str:
    hours: dict[str, float] = {}
    for i, entry in enumerate(log):
        stop = log[i + 1]["time_s"] if i + 1 < len(log) else end_s
        hours[entry["policy"]] = hours.get(entry["policy"], 0.0) + (stop - entry["time_s"]) / 3600
    return " ".join(f"{k} {v:.1f}h" for k, v in hours.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "gpt3-6.7b-a100.toml"))
    parser.add_argument("--synthetic", type=int, default=3, help="synthetic spot traces (Poisson, seeds 0..N-1)")
    args = parser.parse_args(argv)
    base = load_config(args.config)
    traces: list[tuple[str, object]] = []
    folder = find_traces_dir(ROOT)
    if folder is not None:
        traces += [(path.stem, read_trace(path)) for path in sorted(folder.glob("*.csv"))]
    else:
        print("no ../shared/data/traces beside the checkout: synthetic traces only", file=sys.stderr)
    for seed in range(args.synthetic):
        spec = f"poisson:nodes=30,hours=48,mtbf_h=12,repair_h=4,seed={seed}"
        traces.append((f"spot-poisson-seed{seed}", parse_generate_spec(spec)))

    header = (f"{'trace':<24} {'D':>2} | {'ReCycle off':>11} {'on':>7} | " + " ".join(f"{b:>18}" for b in BASELINES)
              + " | on >= every baseline | ReCycle policy hours (on)")
    print(header)
    print("-" * len(header))
    began = time.perf_counter()
    worst_margin = float("inf")
    for name, trace in traces:
        def run(reshape: bool, systems: list[str]):
            return run_job(base, trace, systems=systems, costs=JobCosts(reshape=reshape),
                           setup=JobSetup(replicas="auto"))

        off = run(False, ["recycle"])
        on = run(True, [s for s in SYSTEM_NAMES if s != "recycle-plus"])  # ReCycle+: bench_repartition.py
        g_off, g_on = off.runs["recycle"].goodput, on.runs["recycle"].goodput
        best = max(on.runs[b].goodput for b in BASELINES)
        worst_margin = min(worst_margin, g_on - best)
        print(f"{name:<24} {on.context.config.num_replicas:>2} | {g_off:>11.4f} {g_on:>7.4f} | "
              + " ".join(f"{on.runs[b].goodput:>18.4f}" for b in BASELINES)
              + f" | {'yes' if g_on >= best else 'NO':<20} | "
              + policy_hours(on.extra["recycle_policy"], on.timeline.end_s),
              flush=True)
    print(f"\n{len(traces)} traces in {time.perf_counter() - began:.0f} s; ReCycle (reshape on) minus the best "
          f"baseline's goodput, worst trace: {worst_margin:+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
