"""Hints for the exact planner: a plan's orders timed on the model's integer ticks, relabelled, in its kinds."""

from __future__ import annotations

from recycle.config import Config
from recycle.errors import PlanError
from recycle.ir.actions import Kind
from recycle.ir.dependencies import boundary, input_stage, producer_kind
from recycle.ir.plan import Plan
from recycle.ir.validate import check_plan_matches, validate_plan
from recycle.planner.exact_instance import Instance
from recycle.planner.failures import canonical_failed

__all__ = ["check_hint", "hint_schedule"]


def _asap_ticks(plan: Plan, inst: Instance) -> dict[tuple[Kind, int, int], int]:
    """Start tick of every compute action when the plan's orders run as soon as possible on the model's integer
    durations (one iteration; the same rule as the simulator, so the hint is exactly feasible in the model)."""
    S = inst.S
    ends: dict[tuple[Kind, int, int], int] = {}
    starts: dict[tuple[Kind, int, int], int] = {}
    pointer = [0] * len(plan.actions)
    free = [0] * len(plan.actions)
    decoupled = plan.decoupled_pairs
    progress = True
    while progress:
        progress = False
        for rank, acts in enumerate(plan.actions):
            while pointer[rank] < len(acts) and acts[pointer[rank]].kind is not Kind.OPT:
                a = acts[pointer[rank]]
                ready = free[rank]
                source = input_stage(a.kind, a.stage, S)
                if source is not None:
                    dep = (producer_kind(a.kind, (source, a.mb) in decoupled), source, a.mb)
                    if dep not in ends:
                        break
                    ready = max(ready, ends[dep] + inst.p2p[boundary(a.stage, source)])
                k = (a.kind, a.stage, a.mb)
                starts[k] = ready
                ends[k] = free[rank] = ready + inst.duration[(a.kind, a.stage)]
                pointer[rank] += 1
                progress = True
    return starts


def hint_schedule(hint: Plan, inst: Instance) -> tuple[dict[tuple[Kind, int, int], int], dict[tuple[int, int], int]]:
    """Start ticks and hosts of the hint's orders, relabelled to satisfy the symmetry breaking and translated to
    the model's kinds (a fused BW becomes B then W; B and W become one BW at B's start)."""
    raw = _asap_ticks(hint, inst)
    M = inst.M
    relabel: dict[int, int] = {}
    for owner in range(inst.D):
        mbs = range(owner * M, (owner + 1) * M)
        for j, mb in enumerate(sorted(mbs, key=lambda mb: (raw[(Kind.F, 0, mb)], mb))):
            relabel[mb] = owner * M + j
    times: dict[tuple[Kind, int, int], int] = {}
    hosts: dict[tuple[int, int], int] = {}
    for s in range(inst.S):
        for mb in range(inst.D * M):
            new = relabel[mb]
            hosts[(s, new)] = hint.host[s][mb]
            f = raw[(Kind.F, s, mb)]
            times[(Kind.F, s, new)] = f
            if (Kind.BW, s, mb) in raw:
                bw = raw[(Kind.BW, s, mb)]
                b, w = bw, bw + inst.duration[(Kind.B, s)]
            else:
                b, w = raw[(Kind.B, s, mb)], raw[(Kind.W, s, mb)]
                bw = b
            if Kind.BW in inst.kinds:
                times[(Kind.BW, s, new)] = bw
            else:
                times[(Kind.B, s, new)] = b
                times[(Kind.W, s, new)] = w
    return times, hosts


def check_hint(hint: Plan, config: Config, key: tuple[int, ...]) -> None:
    check_plan_matches(hint, config.num_replicas, config.num_stages, config.num_microbatches, "the hint plan")
    canonical = canonical_failed(key)
    if hint.failed != canonical:
        raise PlanError(f"the hint plan has failed workers {sorted(hint.failed)}, but the exact solver plans the "
                        f"canonical layout of key {key} (failed {sorted(canonical)}); pass a hint made for the same "
                        "config and key (e.g. schedule_heuristic(config, key, options))")
    validate_plan(hint)
