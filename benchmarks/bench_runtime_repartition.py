"""Layer re-partitioning in the runtime, side by side: the same SIGKILL of worker 1:1 survived by re-routing alone
and by re-routing plus moving layers (--repartition), measured periods against the simulator's.

Run: .venv/bin/python benchmarks/bench_runtime_repartition.py [--steps 16] [--slot-ms 20]

The tiny GPT (4 layers, D=2 x S=2, M=4, float64), every action paced to its config cost (--emulate-costs; a stage
holding 3 layers instead of 2 is paced 1.5x). Worker 1:1 dies at step 3: stage 1 keeps one replica, which must do
both pipelines' stage-1 work. Re-routing alone: its period sets the pace. With --repartition the planner moves layer
2 to stage 0 (two replicas), the survivors hand it over at the iteration boundary, and every stage's work per live
worker is closer to even.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from recycle.config import load_config
from recycle.ir import PlanProvider
from recycle.planner.options import PlannerOptions
from recycle.planner.partition import partition_config
from recycle.planner.provider import PlanLibrary, RepartitioningProvider
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import ClusterOptions, DebugOptions, FaultOptions, LaunchOptions, OutputOptions
from recycle.runtime.tools.faults import FaultInjection
from recycle.runtime.worker.emulate import Emulation
from recycle.schedules.fault_free import build_schedule
from recycle.sim.simulator import simulate

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--slot-ms", type=float, default=20.0)
    args = parser.parse_args()
    config = load_config(ROOT / "configs" / "tiny-gpt.toml")
    plan = build_schedule(config, "zb-h1", staggered=True)
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=2)
    providers: dict[str, PlanProvider] = {"re-route only (ReCycle)": library.lookup,
                                          "re-route + move layers (--repartition)": RepartitioningProvider(
                                              config, PlannerOptions(), library.lookup)}
    slot_s = args.slot_ms / 1e3
    ff = simulate(plan, config).period * slot_s
    print(f"tiny GPT D=2 x S=2 M=4, float64, {args.steps} steps at {args.slot_ms:g} ms/slot; worker 1:1 SIGKILLed at "
          f"step 3; fault-free zb-h1 period simulated {ff:.3f} s")
    print(f"{'policy':42s} {'partition':>10s} {'measured s':>11s} {'simulated s':>12s} {'error':>7s} "
          f"{'vs fault-free':>13s} {'moved':>14s}")
    rows = {}
    for name, provider in providers.items():
        with tempfile.TemporaryDirectory() as tmp:
            result = launch(config, plan, LaunchOptions(
                steps=args.steps, outputs=OutputOptions(save_path=str(Path(tmp) / "m.pt")),
                cluster=ClusterOptions(start_method="forkserver"),
                debug=DebugOptions(emulation=Emulation(args.slot_ms, 1.0)),
                faults=FaultOptions(injections=((plan.rank(1, 1), FaultInjection(2, 3)),)), plan_provider=provider,
                progress=None))
        (recovery,) = result.recoveries
        after = [s.period_s for s in result.steps if s.step > recovery.step + 1]
        measured = statistics.median(after)
        chosen = provider(frozenset({(1, 1)})).plan
        derived = partition_config(config, chosen.partition) if chosen.partition else config
        predicted = simulate(chosen, derived).period * slot_s
        rows[name] = measured
        moved = f"{recovery.migration_bytes / 1e6:.2f} MB {recovery.migration_s * 1e3:.0f} ms" \
            if recovery.layers_moved else "-"
        print(f"{name:42s} {str(list(chosen.partition) or [2, 2]):>10s} {measured:11.3f} {predicted:12.3f} "
              f"{measured / predicted - 1:+7.1%} {measured / ff:13.2f}x {moved:>14s}")
    base, moved = rows.values()
    print(f"moving layers: period {moved / base:.2f}x of re-routing alone (measured side by side in this run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
