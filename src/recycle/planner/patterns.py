"""Failure patterns: a failure set up to renaming whole pipelines (each replica keeps its set of lost stages), so
one relabelling of pipelines always maps a pattern's plan onto the real ranks and only the failed workers'
micro-batches leave their pipeline, also when the failures are in different pipelines at different stages."""

from __future__ import annotations

import operator
import weakref
from dataclasses import dataclass, replace
from typing import Iterable, Iterator

from recycle.ir.actions import Action, Kind
from recycle.ir.compact import CompactActions
from recycle.ir.plan import Plan

__all__ = ["FailurePattern", "pattern_of", "enumerate_patterns", "rename_replicas", "row_classes",
           "with_shared_actions", "shared_action"]

StageSet = tuple[int, ...]


@dataclass(frozen=True)
class FailurePattern:
    """`lost[c]`: the stages canonical replica c lost, replicas with more losses first (ties: lexicographic);
    `perm[c]`: the real replica playing canonical replica c."""

    num_replicas: int
    num_stages: int
    lost: tuple[StageSet, ...]
    perm: tuple[int, ...]

    def canonical_failed(self) -> frozenset[tuple[int, int]]:
        return frozenset((c, s) for c, stages in enumerate(self.lost) for s in stages)

    def to_real(self, plan: Plan, failed: frozenset[tuple[int, int]]) -> Plan:
        """Map a plan made for the canonical failed set onto the real one."""
        return rename_replicas(plan, self.perm, failed)


def _order(stages: StageSet) -> tuple:
    return (-len(stages), stages)


def pattern_of(failed: Iterable[tuple[int, int]], num_replicas: int, num_stages: int) -> FailurePattern:
    per_replica = {p: tuple(sorted(s for q, s in failed if q == p)) for p in range(num_replicas)}
    perm = tuple(sorted(range(num_replicas), key=lambda p: (_order(per_replica[p]), p)))
    return FailurePattern(num_replicas, num_stages, tuple(per_replica[p] for p in perm), perm)


def _stage_sets(num_stages: int, max_size: int) -> list[StageSet]:
    """Every non-empty set of stages of at most `max_size`, in pattern order."""
    from itertools import combinations

    sets = [c for size in range(1, max_size + 1) for c in combinations(range(num_stages), size)]
    return sorted(sets, key=_order)


def enumerate_patterns(num_replicas: int, num_stages: int, max_failures: int) -> Iterator[FailurePattern]:
    """Every pattern with 1..max_failures failures and a live replica in every stage (canonical: perm = identity)."""
    sets = _stage_sets(num_stages, min(max_failures, num_stages))

    def extend(prefix: list[StageSet], start: int, budget: int) -> Iterator[list[StageSet]]:
        if prefix:
            yield prefix
        if len(prefix) == num_replicas:
            return
        for index in range(start, len(sets)):
            if len(sets[index]) <= budget:
                yield from extend(prefix + [sets[index]], index, budget - len(sets[index]))

    for lost in extend([], 0, max_failures):
        per_stage = [sum(s in stages for stages in lost) for s in range(num_stages)]
        if max(per_stage) < num_replicas:
            full = tuple(lost) + ((),) * (num_replicas - len(lost))
            yield FailurePattern(num_replicas, num_stages, full, tuple(range(num_replicas)))


_ACTIONS: dict[tuple[Kind, int, int], Action] = {}
_ACTIONS_LIMIT = 1 << 20


def shared_action(kind: Kind, stage: int, mb: int) -> Action:
    """A shared Action instance: renaming a stored plan then costs dict look-ups, not object construction, which
    keeps a plan-store lookup well under a millisecond."""
    key = (kind, stage, mb)
    action = _ACTIONS.get(key)
    if action is None:
        if len(_ACTIONS) >= _ACTIONS_LIMIT:
            _ACTIONS.clear()
        action = _ACTIONS[key] = Action(kind, stage, mb)
    return action


def rename_replicas(plan: Plan, perm: tuple[int, ...], failed: frozenset[tuple[int, int]]) -> Plan:
    """The same plan with replica c renamed perm[c] everywhere, micro-batches renamed with their owner (mb of
    owner c becomes the same-index mb of owner perm[c]): a pure symmetry of the problem, same validity and timing.
    A list that holds only its own pipeline's micro-batches and lands on a rank whose list is the same up to the
    renaming (row_classes) is that rank's list as it is: a recovery at 16,384 workers renames the few lists a
    failure changed, not 280,000 actions (0.2-0.3 s of CPU on the path to the announcement)."""
    D, S, M = plan.num_replicas, plan.num_stages, plan.num_microbatches
    # A split plan's extra pieces keep their ids (their source micro-batch is renamed below).
    rename = [perm[mb // M] * M + mb % M for mb in range(D * M)] + list(range(D * M, plan.num_microbatch_ids))
    actions: list[tuple[Action, ...]] | CompactActions
    if isinstance(plan.actions, CompactActions):
        actions = _rename_compact(plan.actions, perm, S, M)  # a large plan: rename its arrays, build no Action
    else:
        rows, classes = plan.actions, row_classes(plan)
        actions = [()] * (D * S)
        for c in range(D):
            for s in range(S):
                source, target = c * S + s, perm[c] * S + s
                kind = classes[source]
                actions[target] = rows[target] if kind >= 0 and kind == classes[target] else tuple(
                    a if a.mb < 0 else shared_action(a.kind, a.stage, rename[a.mb]) for a in rows[source])
    # real[rename[mb]] = perm[row[mb]], as C-level passes: each row's replicas renamed, then put in the new order.
    inverse = [0] * len(rename)
    for mb, new in enumerate(rename):
        inverse[new] = mb
    reorder = operator.itemgetter(*inverse)
    host_rows = []
    for row in plan.host:
        renamed = reorder(tuple(map(perm.__getitem__, row)))
        host_rows.append(renamed if isinstance(renamed, tuple) else (renamed,))  # (a single id: a bare value)
    pieces = list(plan.pieces)
    for mb, piece in enumerate(plan.pieces):
        pieces[rename[mb]] = replace(piece, source=rename[piece.source])
    return replace(plan, host=tuple(host_rows), actions=actions if isinstance(actions, CompactActions)
                   else tuple(actions), failed=failed, pieces=tuple(pieces))


_CLASSES: dict[int, tuple[int, ...]] = {}  # id(plan) -> row_classes(plan), while the plan lives


def row_classes(plan: Plan) -> tuple[int, ...]:
    """Per rank of `plan`: a number that two ranks share when their action lists are the same up to renaming their
    replicas (each list holds only its own pipeline's micro-batches, with the same kinds, stages and indices within
    the pipeline, in the same order), -1 for a list that holds another pipeline's micro-batch. Worked out once per
    plan (a plan store's or library's: `PlanLibrary` does it before the run) and kept while the plan lives."""
    known = _CLASSES.get(id(plan))
    if known is not None:
        return known
    S, M = plan.num_stages, plan.num_microbatches
    numbers: dict[tuple, int] = {}
    classes = []
    for rank, row in enumerate(plan.actions):
        first = rank // S * M  # (a split plan's pieces, ids from D x M on, are no pipeline's own: -1)
        if all(a.mb < 0 or first <= a.mb < first + M for a in row):
            shape = tuple((a.kind, a.stage, a.mb - first if a.mb >= 0 else -1) for a in row)
            classes.append(numbers.setdefault((rank % S, shape), len(numbers)))
        else:
            classes.append(-1)
    result = tuple(classes)
    _CLASSES[id(plan)] = result
    weakref.finalize(plan, _CLASSES.pop, id(plan), None)
    return result


def with_shared_actions(plan: Plan) -> Plan:
    """`plan` with its lists as tuples of shared Action instances (shared_action): the lists of plans renamed from
    it then compare element by element as one object each (a tuple comparison in C), where a large plan's own
    Actions (built from its arrays, each a new object) compare field by field."""
    rows = plan.actions.rows if isinstance(plan.actions, CompactActions) else plan.actions
    shared = tuple(tuple(shared_action(a.kind, a.stage, a.mb) for a in row) for row in rows)
    return replace(plan, actions=shared)


def _rename_compact(actions: CompactActions, perm: tuple[int, ...], S: int, M: int) -> CompactActions:
    """rename_replicas on the flat arrays: rank c*S+s's rows become rank perm[c]*S+s's, micro-batches renamed."""
    import numpy as np  # only large plans are compact, and building them already loaded numpy

    bounds = np.asarray(actions.bounds, dtype=np.int64)
    mb = np.asarray(actions.mb, dtype=np.int64)
    old_rank = np.empty(len(bounds) - 1, dtype=np.int64)
    for c, p in enumerate(perm):
        old_rank[p * S:(p + 1) * S] = np.arange(c * S, (c + 1) * S)
    lengths = (bounds[1:] - bounds[:-1])[old_rank]
    new_bounds = np.concatenate(([0], np.cumsum(lengths)))
    # Row indices of each new rank's list: its old rank's rows in order.
    index = np.repeat(bounds[:-1][old_rank] - new_bounds[:-1], lengths) + np.arange(int(new_bounds[-1]))
    owner = np.asarray(perm, dtype=np.int64)[np.maximum(mb, 0) // M]
    renamed = np.where(mb >= 0, owner * M + mb % M, mb)
    return CompactActions(new_bounds, np.asarray(actions.code)[index], np.asarray(actions.stage)[index],
                          renamed[index])
