"""ZB-H1 against 1F1B under two readings of "1F1B's peak memory": per stage (S-s) or over all workers (S).

Run: .venv/bin/python benchmarks/bench_zb_h1_memory.py
`zb-h1` (ours = torch's ZB1P) holds S micro-batches on every stage, 1F1B's maximum. A ZB-H1 that must keep each
stage at 1F1B's own S-s cannot defer any W during the steady phase (stage s already holds S-s there), so the
only W's it can move are the cool-down ones; this script builds that variant ("zb-h1 per-stage cap") and prints
makespan and per-stage peaks side by side, so the choice is made on numbers.
"""

from __future__ import annotations

from recycle.config import uniform_config
from recycle.ir.actions import Action, Kind
from recycle.ir.plan import Plan, PlanMeta
from recycle.ir.validate import validate_plan
from recycle.schedules.fault_free import build_schedule
from recycle.sim.simulator import simulate


def per_stage_capped(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[Kind, int]]:
    """1F1B with B then W in the steady phase (at most S-s in flight) and all cool-down W's after the last B."""
    warmup = min(num_stages - stage - 1, num_microbatches)
    order = [(Kind.F, j) for j in range(warmup)]
    for i in range(num_microbatches - warmup):
        order += [(Kind.F, warmup + i), (Kind.B, i), (Kind.W, i)]
    order += [(Kind.B, j) for j in range(num_microbatches - warmup, num_microbatches)]
    order += [(Kind.W, j) for j in range(num_microbatches - warmup, num_microbatches)]
    return order


def capped_plan(S: int, M: int) -> Plan:
    actions = [[Action(k, s, j) for k, j in per_stage_capped(s, S, M)] + [Action(Kind.OPT, s)] for s in range(S)]
    return validate_plan(Plan.from_worker_lists(1, S, M, actions, meta=PlanMeta(schedule="zb-h1-capped",
                                                                                   decoupled=True)))


def main() -> int:
    print("each cell: makespan, then peak activations per stage (F start .. W end)")
    print(f"{'F,B,W':<9}{'S':>3}{'M':>4}  {'1f1b':>22}{'1f1b-decoupled':>22}{'zb-h1 per-stage cap':>22}"
          f"{'zb-h1':>22}")
    for F, B, W in [(1.0, 1.0, 1.0), (2.0, 3.0, 1.0), (1.0, 2.0, 2.0)]:
        for S, M in [(4, 6), (4, 8), (8, 16)]:
            config = uniform_config(1, S, M, forward=F, backward_input=B, backward_weight=W)
            cells = []
            for plan in (build_schedule(config, "1f1b"), build_schedule(config, "1f1b-decoupled"),
                         capped_plan(S, M), build_schedule(config, "zb-h1")):
                r = simulate(plan, config, iterations=1)
                peaks = "/".join(map(str, r.peak_activations))
                cells.append(f"{r.makespan:g} {peaks}")
            print(f"{F:g},{B:g},{W:g}".ljust(9) + f"{S:>3}{M:>4}  " + "".join(f"{c:>22}" for c in cells))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
