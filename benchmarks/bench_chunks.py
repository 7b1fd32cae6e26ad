"""Two chunks per worker: the planner's V-shape / interleaved plans against torch's two-chunk schedules at equal memory.

Run: nice -n 10 .venv/bin/python benchmarks/bench_chunks.py [--quick] [--failures-only | --no-failures]

Fault-free: for S = 2..8 and M = S, 2S, 3S, 4S, with unit costs (F = B = W = 1 per stage) and with F = 2, B = 3,
W = 1, torch.distributed.pipelining's ScheduleZBVZeroBubble, ScheduleDualPipeV, ScheduleInterleavedZeroBubble and
ScheduleInterleaved1F1B (two stages per rank) are built without processes (their `pipeline_order` tables,
recycle.schedules.torch_chunks) and turned into our plans; every plan, torch's and ours, is timed by the same
simulator (recycle.sim.simulate, coupled optimizer of cost 0, the way torch steps after the schedule; the period is
then one iteration's makespan). A chunk costs 1/2 of its worker's stage. Torch's best schedule (lowest period, then
lowest peak) sets the memory: our chunked planner gets a cap of exactly its peak, in chunk activations (F start ..
W end, per worker), in both layouts; "ours" is the better of the two. Also shown: ours with the staggered optimizer
at the same cap, and the one-chunk planner (one stage per worker) at the same memory (floor(peak / 2) full-stage
activations), which is what recycle offered before chunks. Then interleaved 1F1B alone (fused backward): ours in the
interleaved layout with --no-decouple against torch's ScheduleInterleaved1F1B at its peak.

After failures (D x S = 4x4, 4x8, 3x5, 3x6, M = S and 2S, one and two failed workers, a cap of S full-stage
activations per worker, ZB-H1's and ZBV's peak): the chunked V-shape plan against the one-chunk plan for the same
failure set, both from `make_plan`, same options (decoupled; coupled and staggered optimizer), same simulator.

Every ratio is ours / theirs (below 1: ours is faster).
"""

from __future__ import annotations

import argparse
import sys
import time

from recycle.config import Config, parse_config
from recycle.planner.api import clear_cache, make_plan
from recycle.planner.chunked import schedule_chunked
from recycle.planner.options import PlannerOptions
from recycle.schedules.torch_chunks import TORCH_CHUNK_SCHEDULES, torch_chunk_plan
from recycle.sim.simulator import simulate

COSTS = {"unit": (1.0, 1.0, 1.0), "F2/B3/W1": (2.0, 3.0, 1.0)}


def config(D: int, S: int, M: int, costs: tuple[float, float, float], chunks: int = 2, layout: str = "v") -> Config:
    f, b, w = costs
    return parse_config({"topology": {"num_replicas": D, "num_stages": S, "chunks_per_worker": chunks,
                                      "chunk_layout": layout if chunks > 1 else "interleaved"},
                         "workload": {"num_microbatches": M},
                         "costs": {"forward": f, "backward_input": b, "backward_weight": w, "optimizer": 0.0}})


def torch_best(S: int, M: int, costs: tuple[float, float, float]) -> tuple[str, float, int, dict[str, str]]:
    """(name, period, peak chunk activations) of torch's best two-chunk schedule (names joined by "=" when several
    tie on period and peak), and why the others are missing."""
    best: tuple[float, int, str] | None = None
    missing: dict[str, str] = {}
    for name, (_, layout) in TORCH_CHUNK_SCHEDULES.items():
        cfg = config(1, S, M, costs, 2, layout)
        try:
            plan = torch_chunk_plan(cfg, name)
        except Exception as exc:  # torch refuses some shapes (e.g. M < 2S for ZBV); say which and why
            missing[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:70]}"
            continue
        result = simulate(plan, cfg)
        key = (result.period, max(result.peak_activations), name)
        if best is not None and key[:2] == best[:2]:
            best = (best[0], best[1], f"{best[2]}={name}")
        elif best is None or key < best:
            best = key
    assert best is not None
    return best[2], best[0], best[1], missing


def ours(S: int, M: int, costs: tuple[float, float, float], cap: int, staggered: bool) -> tuple[float, int, str]:
    """The chunked planner's best layout at a cap of `cap` chunk activations per worker: (period, peak, layout)."""
    best: tuple[float, int, str] | None = None
    for layout in ("v", "interleaved"):
        cfg = config(1, S, M, costs, 2, layout)
        plan = schedule_chunked(cfg, (), PlannerOptions(staggered=staggered), caps=(cap,) * S)
        result = simulate(plan, cfg)
        key = (result.period, max(result.peak_activations), layout)
        if best is None or key < best:
            best = key
    assert best is not None
    return best


def one_chunk(S: int, M: int, costs: tuple[float, float, float], cap: int) -> float:
    cfg = config(1, S, M, costs, 1)
    return simulate(make_plan(cfg, (), PlannerOptions(staggered=False, memory_cap=(cap,) * S)), cfg).period


def fault_free(quick: bool) -> bool:
    print("Fault-free, one pipeline, equal memory (cap = torch's best schedule's peak, chunk activations per worker)")
    print(f"{'costs':<9}{'S':>3}{'M':>4}  {'torch best (ties: =)':<31}{'period':>8}{'peak':>5}  {'ours':>8}{'peak':>5}"
          f"{' layout':<13}{'ours/torch':>11}  {'staggered':>9}{'ratio':>7}  {'1-chunk':>8}{'ratio':>7}")
    ratios = []
    wins = 0
    for label, costs in COSTS.items():
        for S in (range(2, 9) if not quick else (2, 4, 8)):
            for M in sorted({S, 2 * S, 3 * S, 4 * S}):
                name, period, peak, _ = torch_best(S, M, costs)
                mine, mine_peak, layout = ours(S, M, costs, peak, staggered=False)
                stag, _, _ = ours(S, M, costs, peak, staggered=True)
                single = one_chunk(S, M, costs, max(1, peak // 2))
                ratio = mine / period
                ratios.append(ratio)
                wins += mine <= period + 1e-9
                print(f"{label:<9}{S:>3}{M:>4}  {name:<31}{period:>8g}{peak:>5}  {mine:>8g}{mine_peak:>5} "
                      f"{layout:<12}{ratio:>11.3f}  {stag:>9g}{stag / period:>7.3f}  {single:>8g}"
                      f"{single / period:>7.3f}", flush=True)
    print(f"ours <= torch's best on {wins} of {len(ratios)} shapes; ours/torch min {min(ratios):.3f}, "
          f"mean {sum(ratios) / len(ratios):.3f}, max {max(ratios):.3f}")
    _, _, _, missing = torch_best(4, 4, COSTS["unit"])
    for name, why in missing.items():
        print(f"  torch's {name} at M = S = 4: {why}")
    return wins == len(ratios)


# (D, S, failure sets); the second group's shapes and failures were not in the sweep that chose the planner's
# rules for failures (planner/chunked.py, FAILURE_VARIANTS), the first group's D x S were
def interleaved_1f1b(quick: bool) -> bool:
    """Fused backward (no B/W split): ours with the interleaved layout against torch's ScheduleInterleaved1F1B."""
    print("\nInterleaved 1F1B (fused backward), one pipeline, our cap = torch's ScheduleInterleaved1F1B's peak")
    print(f"{'costs':<9}{'S':>3}{'M':>4}  {'torch':>8}{'peak':>5}  {'ours':>8}{'peak':>5}{'ours/torch':>11}")
    ratios = []
    for label, costs in COSTS.items():
        for S in (range(2, 9) if not quick else (2, 4, 8)):
            for M in sorted({S, 2 * S, 3 * S, 4 * S}):
                cfg = config(1, S, M, costs, 2, "interleaved")
                theirs = simulate(torch_chunk_plan(cfg, "interleaved-1f1b"), cfg)
                peak = max(theirs.peak_activations)
                plan = schedule_chunked(cfg, (), PlannerOptions(decoupled=False, staggered=False), caps=(peak,) * S)
                mine = simulate(plan, cfg)
                ratios.append(mine.period / theirs.period)
                print(f"{label:<9}{S:>3}{M:>4}  {theirs.period:>8g}{peak:>5}  {mine.period:>8g}"
                      f"{max(mine.peak_activations):>5}{ratios[-1]:>11.3f}", flush=True)
    wins = sum(r <= 1 + 1e-9 for r in ratios)
    print(f"ours <= torch's interleaved 1F1B on {wins} of {len(ratios)} shapes; ours/torch min {min(ratios):.3f}, "
          f"max {max(ratios):.3f}")
    return wins == len(ratios)


FAILURES = [(4, 4, ([(1, 1)], [(1, 1), (2, 0)])), (4, 8, ([(1, 1)], [(1, 1), (2, 0)])),
            (3, 5, ([(2, 3)], [(0, 0), (1, 4)])), (3, 6, ([(1, 5)], [(0, 2), (2, 3)]))]


def after_failures(quick: bool) -> None:
    print("\nAfter failures, cap S full-stage activations per worker (chunked: 2S chunk activations; peaks below in "
          "full-stage activations)")
    print(f"{'costs':<9}{'D':>3}{'S':>3}{'M':>4}{'failed':>14}  {'optimizer':<10}{'one chunk':>10}{'chunked v':>10}"
          f"{'ratio':>7}{'peak 1c':>8}{'peak v':>7}")
    ratios = []
    for label, costs in COSTS.items():
        for D, S, sets in (FAILURES if not quick else FAILURES[:1]):
            for M in (S, 2 * S):
                for failed in sets:
                    for staggered in (False, True):
                        clear_cache()
                        options = PlannerOptions(staggered=staggered, memory_cap=(S,) * S)
                        c1, c2 = config(D, S, M, costs, 1), config(D, S, M, costs, 2, "v")
                        p1, p2 = make_plan(c1, failed, options), make_plan(c2, failed, options)
                        r1, r2 = simulate(p1, c1), simulate(p2, c2)
                        text = " ".join(f"{p}:{s}" for p, s in failed)
                        ratios.append(r2.period / r1.period)
                        print(f"{label:<9}{D:>3}{S:>3}{M:>4}{text:>14}  {'staggered' if staggered else 'coupled':<10}"
                              f"{r1.period:>10g}{r2.period:>10g}{r2.period / r1.period:>7.3f}"
                              f"{max(r1.peak_activations):>8}{max(r2.peak_activations) / 2:>7g}", flush=True)
    print(f"chunked <= one chunk on {sum(r <= 1 + 1e-9 for r in ratios)} of {len(ratios)} cases, strictly faster on "
          f"{sum(r < 1 - 1e-9 for r in ratios)}; chunked/one chunk min {min(ratios):.3f}, mean "
          f"{sum(ratios) / len(ratios):.3f}, max {max(ratios):.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="S in {2, 4, 8} only, S = 4 after failures")
    parser.add_argument("--failures-only", action="store_true")
    parser.add_argument("--no-failures", action="store_true")
    args = parser.parse_args()
    started = time.perf_counter()
    if not args.failures_only:
        fault_free(args.quick)
        interleaved_1f1b(args.quick)
    if not args.no_failures:
        after_failures(args.quick)
    print(f"\n{time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
