"""Planner speed: heuristic at D=32/S=16/M=64 with 4 failures, a D=6/S=4/f=3 store build, and store lookup latency."""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

from recycle.config import Config, load_config, uniform_config
from recycle.ir.validate import validate_plan
from recycle.planner.api import baseline_1f1b_period, clear_cache
from recycle.planner.bounds import period_lower_bound
from recycle.planner.failures import normalize
from recycle.planner.heuristic import VARIANTS, list_schedule, schedule_heuristic
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import balanced_routing
from recycle.planner.store import PlanStore, build_store
from recycle.sim.simulator import simulate

ROOT = Path(__file__).resolve().parents[1]
TESTBED = ROOT / "configs" / "gpt3-6.7b-a100.toml"


def bench_toy(repeats: int) -> None:
    config = load_config(ROOT / "configs" / "toy.toml")
    for options in (PlannerOptions(decoupled=False, staggered=False), PlannerOptions()):
        start = time.perf_counter()
        for _ in range(repeats):
            plan = schedule_heuristic(config, (0, 0, 1, 0), options)
        per_plan = (time.perf_counter() - start) / repeats
        print(f"heuristic toy 1:2 failed, decoupled={options.decoupled} staggered={options.staggered}: "
              f"{per_plan * 1e3:.1f} ms per plan (all {len(VARIANTS)} variants), period "
              f"{simulate(plan, config).period:g}")


def bench_large(repeats: int) -> None:
    config = uniform_config(32, 16, 64, optimizer=3.0, name="uniform-32x16x64")
    key = tuple(1 if s in (1, 5, 9, 14) else 0 for s in range(16))
    options = PlannerOptions()
    host = balanced_routing(config, key)
    times, list_times, validate_times = [], [], []
    plan = None
    for _ in range(repeats):
        start = time.perf_counter()
        timed = list_schedule(config, key, host, True, True, None, VARIANTS[0])
        list_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        plan = schedule_heuristic(config, key, options)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        validate_plan(plan)
        validate_times.append(time.perf_counter() - start)
    assert plan is not None
    start = time.perf_counter()
    result = simulate(plan, config)
    sim_time = time.perf_counter() - start
    bound = period_lower_bound(config, key, options)
    baseline = baseline_1f1b_period(config, options)
    print(f"heuristic D=32 S=16 M=64, 4 failures {key}: {plan.num_actions} actions")
    print(f"  schedule_heuristic (list schedule + actions + validate): best {min(times):.3f} s, "
          f"mean {sum(times) / len(times):.3f} s over {repeats}")
    print(f"    of which list scheduling {min(list_times):.3f} s, validate_plan {min(validate_times):.3f} s")
    print(f"  simulate (4 iterations) for the reported period: {sim_time:.3f} s")
    print(f"  period {result.period:g}, lower bound {bound:g} (gap {100 * (result.period - bound) / result.period:.1f}%),"
          f" fault-free 1F1B {baseline:g}")


def testbed_config() -> Config:
    if TESTBED.is_file():
        return load_config(TESTBED)
    return uniform_config(6, 4, 8, optimizer=1.0, name="testbed-uniform-6x4x8")


def bench_store(jobs: int, lookups: int) -> None:
    config = testbed_config()
    with tempfile.TemporaryDirectory() as folder:
        for n in sorted({1, jobs}):
            clear_cache()
            start = time.perf_counter()
            build_store(config, 3, Path(folder) / f"jobs{n}", PlannerOptions(), jobs=n, progress=None)
            print(f"store build {config.name} D={config.num_replicas} S={config.num_stages} "
                  f"M={config.num_microbatches}, f=3 (35 keys), heuristic, --jobs {n}: "
                  f"{time.perf_counter() - start:.2f} s")
        store = PlanStore.load(Path(folder) / "jobs1", config)
        D, S = config.num_replicas, config.num_stages
        rng = random.Random(0)
        workers = [(p, s) for p in range(D) for s in range(S)]
        sets = [rng.sample(workers, rng.randint(0, 3)) for _ in range(1000)]
        sets = [f for f in sets if all(sum(1 for _, st in f if st == s) < D for s in range(S))]
        for f in sets[:50]:
            store.lookup(f)  # warm up
        start = time.perf_counter()
        for i in range(lookups):
            store.lookup(sets[i % len(sets)])
        mean_us = (time.perf_counter() - start) / lookups * 1e6
        start = time.perf_counter()
        for i in range(lookups):
            normalize(sets[i % len(sets)], D, S)
        norm_us = (time.perf_counter() - start) / lookups * 1e6
        print(f"store lookup: mean {mean_us:.1f} us over {lookups} lookups of random sets of 0-3 failures "
              f"(normalize alone {norm_us:.1f} us)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--lookups", type=int, default=10_000)
    args = parser.parse_args(argv)
    bench_toy(20)
    bench_large(args.repeats)
    bench_store(args.jobs, args.lookups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
