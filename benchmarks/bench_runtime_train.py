"""Real training runs on this machine: exactness against the single-process reference, step period of fault-free
schedules vs adaptive plans with a worker down, and how fast a killed worker stops the job.

Run: .venv/bin/python benchmarks/bench_runtime_train.py [--steps N]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from recycle.config import load_config
from recycle.errors import RuntimeFailure
from recycle.planner.api import make_plan
from recycle.planner.options import PlannerOptions
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import (ClusterOptions, DebugOptions, FaultOptions, LaunchOptions, OutputOptions,
                                     RecoveryOptions)
from recycle.runtime.tools.reference import reference_train
from recycle.runtime.worker.process import FaultInjection
from recycle.schedules.fault_free import build_schedule

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "tiny-gpt.toml"))
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    base = load_config(args.config)
    config = replace(base, training=replace(base.training, dtype="float64", steps=args.steps))
    ref, _ = reference_train(config)
    plans = {
        "1f1b (coupled)": build_schedule(config, "1f1b", staggered=False),
        "zb-h1 (staggered)": build_schedule(config, "zb-h1", staggered=True),
        "adaptive 1:1 down, decoupled+staggered": make_plan(config, {(1, 1)}, PlannerOptions(True, True),
                                                            solver="heuristic"),
        "adaptive 1:1 down, coupled fused": make_plan(config, {(1, 1)}, PlannerOptions(False, False),
                                                      solver="heuristic"),
    }
    print(f"config {args.config}: D={config.num_replicas} S={config.num_stages} M={config.num_microbatches}, "
          f"{args.steps} steps, float64, gloo on CPU ({torch.get_num_threads()} threads here)")
    print(f"{'plan':42s} {'live':>4s} {'median period ms':>17s} {'tokens/s':>9s} {'max rel err vs ref':>19s}")
    with tempfile.TemporaryDirectory() as tmp:
        baseline = None
        for name, plan in plans.items():
            save = Path(tmp) / "final.pt"
            result = launch(config, plan, LaunchOptions(outputs=OutputOptions(save_path=str(save)),
                                                        cluster=ClusterOptions(start_method="forkserver"),
                                                        debug=DebugOptions(verify_replicas=True), progress=None))
            got = torch.load(save, weights_only=True)["model"]
            err = max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) for k in ref)
            periods = [s.period_s for s in result.steps[1:]]  # skip the warm-up step
            period = statistics.median(periods)
            baseline = baseline or period
            tokens = statistics.median(s.tokens_per_s for s in result.steps[1:])
            print(f"{name:42s} {len(plan.live_ranks()):4d} {period * 1e3:17.1f} {tokens:9.0f} {err:19.2e}"
                  f"   (period x{period / baseline:.2f} of the first row)")

        plan = plans["zb-h1 (staggered)"]
        seen: list[float] = []
        try:
            launch(config, plan, LaunchOptions(faults=FaultOptions(injections=((3, FaultInjection(2, 2, "kill")),)),
                                               recovery=RecoveryOptions(timeout_s=60),
                                               cluster=ClusterOptions(start_method="forkserver"),
                                               progress=lambda _: seen.append(time.monotonic())))
        except RuntimeFailure as exc:
            stop = time.monotonic()
            print(f"SIGKILL of worker 1:1 in step 3 with no plan provider: job stopped {stop - seen[-1]:.2f} s after "
                  f"step 2 was reported: {str(exc).split(';')[0]} (recovery: benchmarks/bench_recovery.py)")


if __name__ == "__main__":
    main()
