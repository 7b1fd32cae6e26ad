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
    """Warm-up of S-s-1 forwards, then one forward / one backward, then the cool-down backwards."""
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
    """Zero Bubble H1: 1F1B's forwards and input-gradients, with stage s deferring its first s weight-gradients.

    Deferring W lets each B reach the previous stage sooner (the critical path only carries F and B), so the
    cool-down bubble shrinks from (S-1)(F+B+W) to (S-1)(F+B) - ... while in-flight micro-batches (F done, W not
    done) stay at 1F1B's S-s peak: a stage only starts a new forward when it also retires a W.
    """
    warmup = min(num_stages - stage - 1, num_microbatches)
    order: StageOrder = [(Kind.F, j) for j in range(warmup)]
    next_w = 0
    deferred = min(stage, num_microbatches)  # W's held back on stage s (s of them) to fill the cool-down
    for i in range(num_microbatches - warmup):
        order.append((Kind.F, warmup + i))
        order.append((Kind.B, i))
        if i >= deferred:
            order.append((Kind.W, next_w))
            next_w += 1
    for j in range(num_microbatches - warmup, num_microbatches):
        order.append((Kind.B, j))
        if next_w < num_microbatches and j >= deferred + (num_microbatches - warmup) - (num_microbatches - warmup):
            order.append((Kind.W, next_w))
            next_w += 1
    while next_w < num_microbatches:
        order.append((Kind.W, next_w))
        next_w += 1
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
