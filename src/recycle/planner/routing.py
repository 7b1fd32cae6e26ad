"""Balanced routing: which live replica of each stage hosts each micro-batch in the canonical layout of a key."""

from __future__ import annotations

from typing import Sequence

from recycle.config import Config
from recycle.errors import FailureStateError

__all__ = ["balanced_routing", "slot_spread_routing", "routing_candidates", "failed_routing", "check_key",
           "worker_loads", "traffic"]


def check_key(config: Config, key: Sequence[int]) -> tuple[int, ...]:
    """Return `key` as a tuple after checking it fits the config: one entry per stage, 0 <= k_s < D."""
    D, S = config.num_replicas, config.num_stages
    key = tuple(int(k) for k in key)
    if len(key) != S:
        raise FailureStateError(f"failure key {key} has {len(key)} entries but the config has {S} stages; give "
                                "one failed-replica count per stage")
    for s, k in enumerate(key):
        if k < 0:
            raise FailureStateError(f"failure key {key}: stage {s} has {k} failed replicas; counts must be >= 0")
        if k >= D:
            raise FailureStateError(
                f"failure key {key}: stage {s} has lost {k} of {D} replicas, so no replica holds its weights; "
                "pipeline adaptation cannot continue: restore from a checkpoint"
            )
    return key


def balanced_routing(config: Config, key: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """host[stage][mb] for the canonical layout of `key` (failed replicas of stage s are 0..k_s-1).

    A live replica keeps its own micro-batches. The orphans of stage s (the micro-batches owned by its failed
    replicas, in id order) are dealt round-robin over the live replicas k_s..D-1 with one pointer for the whole
    stage, so every live worker of the stage hosts floor or ceil of D*M/(D-k_s) micro-batches: loads differ by at
    most one. Canonical failures share low replica ids, so a micro-batch orphaned at several stages is dealt the
    same way at each of them and stays on one surviving pipeline (fewer cross-pipeline hops).
    """
    return _dealt_routing(config, key, slot_major=False)


def slot_spread_routing(config: Config, key: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Like `balanced_routing`, but the orphans are dealt in (slot, owner) order instead of id order.

    With id order and M a multiple of the live count, every survivor receives the same slot of each lost pipeline
    (e.g. slot 0 of owners 0 and 1), so its extra work arrives in bursts; dealing slot-major spreads each survivor's
    orphans over the iteration. Loads are the same as `balanced_routing`'s.
    """
    return _dealt_routing(config, key, slot_major=True)


def _dealt_routing(config: Config, key: Sequence[int], slot_major: bool) -> tuple[tuple[int, ...], ...]:
    """Each stage's orphans (owners 0..k-1) dealt round-robin over its live replicas, in id or (slot, owner) order."""
    key = check_key(config, key)
    D, M = config.num_replicas, config.num_microbatches
    host = []
    for k in key:
        live = list(range(k, D))
        row = [mb // M for mb in range(D * M)]
        orphans = sorted(range(k * M), key=lambda mb: (mb % M, mb // M)) if slot_major else range(k * M)
        for i, mb in enumerate(orphans):
            row[mb] = live[i % len(live)]
        host.append(tuple(row))
    return tuple(host)


def routing_candidates(config: Config, key: Sequence[int]) -> tuple[tuple[tuple[int, ...], ...], ...]:
    """The distinct balanced routings the heuristic tries: id order first (the paper's), then slot-major."""
    first = balanced_routing(config, key)
    second = slot_spread_routing(config, key)
    return (first,) if second == first else (first, second)


def failed_routing(config: Config, failed: frozenset[tuple[int, int]], slot_major: bool = False
                   ) -> tuple[tuple[int, ...], ...]:
    """host[stage][mb] on the real ranks of a failure set: only the failed workers' micro-batches move.

    Every live worker keeps its own micro-batches; the orphans of stage s (owned by its failed replicas, in id
    order, or (slot, owner) order with `slot_major`) are dealt round-robin over the live replicas of s in id order,
    so loads differ by at most one, as in `balanced_routing`. This is the traffic-aware routing for failure sets
    that no single relabelling of pipelines maps onto the canonical layout.
    """
    D, S, M = config.num_replicas, config.num_stages, config.num_microbatches
    own = [mb // M for mb in range(D * M)]
    host = []
    for s in range(S):
        live = [p for p in range(D) if (p, s) not in failed]
        if not live:
            raise FailureStateError(f"stage {s} has no live replica; pipeline adaptation cannot continue: restore "
                                    "from a checkpoint")
        row = own.copy()
        orphans = [mb for p in range(D) if (p, s) in failed for mb in range(p * M, (p + 1) * M)]
        if slot_major:
            orphans.sort(key=lambda mb: (mb % M, mb // M))
        for i, mb in enumerate(orphans):
            row[mb] = live[i % len(live)]
        host.append(tuple(row))
    return tuple(host)


def traffic(host: Sequence[Sequence[int]], num_microbatches: int,
            failed: frozenset[tuple[int, int]] = frozenset(), stage_of: Sequence[int] | None = None,
            owners: Sequence[int] | None = None) -> dict[str, int]:
    """Off-pipeline work and cross-pipeline messages of one iteration under a routing.

    moved_microbatches: (stage, mb) pairs run off their own pipeline; moved_healthy: those whose own worker is alive
    (work that did not have to move); cross_pipeline_messages: forward activations and input-gradients sent
    between different pipelines (two per stage boundary a micro-batch crosses between hosts). A chunked plan's
    rows are its chunks; `stage_of[row]` is then the stage of the worker holding the chunk (Plan.chunk_stages).
    `owners[mb]`: each micro-batch id's owner replica (a split plan's pieces: Plan.owner; None: mb // M).
    """
    M = num_microbatches
    moved = healthy = cross = 0
    S = len(host)
    owner = list(owners) if owners is not None else [mb // M for mb in range(len(host[0]) if host else 0)]
    for s, row in enumerate(host):
        nxt = host[s + 1] if s + 1 < S else None
        for mb, p in enumerate(row):
            if p != owner[mb]:
                moved += 1
                if (owner[mb], s if stage_of is None else stage_of[s]) not in failed:
                    healthy += 1
            if nxt is not None and nxt[mb] != p:
                cross += 2
    return {"moved_microbatches": moved, "moved_healthy": healthy, "cross_pipeline_messages": cross}


def worker_loads(host: Sequence[Sequence[int]], num_replicas: int) -> tuple[tuple[int, ...], ...]:
    """loads[stage][replica]: how many micro-batches each worker hosts under a routing."""
    loads = []
    for row in host:
        counts = [0] * num_replicas
        for replica in row:
            counts[replica] += 1
        loads.append(tuple(counts))
    return tuple(loads)
