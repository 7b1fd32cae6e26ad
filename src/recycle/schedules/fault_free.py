"""Fault-free pipeline schedules on the plan IR: GPipe, 1F1B (fused BW), 1F1B with decoupled B/W, ZB-H1."""

from __future__ import annotations

from typing import Callable

from recycle.config import Config
from recycle.errors import ConfigError
from recycle.ir.actions import Action, Kind
from recycle.ir.plan import Plan, PlanMeta
from recycle.ir.validate import validate_plan

__all__ = ["SCHEDULES", "build_schedule", "stage_order_1f1b", "stage_order_gpipe", "stage_order_zb_h1"]

# A stage order lists (kind, local micro-batch index) for one pipeline's worker at one stage.
StageOrder = list[tuple[Kind, int]]


def stage_order_gpipe(stage: int, num_stages: int, num_microbatches: int, decoupled: bool = False) -> StageOrder:
    """All forwards, then all backwards (in forward order, as torch's ScheduleGPipe does)."""
    order: StageOrder = [(Kind.F, j) for j in range(num_microbatches)]
    for j in range(num_microbatches):
        order += [(Kind.B, j), (Kind.W, j)] if decoupled else [(Kind.BW, j)]
    return order


def stage_order_1f1b(stage: int, num_stages: int, num_microbatches: int, decoupled: bool = False) -> StageOrder:
    """Warm-up of S-s-1 forwards, then one forward / one backward, then the cool-down backwards.

    The order torch.distributed.pipelining's Schedule1F1B executes (its warm-up loop runs S-s forwards before the
    first backward: the same sequence). With `decoupled`, W follows its B at once: same memory, but the
    input-gradient leaves W time earlier, which shortens the makespan by (S-1)*W.
    """
    warmup = min(num_stages - stage - 1, num_microbatches)
    order: StageOrder = [(Kind.F, j) for j in range(warmup)]

    def backward(j: int) -> StageOrder:
        return [(Kind.B, j), (Kind.W, j)] if decoupled else [(Kind.BW, j)]

    for i in range(num_microbatches - warmup):
        order.append((Kind.F, warmup + i))
        order += backward(i)
    for j in range(num_microbatches - warmup, num_microbatches):
        order += backward(j)
    return order


def stage_order_zb_h1(stage: int, num_stages: int, num_microbatches: int, decoupled: bool = True) -> StageOrder:
    """Zero Bubble H1 (ZB1P, Qi et al. ICLR'24): 1F1B's F/B order, with stage s deferring its first s W's.

    The F and B sequence is exactly 1F1B's, so B stays on the critical path; W's are the filler. Stage s emits a W
    right after its k-th B (k counted from 0) only once k >= s, and the s deferred W's run at the end, in the
    cool-down bubble that 1F1B leaves idle. This is the order torch.distributed.pipelining's
    ScheduleInterleavedZeroBubble produces with one stage per rank (tests/unit/test_peer_pipelining.py).

    Memory, counted from F start to W end: stage s holds (S-s-1 warm-up) + (s deferred) + 1 = S micro-batches, on
    every stage. That equals 1F1B's peak over workers (stage 0 holds S), which is the ZB paper's "same peak memory
    as 1F1B"; per stage it is more than 1F1B's S-s for s > 0 (the last stage holds S instead of 1).
    `decoupled` is accepted for a uniform signature; ZB-H1 is always decoupled.
    """
    warmup = min(num_stages - stage - 1, num_microbatches)
    order: StageOrder = [(Kind.F, j) for j in range(warmup)]
    next_w = 0

    def backward_then_maybe_w(k: int) -> None:
        nonlocal next_w
        order.append((Kind.B, k))
        if k >= stage:  # the first `stage` W's are held back for the cool-down
            order.append((Kind.W, next_w))
            next_w += 1

    for i in range(num_microbatches - warmup):
        order.append((Kind.F, warmup + i))
        backward_then_maybe_w(i)
    for k in range(num_microbatches - warmup, num_microbatches):
        backward_then_maybe_w(k)
    order += [(Kind.W, j) for j in range(next_w, num_microbatches)]
    return order


SCHEDULES: dict[str, tuple[Callable[..., StageOrder], bool]] = {
    "gpipe": (stage_order_gpipe, False),
    "1f1b": (stage_order_1f1b, False),
    "1f1b-decoupled": (stage_order_1f1b, True),
    "zb-h1": (stage_order_zb_h1, True),
}


def build_schedule(config: Config, name: str, staggered: bool = False) -> Plan:
    """The fault-free plan `name` for the config's D, S, M; every pipeline runs the same per-stage order."""
    if name not in SCHEDULES:
        raise ConfigError(f"schedule {name!r} is unknown; choose one of {sorted(SCHEDULES)}")
    chunks = config.topology.chunks_per_worker
    if chunks > 1:
        raise ConfigError(f"schedule {name!r} runs one stage per worker, but [topology] chunks_per_worker = {chunks}; "
                          "chunked schedules (V-shape zero bubble, interleaved 1F1B) come from the planner: `recycle "
                          "plan --config ...` (add --no-decouple for interleaved 1F1B), or set chunks_per_worker = 1")
    order_fn, decoupled = SCHEDULES[name]
    D, S, M = config.num_replicas, config.num_stages, config.num_microbatches
    actions: list[list[Action]] = []
    for replica in range(D):
        for stage in range(S):
            acts = [Action(kind, stage, replica * M + j) for kind, j in order_fn(stage, S, M, decoupled)]
            acts.append(Action(Kind.OPT, stage))
            actions.append(acts)
    host = tuple(tuple(mb // M for mb in range(D * M)) for _ in range(S))
    plan = Plan(D, S, M, host, tuple(tuple(a) for a in actions), frozenset(), staggered,
                PlanMeta(schedule=name, decoupled=decoupled, failure_key=(0,) * S, solver="builtin",
                         config_fingerprint=config.fingerprint()))
    return validate_plan(plan)
