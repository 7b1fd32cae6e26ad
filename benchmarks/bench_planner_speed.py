"""Planner speed: heuristic and make_plan at 512 and 1,024 workers, CLI start-up, a D=6/S=4/f=3 store build, lookups.

Run: nice -n 15 .venv/bin/python benchmarks/bench_planner_speed.py [--repeats 3] [--skip-1024]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recycle.config import Config, load_config, uniform_config
from recycle.ir.validate import validate_plan
from recycle.planner.api import baseline_1f1b_period, clear_cache, make_plan
from recycle.planner.bounds import period_lower_bound
from recycle.planner.failures import normalize
from recycle.planner.heuristic import SIMULATE_ALL_LIMIT
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


def bench_large(D: int, S: int, M: int, failed_stages: tuple[int, ...], repeats: int) -> None:
    config = uniform_config(D, S, M, optimizer=3.0, name=f"uniform-{D}x{S}x{M}")
    key = tuple(1 if s in failed_stages else 0 for s in range(S))
    # Real failures for make_plan: one per listed stage, each in a different pipeline (not nested: per-stage
    # relabelling), as a random failure set would be.
    failed = [((7 * i + 3) % D, s) for i, s in enumerate(failed_stages)]
    options = PlannerOptions()
    host = balanced_routing(config, key)
    times, list_times, validate_times, make_times = [], [], [], []
    plan = None
    for _ in range(repeats):
        start = time.perf_counter()
        list_schedule(config, key, host, True, True, None, VARIANTS[0])
        list_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        plan = schedule_heuristic(config, key, options)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        validate_plan(plan)
        validate_times.append(time.perf_counter() - start)
        clear_cache()
        start = time.perf_counter()
        make_plan(config, failed, options)
        make_times.append(time.perf_counter() - start)
    assert plan is not None
    start = time.perf_counter()
    result = simulate(plan, config)
    sim_time = time.perf_counter() - start
    bound = period_lower_bound(config, key, options)
    print(f"heuristic D={D} S={S} M={M} ({D * S} workers), {len(failed_stages)} failures {key}: {plan.num_actions} "
          f"actions")
    print(f"  make_plan (real ranks, incl. the simulation for the predicted period): best {min(make_times):.3f} s, "
          f"mean {sum(make_times) / len(make_times):.3f} s over {repeats}")
    print(f"  schedule_heuristic: best {min(times):.3f} s, mean {sum(times) / len(times):.3f} s; of which list "
          f"scheduling {min(list_times):.3f} s (validate_plan, skipped above {SIMULATE_ALL_LIMIT:,} actions, would "
          f"add {min(validate_times):.3f} s)")
    print(f"  simulate for the reported period: {sim_time:.3f} s")
    if D * S <= 512:
        baseline = baseline_1f1b_period(config, options)
        print(f"  period {result.period:g}, lower bound {bound:g} "
              f"(gap {100 * (result.period - bound) / result.period:.1f}%), fault-free 1F1B {baseline:g}")
    else:
        print(f"  period {result.period:g}, lower bound {bound:g} "
              f"(gap {100 * (result.period - bound) / result.period:.1f}%)")


def bench_cli_startup(repeats: int = 5) -> None:
    """`recycle --help` (commands imported lazily) against importing every command module, as start-up used to."""
    def timed(code: str) -> float:
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
            best = min(best, time.perf_counter() - start)
        return best

    lazy = timed("from recycle.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass")
    plan_help = timed("from recycle.cli import main\ntry:\n    main(['plan', '--help'])\nexcept SystemExit:\n    pass")
    eager = timed("from recycle.cli import build_parser\nbuild_parser().format_help()")
    bare = timed("pass")
    print(f"CLI start-up (best of {repeats}, fresh interpreter; bare python {bare:.2f} s): `recycle --help` "
          f"{lazy:.2f} s, `recycle plan --help` {plan_help:.2f} s; importing every command (the old start-up) "
          f"{eager:.2f} s = {eager / lazy:.1f}x `--help`")


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
    parser.add_argument("--skip-1024", action="store_true", help="leave out the D=64, S=16, M=128 case")
    args = parser.parse_args(argv)
    bench_cli_startup()
    bench_toy(20)
    bench_large(32, 16, 64, (1, 5, 9, 14), args.repeats)
    if not args.skip_1024:
        bench_large(64, 16, 128, (1, 3, 5, 7, 9, 11, 13, 15), args.repeats)
    bench_store(args.jobs, args.lookups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
