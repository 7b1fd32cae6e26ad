"""Failure states: a set of failed workers -> normalized key (failed replicas per stage) + mapping onto real ranks."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterable, Iterator

from recycle.errors import FailureStateError
from recycle.ir.plan import Plan
from recycle.ir.worker import Worker
from recycle.planner.patterns import rename_replicas

__all__ = ["FailureState", "canonical_failed", "normalize", "parse_worker", "enumerate_keys", "count_failure_sets",
           "check_failure_states", "MAX_PLANNED_STATES"]

def parse_worker(text: str, num_replicas: int, num_stages: int) -> tuple[int, int]:
    """Parse 'R:S' (replica:stage) and check it against the topology."""
    try:
        replica, stage = Worker.parse(text)
    except ValueError:
        raise FailureStateError(f"worker {text!r} is malformed; write REPLICA:STAGE, e.g. --fail 1:2") from None
    if replica >= num_replicas or stage >= num_stages:
        raise FailureStateError(
            f"worker {text!r} is outside the topology: replicas are 0..{num_replicas - 1} and stages are "
            f"0..{num_stages - 1}; pick a worker inside it"
        )
    return replica, stage


@dataclass(frozen=True)
class FailureState:
    """A real failure set, its normalized key and the per-stage relabelling.

    Canonical layout of key k: at stage s the failed replicas are 0..k_s-1 and the live ones k_s..D-1.
    `perm[s][c]` is the real replica playing canonical replica c at stage s. When one relabelling of the replicas
    maps the canonical failures onto the real ones at every stage (one failure; several in one stage; several in
    one pipeline: whenever the real failed sets are nested), `perm` is that single permutation at every stage and
    `symmetric` is True: the real plan is then the canonical plan with pipelines and their micro-batches renamed, so
    only the failed workers' micro-batches leave their pipeline, as in the paper. Otherwise each stage is relabelled
    on its own (failed first, then live, each keeping its order), which is equally fast in the cost model but can
    route some healthy micro-batches through another pipeline's worker.
    """

    num_replicas: int
    num_stages: int
    failed: frozenset[tuple[int, int]]
    key: tuple[int, ...]
    perm: tuple[tuple[int, ...], ...]
    symmetric: bool = False

    def canonical_failed(self) -> frozenset[tuple[int, int]]:
        return canonical_failed(self.key)

    def to_real(self, plan: Plan) -> Plan:
        """Map a plan made for the canonical layout of this key onto the real ranks."""
        D, S = self.num_replicas, self.num_stages
        if plan.failed != self.canonical_failed():
            raise FailureStateError(f"plan is for failed workers {sorted(plan.failed)}, not the canonical layout "
                                    f"of key {self.key}; look the plan up by this key")
        if self.symmetric:
            return rename_replicas(plan, self.perm[0], self.failed)
        actions: list[tuple] = [()] * (D * S)
        for c in range(D):
            for s in range(S):
                actions[self.perm[s][c] * S + s] = plan.actions[c * S + s]
        # one row per stage, or per chunk (relabelled with its worker's stage) when chunked
        host = tuple(tuple(map(self.perm[plan.chunk_stage(s)].__getitem__, row)) for s, row in enumerate(plan.host))
        return replace(plan, host=host, actions=tuple(actions), failed=self.failed)


def canonical_failed(key: Iterable[int]) -> frozenset[tuple[int, int]]:
    """The failed workers of key `key`'s canonical layout: replicas 0..k_s-1 at every stage s."""
    return frozenset((c, s) for s, k in enumerate(key) for c in range(k))


def normalize(failed: Iterable[tuple[int, int]], num_replicas: int, num_stages: int) -> FailureState:
    """Normalize a failure set; a stage with no live replica is an error (its weights need a checkpoint)."""
    failed_set = frozenset(failed)
    for p, s in failed_set:
        if not (0 <= p < num_replicas and 0 <= s < num_stages):
            raise FailureStateError(f"failed worker {p}:{s} is outside the {num_replicas}x{num_stages} topology")
    key = []
    perm = []
    for s in range(num_stages):
        dead = sorted(p for p, st in failed_set if st == s)
        if len(dead) == num_replicas:
            raise FailureStateError(
                f"stage {s} has lost all {num_replicas} replicas ({', '.join(f'{p}:{s}' for p in dead)}); its "
                "weights and optimizer state are gone, so pipeline adaptation cannot continue: restore from a "
                "checkpoint (or bring a replica of that stage back)"
            )
        alive = [p for p in range(num_replicas) if p not in dead]
        key.append(len(dead))
        perm.append(tuple(dead + alive))
    single = _global_permutation(failed_set, num_replicas, num_stages)
    if single is not None:
        return FailureState(num_replicas, num_stages, failed_set, tuple(key), (single,) * num_stages, True)
    return FailureState(num_replicas, num_stages, failed_set, tuple(key), tuple(perm))


def _global_permutation(failed: frozenset[tuple[int, int]], num_replicas: int,
                        num_stages: int) -> tuple[int, ...] | None:
    """One replica permutation mapping {0..k_s-1} onto the real failed replicas of every stage s, if one exists.

    It exists exactly when the real failed sets are nested (a chain under inclusion): list the replicas by how
    many stages they failed in (most first); each stage's failed set must then be a prefix of that list.
    """
    per_stage = [frozenset(p for p, st in failed if st == s) for s in range(num_stages)]
    count = {p: sum(p in f for f in per_stage) for p in range(num_replicas)}
    order = sorted(range(num_replicas), key=lambda p: (-count[p], p))
    for dead in per_stage:
        if frozenset(order[:len(dead)]) != dead:
            return None
    return tuple(order)


def enumerate_keys(num_replicas: int, num_stages: int, max_failures: int) -> Iterator[tuple[int, ...]]:
    """Every normalized key with at most `max_failures` failures and a live replica in every stage, in
    lexicographic order. Built stage by stage within the budget: filtering all (cap + 1)^S tuples, as before, never
    ended for 64 stages and 2 failures."""
    cap = min(num_replicas - 1, max_failures)
    if max_failures < 0:
        return
    key, total = [0] * num_stages, 0
    yield tuple(key)
    while True:  # an odometer: count up the last stage that can take one more failure, zero the ones after it
        i = num_stages - 1
        while i >= 0 and not (key[i] < cap and total < max_failures):
            total -= key[i]
            key[i] = 0
            i -= 1
        if i < 0:
            return
        key[i] += 1
        total += 1
        yield tuple(key)


# States a plan store (or the run's plan library) plans before training: each takes milliseconds to seconds.
MAX_PLANNED_STATES = 10_000


def check_failure_states(num_replicas: int, num_stages: int, max_failures: int, flag: str = "--max-failures") -> None:
    """Refuse a `max_failures` whose failure states (normalized keys) number more than MAX_PLANNED_STATES."""
    count = sum(1 for _ in itertools.islice(enumerate_keys(num_replicas, num_stages, max_failures),
                                            MAX_PLANNED_STATES + 1))
    if count > MAX_PLANNED_STATES:
        raise FailureStateError(
            f"{flag} {max_failures} over D={num_replicas} x S={num_stages} is more than {MAX_PLANNED_STATES:,} failure "
            f"states to plan ahead (each takes milliseconds to seconds); lower {flag} (a state beyond it is planned "
            "when it happens)")


def count_failure_sets(num_replicas: int, num_stages: int, max_failures: int) -> int:
    """How many raw failure sets the keys stand for (each stage keeps at least one replica)."""
    from math import comb

    total = 0
    for key in enumerate_keys(num_replicas, num_stages, max_failures):
        n = 1
        for k in key:
            n *= comb(num_replicas, k)
        total += n
    return total
