"""Small-plan screen for bench_planner_speed.py: seeded small cases timed in make_plan and `recycle plan`, side by side.

Every case draws D 2-8, S 2-8, M S/2..4S with at most 500 actions per iteration, distinct F, B input and W costs
(1-4), optimizer 0/1/3, p2p 0 or 0.5, 1-3 random failures (each stage keeps a live replica; nested or not),
decoupled 75 %, staggered 60 %. Each tree (this one and, with --compare-with, an older commit) plans every case
cold in its own long-lived child interpreter, the two alternating case by case so both see the same load; then the
slowest cases are also timed as `recycle plan` commands (a fresh interpreter each: what a user waits for).
"""

from __future__ import annotations

import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["draw_small_case", "quality_cases", "bench_small"]

MAX_ACTIONS = 500
CLI_CASES = 10  # the slowest cases (either tree) also timed as `recycle plan`

# The child: one JSON case per input line -> one JSON result per output line (cold: plan cache cleared).
_CHILD = """
import json, sys, time
from recycle.config import parse_config
from recycle.planner.api import clear_cache, make_plan
from recycle.planner.options import PlannerOptions
for line in sys.stdin:
    case = json.loads(line)
    config = parse_config(case["raw"], name="small-screen")
    options = PlannerOptions(decoupled=case["decoupled"], staggered=case["staggered"])
    clear_cache()
    wall, cpu = time.perf_counter(), time.process_time()
    plan = make_plan(config, [tuple(w) for w in case["failed"]], options)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    meta = plan.meta
    print(json.dumps({"wall": wall, "cpu": cpu, "period": meta.predicted_period, "makespan": meta.predicted_makespan,
                      "bound": meta.lower_bound, "fallback": getattr(meta, "routing_fallback", "")}), flush=True)
"""


def draw_small_case(rng: random.Random) -> dict[str, Any]:
    """One random small case: {"raw": config tables, "failed": [[replica, stage], ...], "decoupled", "staggered"}."""
    while True:
        D, S = rng.randint(2, 8), rng.randint(2, 8)
        M = rng.randint(max(1, S // 2), 4 * S)
        decoupled = rng.random() < 0.75
        if D * S * M * (3 if decoupled else 2) <= MAX_ACTIONS:  # compute_actions
            break
    forward, backward_input, backward_weight = rng.sample([1, 2, 3, 4], 3)
    workers = [(p, s) for p in range(D) for s in range(S)]
    while True:
        failed = sorted(rng.sample(workers, rng.randint(1, min(3, D * S - S))))
        if all(sum(1 for _, s in failed if s == st) < D for st in range(S)):
            break
    raw = {"topology": {"num_replicas": D, "num_stages": S}, "workload": {"num_microbatches": M},
           "costs": {"forward": forward, "backward_input": backward_input, "backward_weight": backward_weight,
                     "optimizer": rng.choice((0, 1, 3))},
           "communication": {"p2p_latency": rng.choice((0.0, 0.0, 0.5))}}
    return {"raw": raw, "failed": [list(w) for w in failed], "decoupled": decoupled,
            "staggered": rng.random() < 0.6}


def quality_cases(count: int, seed: int) -> list[dict[str, Any]]:
    """bench_planner_quality.py's screen (D 2-6, S 2-4, at most 480 actions) in this module's case format."""
    from bench_planner_quality import draw_cases

    cases = []
    for case in draw_cases(count, seed):
        raw = {"topology": {"num_replicas": case.D, "num_stages": case.S},
               "workload": {"num_microbatches": case.M},
               "costs": {"forward": case.forward, "backward_input": case.backward_input,
                         "backward_weight": case.backward_weight, "optimizer": case.optimizer},
               "communication": {"p2p_latency": case.p2p}}
        cases.append({"raw": raw, "failed": [list(w) for w in case.failed], "decoupled": case.options.decoupled,
                      "staggered": case.options.staggered})
    return cases


def compute_actions(case: dict[str, Any]) -> int:
    """F, B and W (or F and BW) actions per iteration: the size the <= 500 limit is about (OPT steps not counted)."""
    raw = case["raw"]
    return (raw["topology"]["num_replicas"] * raw["topology"]["num_stages"] * raw["workload"]["num_microbatches"]
            * (3 if case["decoupled"] else 2))


def describe(case: dict[str, Any]) -> str:
    raw = case["raw"]
    c = raw["costs"]
    return (f"D={raw['topology']['num_replicas']} S={raw['topology']['num_stages']} "
            f"M={raw['workload']['num_microbatches']} F={c['forward']} B={c['backward_input']} "
            f"W={c['backward_weight']} opt={c['optimizer']} p2p={raw['communication']['p2p_latency']:g} "
            f"{'dec' if case['decoupled'] else 'fused'}+{'stag' if case['staggered'] else 'cpl'} fail "
            + " ".join(f"{p}:{s}" for p, s in case["failed"]))


def _toml(raw: dict[str, Any]) -> str:
    lines = ['name = "small-screen"']
    for table, values in raw.items():
        lines.append(f"[{table}]")
        lines += [f"{k} = {v}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


class _Child:
    """A long-lived interpreter that plans cases with the code under `source`."""

    def __init__(self, source: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(source)}
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)

    def plan(self, case: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the planning child for {describe(case)} exited (code {self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _cli_seconds(source: Path, case: dict[str, Any], folder: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of `recycle plan` for a case in a fresh interpreter with the code under `source`."""
    config = folder / "case.toml"
    config.write_text(_toml(case["raw"]))
    argv = [sys.executable, "-m", "recycle", "plan", "--config", str(config)]
    argv += [a for p, s in case["failed"] for a in ("--fail", f"{p}:{s}")]
    argv += [] if case["decoupled"] else ["--no-decouple"]
    argv += [] if case["staggered"] else ["--no-stagger"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, env={**os.environ, "PYTHONPATH": str(source)}, check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def bench_small(count: int, seed: int, source: Path, previous: Path | None, draw: str = "small") -> None:
    """Plan `count` seeded small cases (`draw`: "small", this module's, or "quality", bench_planner_quality.py's)
    with this tree (and `previous`), print times, the slowest cases and the period / makespan change."""
    rng = random.Random(seed)
    cases = quality_cases(count, seed) if draw == "quality" else [draw_small_case(rng) for _ in range(count)]
    trees = {"this tree": _Child(source)}
    if previous is not None:
        trees["previous"] = _Child(previous)
    warm_up = cases[0]
    for child in trees.values():
        child.plan(warm_up)  # imports out of the way: cases are timed in a warm interpreter
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for case in cases:
        for name, child in trees.items():
            results[name].append(child.plan(case))
    for child in trees.values():
        child.close()
    names = list(trees)
    load = os.getloadavg()[0]
    screen = "bench_planner_quality.py's screen" if draw == "quality" else "F != B != W, 1-3 failures"
    print(f"small plans: {count} seeded cases (seed {seed}, <= {MAX_ACTIONS} actions, {screen}), "
          "make_plan cold in a warm interpreter" + (", the two trees alternating" if previous else "")
          + f"; load average {load:.1f} on {os.cpu_count()} CPUs (CPU time is the steadier measure)")
    for name in names:
        for unit in ("wall", "cpu"):
            values = [r[unit] for r in results[name]]
            over = sum(1 for v in values if v > 0.3)
            print(f"  {name:<10} {unit:<4} mean {statistics.mean(values):.3f} s, p90 {_quantile(values, 0.9):.3f} s, "
                  f"max {max(values):.3f} s; {over} of {count} over 0.3 s")
    fallbacks = [i for i, r in enumerate(results["this tree"]) if r["fallback"]]
    print(f"  this tree fell back to canonical routing on {len(fallbacks)} of {count} cases"
          + (f" (#{', #'.join(map(str, fallbacks[:10]))})" if fallbacks else ""))
    slowest = sorted(range(count), key=lambda i: -max(r[i]["wall"] for r in results.values()))[:CLI_CASES]
    header = "  ".join(f"{n + ' make_plan wall/CPU':>27}{n + ' CLI wall/CPU':>25}{n + ' period':>18}" for n in names)
    print(f"  the {len(slowest)} slowest (make_plan wall time, either tree), also as `recycle plan` in a fresh "
          "interpreter:")
    print(f"    {'case':<4}{'actions':>8}  {header}  shape")
    with tempfile.TemporaryDirectory() as folder:
        sources = {"this tree": source, "previous": previous}
        cli_cpu: dict[str, list[float]] = {name: [] for name in names}
        for i in slowest:
            cells = []
            for name in names:
                r = results[name][i]
                wall, cpu = _cli_seconds(sources[name], cases[i], Path(folder))  # type: ignore[arg-type]
                cli_cpu[name].append(cpu)
                cells.append(f"{r['wall']:>18.3f}/{r['cpu']:.3f} s{wall:>16.3f}/{cpu:.3f} s{r['period']:>18g}")
            print(f"    #{i:<3}{compute_actions(cases[i]):>8}  {'  '.join(cells)}  {describe(cases[i])}")
    print("  `recycle plan` CPU over those cases, max: " + ", ".join(f"{n} {max(v):.3f} s" for n, v in cli_cpu.items()))
    if previous is None:
        return
    for metric in ("period", "makespan"):
        change = [(new[metric] - old[metric]) / old[metric]
                  for new, old in zip(results["this tree"], results["previous"])]
        worse = [c for c in change if c > 1e-9]
        better = [c for c in change if c < -1e-9]
        print(f"  {metric}: this tree vs previous over {count} cases: {len(worse)} worse (max "
              f"{100 * max(worse, default=0.0):+.2f} %), {len(better)} better (best "
              f"{100 * min(better, default=0.0):+.2f} %), mean change {100 * statistics.mean(change):+.3f} %")
    at_bound = [sum(1 for r in results[n] if r["period"] <= r["bound"] * (1 + 1e-9)) for n in names]
    print("  at the lower bound: " + ", ".join(f"{n} {k} of {count}" for n, k in zip(names, at_bound)))
