"""ReCycle+ (layer re-partitioning policy) against ReCycle's pure re-routing and the baseline models, side by side in
one run: the paper-shaped trace under both references; for the strict one, where the goodput goes (time lost by
cause, and per state ReCycle+ ran in its period beside the best achievable one over every layer partition and the
ideal live-proportional one) and the same replay with each of those two in every failure state (the most this cost
model allows); then every shipped trace and synthetic spot traces. Each ReCycle+ figure is printed beside the
same replay with micro-batches split into pieces (`run_job(split_microbatches=True)`, "ReCycle+ split"; issue 26),
and the bounds with whole micro-batches beside those with pieces.

Run: nice -n 15 .venv/bin/python benchmarks/bench_repartition.py [--config configs/gpt3-6.7b-a100.toml]
     [--synthetic 2] [--quick] [--traces NAME ...] [--references planner]

Goals (issue 15): on `--generate paper-gcp:placement=spread --reference planner`, ReCycle+ goodput >= the
fault-scaled line and >= 1.05x the Oobleck-like model; with the paper's reference (1F1B), no worse than ReCycle's.
Issue 26 item 4: strict-reference ReCycle+ (split) >= 1.05x Oobleck-like there, and >= the best baseline on every
shipped trace under the strict reference.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from recycle.config import load_config
from recycle.planner.api import fault_free_period
from recycle.planner.options import PlannerOptions
from recycle.planner.partition import ideal_period, partition_bound
from recycle.traces.experiments import JobSetup, find_traces_dir, job_grid, run_job
from recycle.traces.generate import parse_generate_spec
from recycle.traces.reader import read_trace

ROOT = Path(__file__).resolve().parents[1]
BASELINES = ("fault-scaled", "checkpoint-restart", "oobleck", "bamboo")
SPLIT = PlannerOptions(split_microbatches=True)


def paper(config, reference: str) -> None:
    trace = parse_generate_spec("paper-gcp:placement=spread", grid=job_grid(config), placement="random", seed=0)
    result = run_job(config, trace, setup=JobSetup(reference=reference))
    g = {name: run.goodput for name, run in result.runs.items()}
    split = run_job(config, trace, systems=["recycle-plus"], setup=JobSetup(reference=reference),
                    split_microbatches=True)
    plus, plain, cut = g["recycle-plus"], g["recycle"], split.runs["recycle-plus"].goodput
    print(f"\n== paper-gcp:placement=spread, reference {reference} (fault-free {result.fault_free_rate:.2f} samples/s)")
    for name, value in g.items():
        print(f"   {result.runs[name].label:34s} goodput {value:7.2%}   ReCycle+/this {plus / value:.3f}x"
              if value > 0 else f"   {result.runs[name].label:34s} goodput {value:7.2%}")
    print(f"   ReCycle+ / fault-scaled {plus / g['fault-scaled']:.3f}x (goal >= 1), / Oobleck-like "
          f"{plus / g['oobleck']:.3f}x (goal >= 1.05), / ReCycle {plus / plain:.3f}x")
    print(f"   ReCycle+ split (pieces of micro-batches) goodput {cut:7.2%}: / fault-scaled "
          f"{cut / g['fault-scaled']:.3f}x, / Oobleck-like {cut / g['oobleck']:.3f}x (goal >= 1.05), / ReCycle+ "
          f"{cut / plus:.4f}x, / ReCycle {cut / plain:.3f}x")
    decisions = [e for e in result.extra["recycle_plus_policy"] if e["policy"] in ("repartition", "re-route",
                                                                                   "layers back")]
    print(f"   ReCycle+ decisions: {sum(e['policy'] == 'repartition' for e in decisions)} re-partitions, "
          f"{sum(e['policy'] == 're-route' for e in decisions)} kept re-routing alone, "
          f"{sum(e['policy'] == 'layers back' for e in decisions)} back to the configured layers", flush=True)
    if reference == "planner":
        limits(config, trace, result, g)
        split_states(config, result, split)


def split_states(config, result, split) -> None:
    """Per failure state ReCycle+ split ran in: its period beside ReCycle+'s (whole micro-batches) in the same
    state and the best achievable period with pieces (`partition_bound` with split_microbatches)."""
    unit = result.context.seconds_per_unit
    samples = config.num_replicas * config.num_microbatches * config.workload.microbatch_size
    whole = {(tuple(s["key"]), tuple(s["partition"])): s["rate"] for s in result.extra["recycle_plus_states"]}
    print("\n   per state ReCycle+ split ran in, by time (periods in s): running h | split period | ReCycle+ (whole) "
          "period in that key and layers | best achievable with pieces")
    for state in split.extra["recycle_plus_states"]:
        key, run, rate = tuple(state["key"]), state["running_s"], state["rate"]
        if run < 1 or rate <= 0:
            continue
        other = whole.get((key, tuple(state["partition"])))
        floor = max(fault_free_period(config), partition_bound(config, key, SPLIT).bound) if any(key) else \
            fault_free_period(config)
        print(f"   key {str(key):14s} layers {'/'.join(map(str, state['partition'])):10s} {run / 3600:5.2f} h | "
              f"{samples / rate:6.3f} | {samples / other if other else float('nan'):6.3f} | {floor * unit:6.3f}")


def limits(config, trace, result, g) -> None:
    """Where ReCycle+'s goodput goes on the paper-shaped trace, and what this cost model allows at best."""
    ff_period = fault_free_period(config)
    bounds: dict = {}

    def achievable(key, options: PlannerOptions = PlannerOptions()) -> float:
        """The best period any plan reaches for `key` over every layer partition (whole layers, whole
        micro-batches, or with `SPLIT` pieces down to one sample: `partition_bound`), never below the fault-free
        plan's (as ReCycle+'s own periods)."""
        if not any(key):
            return ff_period
        if (key, options) not in bounds:
            bounds[key, options] = partition_bound(config, key, options)
        return max(ff_period, bounds[key, options].bound)

    # The same replay with the best achievable period in every failure state, then with the ideal
    # live-proportional period (no bubble, no whole-layer or whole-micro-batch granularity).
    best = run_job(config, trace, systems=["recycle"], setup=JobSetup(reference="planner"),
                   period_fn=achievable, period_label="best achievable").runs["recycle"].goodput
    best_split = run_job(config, trace, systems=["recycle"], setup=JobSetup(reference="planner"),
                         period_fn=lambda key: achievable(key, SPLIT),
                         period_label="best achievable, pieces").runs["recycle"].goodput
    ideal = run_job(config, trace, systems=["recycle"], setup=JobSetup(reference="planner"),
                    period_fn=lambda key: ideal_period(config, key) if any(key) else ff_period,
                    period_label="ideal live-proportional").runs["recycle"].goodput
    exact = sum(b.exact for (_, o), b in bounds.items() if o == PlannerOptions())
    whole_states = sum(o == PlannerOptions() for _, o in bounds)
    print("   upper bounds, the same replay with in every failure state the period of ...")
    print(f"     the best partition's lower bound (every partition searched, exact in {exact} of {whole_states} "
          f"states: no plan of whole layers and whole micro-batches is faster): goodput {best:.2%} = "
          f"{best / g['oobleck']:.3f}x Oobleck-like")
    split_exact = sum(b.exact for (_, o), b in bounds.items() if o == SPLIT)
    print(f"     the same with micro-batches cut into pieces down to one sample (exact in {split_exact} of "
          f"{len(bounds) - whole_states} states): goodput {best_split:.2%} = {best_split / g['oobleck']:.3f}x "
          "Oobleck-like")
    print(f"     the ideal live-proportional period (no bubble, layers and micro-batches split at will): goodput "
          f"{ideal:.2%} = {ideal / g['oobleck']:.3f}x Oobleck-like")
    zero = (0,) * config.num_stages
    print(f"     (the fault-free plan itself: period {ff_period * result.context.seconds_per_unit:.3f} s, ideal "
          f"{ideal_period(config, zero) * result.context.seconds_per_unit:.3f}"
          f" s, ratio {ff_period / ideal_period(config, zero):.3f})")
    lost = result.runs["recycle-plus"].lost_s
    oob = result.runs["oobleck"].lost_s
    end = result.timeline.end_s
    print(f"\n   time lost (fault-free-equivalent s of {end:.0f} s), ReCycle+ {sum(lost.values()):.0f} | Oobleck-like "
          f"{sum(oob.values()):.0f}; 1.05x Oobleck-like allows {(1 - 1.05 * g['oobleck']) * end:.0f}:")
    for cause in sorted(set(lost) | set(oob), key=lambda c: -max(lost.get(c, 0.0), oob.get(c, 0.0))):
        if lost.get(cause, 0) > 0 or oob.get(cause, 0) > 0:
            print(f"     {cause:22s} {lost.get(cause, 0.0):7.0f} | {oob.get(cause, 0.0):7.0f}")
    ff_rate, unit = result.fault_free_rate, result.context.seconds_per_unit
    samples = config.num_replicas * config.num_microbatches * config.workload.microbatch_size
    print("\n   per state ReCycle+ ran in, by time (periods in s): running h | ReCycle+ period | best achievable"
          " | ideal || fault-free-equivalent s lost: in all, above best achievable, above ideal")
    totals = [0.0, 0.0, 0.0]
    for state in result.extra["recycle_plus_states"]:
        key, run, rate = tuple(state["key"]), state["running_s"], state["rate"]
        if run < 1 or rate <= 0:
            continue
        floor, perfect = achievable(key) * unit, (ideal_period(config, key) if any(key) else ff_period) * unit
        lost = (run * (1 - rate / ff_rate), run * (samples / floor - rate) / ff_rate,
                run * (samples / perfect - rate) / ff_rate)
        totals = [a + b for a, b in zip(totals, lost)]
        print(f"   key {str(key):14s} layers {'/'.join(map(str, state['partition'])):10s} {run / 3600:5.2f} h | "
              f"{samples / rate:6.3f} | {floor:6.3f} | {perfect:6.3f} || {lost[0]:5.0f} {lost[1]:5.0f} {lost[2]:5.0f}")
    print(f"   {'all states':45s} || {totals[0]:5.0f} {totals[1]:5.0f} {totals[2]:5.0f}  (of {end:.0f} s)")
    print("\n   per failure state planned (periods in s): re-routing alone | re-partitioned | ideal live-proportional")
    for p in result.extra["partitions"]:
        print(f"   key {str(tuple(p['key'])):14s} layers {'/'.join(map(str, p['partition'])):10s} "
              f"{p['configured_period'] / 1e6:7.3f} | {p['period'] / 1e6:7.3f} | {p['ideal_period'] / 1e6:7.3f}"
              f"   re-partitioned / ideal {p['period'] / p['ideal_period']:.3f}")


def traces(config, synthetic: int, names: list[str], references: list[str]) -> None:
    found: list[tuple[str, object]] = []
    folder = find_traces_dir(ROOT)
    if folder is not None:
        found += [(path.stem, read_trace(path)) for path in sorted(folder.glob("*.csv"))]
    else:
        print("no ../shared/data/traces beside the checkout: synthetic traces only", file=sys.stderr)
    for seed in range(synthetic):
        spec = f"poisson:nodes=30,hours=48,mtbf_h=12,repair_h=4,seed={seed}"
        found.append((f"spot-poisson-seed{seed}", parse_generate_spec(spec)))
    if names:
        unknown = sorted(set(names) - {n for n, _ in found})
        if unknown:
            raise SystemExit(f"error: --traces {' '.join(unknown)}: not among {[n for n, _ in found]}; pass those "
                             "names")
        found = [(n, t) for n, t in found if n in names]
    print(f"\n== every shipped trace and {synthetic} synthetic ones (job sized to the trace: --replicas auto); goodput")
    print(f"   {'trace':<24} {'ref':>7} {'D':>2} | {'ReCycle':>8} {'ReCycle+':>8} {'+/ReC':>6} | {'best baseline':>13} "
          f"{'+/best':>6} | {'+split':>8} {'/best':>6} {'/+':>6}")
    worst = float("inf")
    for name, trace in found:
        for reference in references:
            result = run_job(config, trace, setup=JobSetup(replicas="auto", reference=reference))
            cut = run_job(config, trace, systems=["recycle-plus"], setup=JobSetup(replicas="auto", reference=reference),
                          split_microbatches=True).runs["recycle-plus"].goodput
            g = {n: r.goodput for n, r in result.runs.items()}
            best_name = max(BASELINES, key=lambda b: g[b])
            ratio = g["recycle-plus"] / g["recycle"] if g["recycle"] > 0 else float("nan")
            worst = min(worst, ratio)
            print(f"   {name:<24} {reference:>7} {result.context.config.num_replicas:>2} | {g['recycle']:8.4f} "
                  f"{g['recycle-plus']:8.4f} {ratio:6.3f} | {g[best_name]:8.4f} {best_name[:5]:>4} "
                  f"{g['recycle-plus'] / g[best_name]:6.3f} | {cut:8.4f} {cut / g[best_name]:6.3f} "
                  f"{cut / g['recycle-plus']:6.4f}", flush=True)
    print(f"   worst ReCycle+ / ReCycle over these runs: {worst:.3f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "gpt3-6.7b-a100.toml"))
    parser.add_argument("--synthetic", type=int, default=2, help="synthetic spot traces (Poisson, seeds 0..N-1)")
    parser.add_argument("--quick", action="store_true", help="the paper-shaped trace only")
    parser.add_argument("--no-paper", action="store_true", help="skip the paper-shaped trace")
    parser.add_argument("--traces", nargs="+", default=[], metavar="NAME",
                        help="only these traces of the table (file stems, e.g. bamboo-ec2-p3, or spot-poisson-seed0)")
    parser.add_argument("--references", nargs="+", choices=("planner", "1f1b"), default=["planner", "1f1b"],
                        help="the references to replay under (default both; planner is the strict one)")
    args = parser.parse_args(argv)
    config = load_config(args.config)
    began = time.perf_counter()
    if not args.no_paper:
        for reference in args.references:
            paper(config, reference)
    if not args.quick:
        traces(config, args.synthetic, args.traces, ["1f1b", "planner"] if args.references == ["planner", "1f1b"]
               else args.references)
    print(f"\n{time.perf_counter() - began:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
