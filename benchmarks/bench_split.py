"""Finer than a micro-batch: how often, and by how much, cutting a failed worker's micro-batches into pieces beats
whole micro-batches, on a screen of small shapes, measured side by side in one run.

Screen: D = 3..6, S = 2..4, M in {S, S + S//2, 2S}, every micro-batch of 12 samples, 1 failure (worker 0 at the
middle stage) and 2 failures (that one plus worker 1 at stage 0: two stages lose one replica each), for unit costs
(F = B = W = 1) and for F != B != W (F = 2, B = 3, W = 1); optimizer 1, no communication time, no memory cap. For
each case: the planner's plan with whole micro-batches (`make_plan`, heuristic) and with
PlannerOptions(split_microbatches=True), which keeps a split plan only when the simulator's period is strictly
lower. Gain = whole period / split period - 1 (0 where the whole plan is kept). Columns: cases; uneven: cases where
some stage's survivors carry unequal shares (a split is tried); split kept: the split plan was strictly faster; mean
gain over all cases and over those kept; max gain; the most seconds the split option added to one make_plan.

    PYTHONPATH=src python benchmarks/bench_split.py            # the whole screen (~1-2 min on 2 busy cores)
    PYTHONPATH=src python benchmarks/bench_split.py --quick    # D = 3..4 only
"""

from __future__ import annotations

import argparse
import statistics
import time

from recycle.config import Config, parse_config
from recycle.planner.api import make_plan
from recycle.planner.options import PlannerOptions

COSTS = {"unit": (1, 1, 1), "F!=B!=W": (2, 3, 1)}
SAMPLES = 12


def config_for(D: int, S: int, M: int, costs: tuple[int, int, int]) -> Config:
    F, B, W = costs
    return parse_config({"topology": {"num_replicas": D, "num_stages": S},
                         "workload": {"num_microbatches": M, "microbatch_size": SAMPLES, "seq_len": 8},
                         "costs": {"forward": F, "backward_input": B, "backward_weight": W, "optimizer": 1},
                         "model": {"preset": "tiny"}}, name="split-screen")


def failure_sets(S: int) -> dict[int, frozenset[tuple[int, int]]]:
    one = (0, S // 2)
    return {1: frozenset({one}), 2: frozenset({one, (1, 0)})}


def screen(replicas: range) -> list[dict]:
    rows = []
    for label, costs in COSTS.items():
        for D in replicas:
            for S in range(2, 5):
                for M in sorted({S, S + S // 2, 2 * S}):
                    config = config_for(D, S, M, costs)
                    for count, failed in failure_sets(S).items():
                        whole = make_plan(config, failed, PlannerOptions())
                        started = time.perf_counter()
                        split = make_plan(config, failed, PlannerOptions(split_microbatches=True))
                        seconds = time.perf_counter() - started
                        w, s = whole.meta.predicted_period, split.meta.predicted_period
                        assert w is not None and s is not None and s <= w * (1 + 1e-9)
                        rows.append({"costs": label, "failures": count, "D": D, "S": S, "M": M, "whole": w,
                                     "split": s, "gain": w / s - 1,
                                     "pieces": len(split.pieces) - D * M if split.pieces else 0,
                                     "uneven": "already carry equal shares" not in split.meta.notes,
                                     "seconds": seconds})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="D = 3..4 only")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = screen(range(3, 5) if args.quick else range(3, 7))
    print(f"{'costs':<9}{'failures':>9}{'cases':>7}{'uneven':>8}{'split kept':>12}{'mean gain':>11}"
          f"{'mean gain kept':>16}{'max gain':>10}{'split time s (max)':>20}")

    def line(label: str, failures: str, group: list[dict]) -> None:
        kept = [r for r in group if r["pieces"]]
        gains = [r["gain"] for r in group]
        uneven = sum(r["uneven"] for r in group)
        print(f"{label:<9}{failures:>9}{len(group):>7}{uneven:>8}{len(kept):>12}{100 * statistics.mean(gains):>10.2f}%"
              f"{100 * statistics.mean([r['gain'] for r in kept]) if kept else 0.0:>15.2f}%"
              f"{100 * max(gains):>9.2f}%{max(r['seconds'] for r in group):>20.3f}")

    for label in COSTS:
        for count in (1, 2):
            line(label, str(count), [r for r in rows if r["costs"] == label and r["failures"] == count])
    line("all", "1-2", rows)
    best = max(rows, key=lambda r: r["gain"])
    print(f"best case: {best['costs']} costs, {best['failures']} failure(s), D={best['D']} S={best['S']} "
          f"M={best['M']}: period {best['whole']:g} -> {best['split']:g} ({best['pieces']} extra piece ids)")
    print(f"screen: {len(rows)} cases in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
