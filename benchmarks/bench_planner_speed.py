"""Planner speed: small plans (a seeded screen, make_plan and `recycle plan`), make_plan at 512 and 1,024 workers side
by side (and its parts), CLI start-up, a D=6/S=4/f=3 store build, lookups.

Run: nice -n 15 .venv/bin/python benchmarks/bench_planner_speed.py [--repeats 3] [--skip-1024] [--compare-with COMMIT]
     [--small 100] [--small-seed 0] [--small-draw {small,quality}] [--only-small]
With --compare-with, make_plan as of that commit (its src/ from `git archive`, run in a child interpreter) is timed
in the same run on the same cases, alternating with this tree's runs, and its plans are checked to be
byte-identical to this tree's (large cases) or compared by period and makespan (small plans).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from recycle.config import Config, load_config, uniform_config
from recycle.ir.compact import CompactActions
from recycle.ir.validate import validate_plan
from recycle.planner.api import clear_cache, make_plan
from recycle.planner.bounds import period_lower_bound
from recycle.planner.failures import normalize
from recycle.planner.heuristic import SIMULATE_ALL_LIMIT, VARIANTS, _to_actions, list_schedule, schedule_heuristic
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import failed_routing
from recycle.planner.store import PlanStore, build_store
from recycle.sim import simulator
from recycle.sim.levels import time_compact
from recycle.sim.simulator import simulate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from small_plan_screen import bench_small  # noqa: E402

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


# The child interpreter's program for --compare-with: best-of-N make_plan and the plan's digest, as JSON.
_CHILD = """
import hashlib, json, sys, time
from recycle.config import uniform_config
from recycle.planner.api import make_plan
D, S, M, failed = json.loads(sys.argv[1])
config = uniform_config(D, S, M, optimizer=3.0, name=f"uniform-{D}x{S}x{M}")
wall, cpu = time.perf_counter(), time.process_time()
plan = make_plan(config, [tuple(w) for w in failed])
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"wall": wall, "cpu": cpu, "digest": hashlib.sha256(plan.to_json().encode()).hexdigest()}))
"""


def previous_source(commit: str) -> Path:
    """src/ as of `commit`, unpacked into a temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix="bench-planner-"))
    archive = subprocess.run(["git", "archive", commit, "src"], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder / "src"


def failure_set(D: int, failed_stages: tuple[int, ...]) -> list[tuple[int, int]]:
    """One failure per listed stage, each in a different pipeline (not nested: the traffic-aware routing on the real
    ranks), as a random failure set would be."""
    return [((7 * i + 3) % D, s) for i, s in enumerate(failed_stages)]


def time_in_child(source: Path, D: int, S: int, M: int, failed_stages: tuple[int, ...],
                   plan_json: str) -> tuple[float, float, bool]:
    """One cold make_plan (wall and CPU seconds) in a fresh interpreter with the code under `source` (this tree's
    src/ or an unpacked commit's), and whether its plan is byte-identical to `plan_json`."""
    argument = json.dumps([D, S, M, failure_set(D, failed_stages)])
    env = {**os.environ, "PYTHONPATH": str(source)}
    out = subprocess.run([sys.executable, "-c", _CHILD, argument], env=env, check=True, capture_output=True,
                         text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return result["wall"], result["cpu"], result["digest"] == hashlib.sha256(plan_json.encode()).hexdigest()


def bench_large(D: int, S: int, M: int, failed_stages: tuple[int, ...], repeats: int,
                previous: Path | None = None) -> dict[str, float | str]:
    """make_plan on real ranks and its parts for one shape; best of `repeats` (cold: the plan cache is cleared)."""
    config = uniform_config(D, S, M, optimizer=3.0, name=f"uniform-{D}x{S}x{M}")
    key = tuple(1 if s in failed_stages else 0 for s in range(S))
    failed = failure_set(D, failed_stages)
    options = PlannerOptions()
    host = failed_routing(config, frozenset(failed))
    timings: dict[str, list[float]] = {name: [] for name in ("make_plan", "make_plan_cpu", "child", "child_cpu",
                                                              "previous", "previous_cpu", "list", "build",
                                                              "timing", "materialise", "simulate", "loop",
                                                              "heuristic", "symmetric", "validate")}
    plan = None
    same = True
    for _ in range(repeats):
        clear_cache()
        start, cpu = time.perf_counter(), time.process_time()
        plan = make_plan(config, failed, options)
        timings["make_plan"].append(time.perf_counter() - start)
        timings["make_plan_cpu"].append(time.process_time() - cpu)
        if previous is not None:  # both trees in fresh interpreters, alternating, so both see the same load
            for source, name in ((ROOT / "src", "child"), (previous, "previous")):
                wall, cpu_s, identical = time_in_child(source, D, S, M, failed_stages, plan.to_json())
                timings[name].append(wall)
                timings[f"{name}_cpu"].append(cpu_s)
                same = same and identical
        start = time.perf_counter()
        timed = list_schedule(config, key, host, True, True, None, VARIANTS[0])
        timings["list"].append(time.perf_counter() - start)
        start = time.perf_counter()
        _to_actions(config, timed, host, True, True)
        timings["build"].append(time.perf_counter() - start)
        if isinstance(plan.actions, CompactActions):  # make_plan's own timing of the plan, then a consumer's cost
            start = time.perf_counter()
            time_compact(config, plan.actions, plan.failed, plan.staggered)
            timings["timing"].append(time.perf_counter() - start)
            fresh = CompactActions(plan.actions.bounds, plan.actions.code, plan.actions.stage, plan.actions.mb)
            start = time.perf_counter()
            fresh.rows
            timings["materialise"].append(time.perf_counter() - start)
            plan.actions.rows  # built before the simulator is timed: it reads Action objects
        start = time.perf_counter()
        result = simulate(plan, config)
        timings["simulate"].append(time.perf_counter() - start)
        start = time.perf_counter()
        schedule_heuristic(config, key, options)
        timings["heuristic"].append(time.perf_counter() - start)
        clear_cache()
        start = time.perf_counter()
        make_plan(config, [(3, 5)], options)  # one failure: the canonical plan renamed onto the real ranks
        timings["symmetric"].append(time.perf_counter() - start)
    assert plan is not None
    start = time.perf_counter()
    validate_plan(plan)
    timings["validate"].append(time.perf_counter() - start)
    # The simulator's per-action loop on the same plan, for the level timer's speed-up (same numbers, checked).
    saved = simulator.LEVEL_TIMER_MIN_ACTIONS
    simulator.LEVEL_TIMER_MIN_ACTIONS = 1 << 60
    try:
        start = time.perf_counter()
        looped = simulate(plan, config)
        timings["loop"].append(time.perf_counter() - start)
    finally:
        simulator.LEVEL_TIMER_MIN_ACTIONS = saved
    assert looped == result, "the level timer and the per-action loop disagree"
    bound = period_lower_bound(config, key, options)
    best: dict[str, float | str] = {name: min(values) for name, values in timings.items() if values}
    if previous is not None:
        best["identical"] = "yes" if same else "NO"
    return {**best, "shape": f"D={D} S={S} M={M}", "workers": f"{D * S:,}", "failures": str(len(failed)),
            "actions": f"{plan.num_actions:,}", "period": f"{result.period:g} (bound {bound:g})"}


def print_large(rows: list[dict[str, float | str]], repeats: int) -> None:
    """One column per shape, measured in this run."""
    lines = [("shape", "shape", ""), ("workers", "workers", ""), ("failures", "failures (one per pipeline)", ""),
             ("actions", "actions per iteration", ""),
             ("make_plan", "make_plan (real ranks, incl. simulation)", "s"),
             ("make_plan_cpu", "  its CPU time (process)", "s"),
             ("list", "  list scheduling (the one rule used)", "s"),
             ("build", "  building action lists (compact arrays)", "s"),
             ("timing", "  period from the arrays (levels.time_compact)", "s"),
             ("materialise", "Action objects, built on first read", "s"),
             ("simulate", "simulate(plan) (Action objects already built)", "s"),
             ("heuristic", "schedule_heuristic (canonical key)", "s"),
             ("symmetric", "make_plan, one failure (canonical plan renamed)", "s"),
             ("loop", "simulation, per-action loop (reference)", "s"),
             ("ratio", "  loop / level timer", "x"),
             ("validate", f"validate_plan (skipped above {SIMULATE_ALL_LIMIT:,} actions)", "s"),
             ("period", "period", "")]
    if "previous" in rows[0]:
        lines[6:6] = [("child", "  make_plan in a fresh interpreter, this tree", "s"),
                      ("child_cpu", "    its CPU time", "s"),
                      ("previous", "  the same at the --compare-with commit", "s"),
                      ("previous_cpu", "    its CPU time", "s"),
                      ("speedup", "  speed-up (that commit / this tree), wall", "x"),
                      ("speedup_cpu", "  speed-up, CPU time", "x"),
                      ("identical", "  plans byte-identical", "")]
    print(f"planner at scale, best of {repeats} (cold: plan cache cleared each time; CPU time is less disturbed by "
          "other processes than wall time on a shared machine)")
    for name, label, unit in lines:
        cells = []
        for row in rows:
            if name == "ratio":
                value: float | str = float(row["loop"]) / float(row["simulate"])
            elif name == "speedup":
                value = float(row["previous"]) / float(row["child"])
            elif name == "speedup_cpu":
                value = float(row["previous_cpu"]) / float(row["child_cpu"])
            else:
                value = row.get(name, "n/a")  # "timing"/"materialise": only for compact plans
            if value == "n/a":
                cells.append("n/a")
            elif unit == "s":
                cells.append(f"{float(value):.3f} s")
            elif unit == "x":
                cells.append(f"{float(value):.1f}x")
            else:
                cells.append(str(value))
        print(f"  {label:<48}" + "".join(f"{c:>22}" for c in cells))


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


def bench_crossover() -> None:
    """The Python list scheduler against the numpy one on uniform shapes (one failure, the first rule), by actions
    per estimated event time: where `vector_eligible`'s MIN_ACTIONS_PER_STEP comes from."""
    from recycle.planner import heuristic
    from recycle.planner.vector_schedule import MIN_ACTIONS_PER_STEP

    print(f"list scheduler crossover (best of 3, CPU; numpy used from {MIN_ACTIONS_PER_STEP} actions per step):")
    for D, S, M in ((6, 4, 48), (8, 8, 16), (16, 8, 32), (32, 8, 32)):
        config = uniform_config(D, S, M, optimizer=3.0)
        host = failed_routing(config, frozenset({(1, 1)}))
        setting = heuristic._setting(config, host, True, None, VARIANTS[0])
        steps = max(load * sum(setting.dur[s]) for s, row in enumerate(setting.loads) for load in row) + sum(
            f + b + 2 * m for (f, b, _), m in zip(setting.dur, setting.p2p))

        def best(run) -> float:
            times = []
            for _ in range(3):
                start = time.process_time()
                run()
                times.append(time.process_time() - start)
            return min(times)

        numpy_s = best(lambda: heuristic._vector_schedule(setting, host))
        python_s = best(lambda: heuristic._event_loop(setting, host, heuristic._item_maker(setting, host, None),
                                                      None))
        actions = 3 * D * S * M
        print(f"  D={D} S={S} M={M}: {actions:,} actions, {actions / steps:.0f} per estimated step: Python "
              f"{python_s * 1e3:.1f} ms, numpy {numpy_s * 1e3:.1f} ms ({python_s / numpy_s:.2f}x)")


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
    parser.add_argument("--compare-with", metavar="COMMIT", help="also time make_plan as of this git commit")
    parser.add_argument("--small", type=int, default=100, metavar="N",
                        help="cases of the small-plan screen (<= 500 actions; 0: skip it)")
    parser.add_argument("--small-seed", type=int, default=0, help="seed of the small-plan screen")
    parser.add_argument("--small-draw", choices=("small", "quality"), default="small",
                        help="small: D 2-8, S 2-8, F != B != W (default); quality: bench_planner_quality.py's cases")
    parser.add_argument("--only-small", action="store_true", help="run the small-plan screen only")
    args = parser.parse_args(argv)
    previous = previous_source(args.compare_with) if args.compare_with else None
    if args.small:
        bench_small(args.small, args.small_seed, ROOT / "src", previous, args.small_draw)
    if args.only_small:
        return 0
    bench_cli_startup()
    bench_toy(20)
    bench_crossover()
    rows = [bench_large(32, 16, 64, (1, 5, 9, 14), args.repeats, previous)]
    if not args.skip_1024:
        rows.append(bench_large(64, 16, 128, (1, 3, 5, 7, 9, 11, 13, 15), args.repeats, previous))
    print_large(rows, args.repeats)
    bench_store(args.jobs, args.lookups)
    return 0


if __name__ == "__main__":
    sys.exit(main())
