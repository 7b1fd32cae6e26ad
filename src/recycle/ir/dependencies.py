"""The dependency rule between actions: F at stage s needs F at s-1, B/BW at s needs B-or-BW at s+1, W its own B."""

from __future__ import annotations

from functools import lru_cache

from recycle.ir.actions import BACKWARD_KINDS, Action, Kind
from recycle.ir.plan import Plan

__all__ = ["input_stage", "output_stage", "boundary", "local_input", "gradient_kind", "producer_kind", "producer",
           "input_stage_table", "output_stage_table"]


def input_stage(kind: Kind, stage: int, num_stages: int) -> int | None:
    """The stage whose message `kind` at `stage` waits for: F needs stage s-1's activation, B and BW stage s+1's
    input-gradient. None when it needs no message (F at stage 0, a backward at the last stage, W, OPT)."""
    if kind is Kind.F:
        return stage - 1 if stage > 0 else None
    if kind in BACKWARD_KINDS:
        return stage + 1 if stage < num_stages - 1 else None
    return None


def output_stage(kind: Kind, stage: int, num_stages: int) -> int | None:
    """The stage that receives the message `kind` at `stage` sends when it ends (the other side of input_stage):
    F's activation goes to s+1, B's or BW's input-gradient to s-1; None when nothing is sent."""
    if kind is Kind.F:
        return stage + 1 if stage < num_stages - 1 else None
    if kind in BACKWARD_KINDS:
        return stage - 1 if stage > 0 else None
    return None


def boundary(stage: int, other: int) -> int:
    """The stage boundary a message between adjacent stages crosses: the index of per-boundary p2p times."""
    return min(stage, other)


def local_input(kind: Kind, stage: int, num_stages: int) -> Kind | None:
    """The kind of the same micro-batch's action on the same worker that must end before `kind` starts, where no
    message already implies it: W after its own B; the last stage's B or BW after its F (the loss turn-around)."""
    if kind is Kind.W:
        return Kind.B
    if kind in BACKWARD_KINDS and stage == num_stages - 1:
        return Kind.F
    return None


def gradient_kind(decoupled: bool) -> Kind:
    """The action that sends a (stage, micro-batch)'s input-gradient: B where its backward is decoupled, else BW."""
    return Kind.B if decoupled else Kind.BW


def producer_kind(kind: Kind, source_decoupled: bool) -> Kind:
    """The kind of the action whose message `kind` waits for (see input_stage for its stage): F for an F; for a
    backward, the input stage's B when that (stage, micro-batch) is decoupled, else its BW."""
    return Kind.F if kind is Kind.F else gradient_kind(source_decoupled)


def producer(plan: Plan, action: Action) -> Action | None:
    """The action (on host[input stage][mb]) whose message `action` waits for, or None if it needs none."""
    source = input_stage(action.kind, action.stage, plan.num_chunks)  # the chain runs over chunks
    if source is None:
        return None
    kind = producer_kind(action.kind, (source, action.mb) in plan.decoupled_pairs)
    return Action(kind, source, action.mb)


@lru_cache(maxsize=64)  # callers pass a tuple of kinds; a simulation of a small plan must not rebuild it
def input_stage_table(kinds: tuple[Kind, ...], num_stages: int) -> tuple[tuple[int, ...], ...]:
    """input_stage of every (kind, stage) for hot loops: one row per kind in `kinds` order, -1 for none."""
    return tuple(tuple(_or_minus_one(input_stage(k, s, num_stages)) for s in range(num_stages)) for k in kinds)


@lru_cache(maxsize=64)
def output_stage_table(kinds: tuple[Kind, ...], num_stages: int) -> tuple[tuple[int, ...], ...]:
    """output_stage of every (kind, stage) for hot loops: one row per kind in `kinds` order, -1 for none."""
    return tuple(tuple(_or_minus_one(output_stage(k, s, num_stages)) for s in range(num_stages)) for k in kinds)


def _or_minus_one(stage: int | None) -> int:
    return -1 if stage is None else stage
