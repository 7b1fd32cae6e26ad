"""Planner for chunked workers (several virtual stages per worker): list scheduling over the chunks, the worker as
the resource, under priority variants; re-routes a failed worker's chunks to the same chunks on its peers."""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Sequence

from recycle.config import Config
from recycle.errors import PlanError
from recycle.ir.actions import Action, Kind
from recycle.ir.chunks import chunk_workers
from recycle.ir.costs import action_duration
from recycle.ir.plan import Plan, PlanMeta
from recycle.ir.validate import validate_plan
from recycle.planner.failures import canonical_failed
from recycle.planner.memory_cap import memory_cap
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import failed_routing
from recycle.sim.simulator import SimResult, simulate

__all__ = ["ChunkVariant", "CHUNK_VARIANTS", "ALL_CHUNK_VARIANTS", "chunk_caps", "chunked_routing", "list_schedule_chunked",
           "schedule_chunked", "schedule_chunked_key", "chunked_lower_bound"]


@dataclass(frozen=True)
class ChunkVariant:
    """A priority rule. A free worker runs a ready backward first (B or fused BW: it feeds the critical path), then
    a ready forward while its live chunk activations stay under the cap, then a W (the filler).

    forward_order / backward_order pick among several ready ones: "deep" = the chunk nearest the loss (forward) or
    nearest the input (backward) first, then the lowest micro-batch; "mb" = the lowest micro-batch first, then the
    deeper chunk; "ready" = the earliest-ready first; "shallow" = the chunk nearest the input first (a forward
    only). `w_first_at` > 0 runs a ready W instead of a forward once the
    worker holds at least cap - w_first_at chunk activations (frees memory before the cap stalls the forwards)."""

    forward_order: str = "deep"
    backward_order: str = "deep"
    w_first_at: int = 0
    # When a forward and a backward are both ready, run the kind the worker did not run last (a steady F, B, W
    # rhythm per worker instead of bursts of backwards that starve the next chunk's forwards).
    alternate: bool = False

    @property
    def name(self) -> str:
        return (f"f-{self.forward_order}/b-{self.backward_order}" + (f"/w{self.w_first_at}" if self.w_first_at else "")
                + ("/alternate" if self.alternate else ""))


# Every combination (96 rules); benchmarks/bench_chunks.py --all-variants tries them all.
ALL_CHUNK_VARIANTS = tuple(ChunkVariant(f, b, w, alt) for alt in (False, True)
                           for f in ("deep", "mb", "ready", "shallow") for b in ("deep", "mb", "ready")
                           for w in (0, 1, 2, 1 << 20))
# The rules the planner tries: a greedy cover of the rules that reached the best period over all 96 on the fault-free
# sweep of bench_chunks.py (S 2-8, M S..4S, unit and F=2 B=3 W=1 costs, both layouts, coupled and staggered, at
# torch's best peak), plus the plain deep-first rule and the earliest-ready alternating one.
CHUNK_VARIANTS = (
    ChunkVariant("mb", "ready", alternate=True),
    ChunkVariant("deep", "deep", alternate=True),
    ChunkVariant("mb", "deep"),
    ChunkVariant("deep", "ready", w_first_at=2, alternate=True),
    ChunkVariant("deep", "deep", w_first_at=1),
    ChunkVariant("mb", "ready", w_first_at=1, alternate=True),
    ChunkVariant("deep", "deep"),
    ChunkVariant("ready", "ready", alternate=True),
)


def chunk_caps(config: Config, options: PlannerOptions) -> tuple[int, ...] | None:
    """The activation cap per stage in chunk activations: `--memory-cap N` means N full-stage activations per worker
    and a chunk's activation is 1/C of one, so N x C chunk activations (None: unlimited)."""
    caps = memory_cap(config, options)
    C = config.topology.chunks_per_worker
    return None if caps is None else tuple(c * C for c in caps)


def chunked_routing(config: Config, failed: frozenset[tuple[int, int]], slot_major: bool = False
                    ) -> tuple[tuple[int, ...], ...]:
    """host[chunk][mb]: every chunk of a worker takes its worker's row of the one-chunk traffic-aware routing, so
    a failed worker's micro-batches go, for every chunk it held, to the same chunks on its live peers (only the
    failed workers' micro-batches move; loads of a stage's survivors differ by at most one)."""
    per_stage = failed_routing(config, failed, slot_major)
    t = config.topology
    return tuple(per_stage[w] for w in chunk_workers(t.num_stages, t.chunks_per_worker, t.chunk_layout))


def list_schedule_chunked(config: Config, failed: frozenset[tuple[int, int]], host: Sequence[Sequence[int]],
                          decoupled: bool, staggered: bool, caps: Sequence[int] | None,
                          variant: ChunkVariant = ChunkVariant()) -> Plan:
    """One iteration list-scheduled event by event: whenever a worker is free it starts its best ready action
    (ChunkVariant); an action is ready when its input has arrived (F after the previous chunk's F, a backward
    after the next chunk's, the last chunk's backward after its own F, W after its B; p2p time between different
    workers). `caps` is per stage in chunk activations (F start .. W or BW end). Returns the unvalidated plan."""
    t = config.topology
    D, S, C, M = t.num_replicas, t.num_stages, t.chunks_per_worker, config.num_microbatches
    where = chunk_workers(S, C, t.chunk_layout)
    V, total = S * C, D * M
    live = [len([p for p in range(D) if (p, s) not in failed]) for s in range(S)]
    back = Kind.B if decoupled else Kind.BW
    dur = {k: [action_duration(config, k, where[v], live[where[v]]) / C for v in range(V)]
           for k in (Kind.F, Kind.B, Kind.W, Kind.BW)}
    p2p = [config.communication.p2p_time(where[v]) for v in range(V)]  # boundary v: chunk v's output
    node = t.node

    def rank(v: int, mb: int) -> int:
        return host[v][mb] * S + where[v]

    def msg(src_rank: int, dst_rank: int, edge: int) -> float:
        if src_rank == dst_rank:
            return 0.0
        if node(src_rank) != node(dst_rank):
            return config.communication.inter_node_time(where[edge])
        return p2p[edge]

    n = D * S
    # pending[r]: (ready time, kind, chunk, mb) of actions whose input is known; todo[r]: actions left to run
    pending: list[list[tuple[float, Kind, int, int]]] = [[] for _ in range(n)]
    todo = [0] * n
    for v in range(V):
        for mb in range(total):
            r = rank(v, mb)
            todo[r] += 3 if decoupled else 2
            if v == 0:
                pending[r].append((0.0, Kind.F, 0, mb))
    held = [0] * n
    free = [0.0] * n
    order: list[list[Action]] = [[] for _ in range(n)]
    wake: list[tuple[float, int, int]] = []
    seq = 0
    for r in range(n):
        if pending[r] or todo[r]:
            wake.append((0.0, seq, r))
            seq += 1
    heapq.heapify(wake)
    last_was_back = [False] * n
    limit = [caps[r % S] if caps is not None else 1 << 30 for r in range(n)]

    def f_key(item: tuple[float, Kind, int, int]) -> tuple:
        ready, _, v, mb = item
        if variant.forward_order == "deep":
            return (-v, mb)
        if variant.forward_order == "mb":
            return (mb, -v)
        if variant.forward_order == "shallow":
            return (v, mb)
        return (ready, -v, mb)

    def b_key(item: tuple[float, Kind, int, int]) -> tuple:
        ready, _, v, mb = item
        if variant.backward_order == "deep":
            return (v, mb)
        if variant.backward_order == "mb":
            return (mb, v)
        return (ready, v, mb)

    while wake:
        now, _, r = heapq.heappop(wake)
        if free[r] > now or todo[r] == 0:
            continue
        ready = [it for it in pending[r] if it[0] <= now]
        backs = [it for it in ready if it[1] is back]
        fwds = [it for it in ready if it[1] is Kind.F] if held[r] < limit[r] else []
        ws = [it for it in ready if it[1] is Kind.W]
        if backs and fwds and variant.alternate and last_was_back[r] \
                and not (ws and variant.w_first_at and held[r] >= limit[r] - variant.w_first_at):
            pick = min(fwds, key=f_key)
        elif backs:
            pick = min(backs, key=b_key)
        elif fwds and not (ws and variant.w_first_at and held[r] >= limit[r] - variant.w_first_at):
            pick = min(fwds, key=f_key)
        elif ws:
            pick = min(ws, key=lambda it: (it[0], it[2], it[3]))
        else:
            continue  # woken again when an input arrives or a W becomes ready
        pending[r].remove(pick)
        _, kind, v, mb = pick
        end = now + dur[kind][v]
        free[r] = end
        todo[r] -= 1
        order[r].append(Action(kind, v, mb))
        if kind is not Kind.W:
            last_was_back[r] = kind is not Kind.F
        heapq.heappush(wake, (end, seq, r))
        seq += 1
        nxt: list[tuple[Kind, int]] = []
        if kind is Kind.F:
            held[r] += 1
            nxt.append((Kind.F, v + 1) if v + 1 < V else (back, v))
        elif kind is Kind.B or kind is Kind.BW:
            if kind is Kind.BW:
                held[r] -= 1
            else:
                nxt.append((Kind.W, v))
            if v > 0:
                nxt.append((back, v - 1))
        else:
            held[r] -= 1
        for k, u in nxt:
            dst = rank(u, mb)
            edge = min(u, v)
            at = end + (0.0 if k is Kind.W or u == v else msg(r, dst, edge))
            pending[dst].append((at, k, u, mb))
            heapq.heappush(wake, (at, seq, dst))
            seq += 1
    if any(todo):
        stuck = [f"{r // S}:{r % S}" for r in range(n) if todo[r]]
        raise PlanError(f"chunked list schedule ({variant.name}) could not place every action (workers {stuck} "
                        f"stuck, caps {list(caps) if caps else None} chunk activations); raise --memory-cap")
    actions = tuple(tuple(order[r]) + ((Action(Kind.OPT, r % S),) if (r // S, r % S) not in failed else ())
                    for r in range(n))
    actions = tuple(a if (r // S, r % S) not in failed else () for r, a in enumerate(actions))
    return Plan(D, S, M, tuple(tuple(row) for row in host), actions, frozenset(failed), staggered,
                PlanMeta(schedule="adaptive", decoupled=decoupled, solver="heuristic", notes=variant.name),
                chunks=C, chunk_layout=t.chunk_layout)


def chunked_lower_bound(config: Config, failed: frozenset[tuple[int, int]], options: PlannerOptions) -> float:
    """A lower bound on the settled period: every live worker repeats its busiest share of the work and its step
    once per period (micro-batches are whole per worker, so a stage's busiest survivor has ceil(D M / live))."""
    t = config.topology
    D, S, M = t.num_replicas, t.num_stages, config.num_microbatches
    c = config.costs
    best = 0.0
    for s in range(S):
        live = D - sum(1 for p in range(D) if (p, s) in failed)
        q = -(-D * M // live)
        back = min(c.backward_fused[s], c.backward_input[s] + c.backward_weight[s]) if options.decoupled \
            else c.backward_fused[s]
        best = max(best, q * (c.forward[s] + back) + action_duration(config, Kind.OPT, s, live))
    return best


def _rank_key(result: SimResult) -> tuple[float, int]:
    return (round(result.period, 9), max(result.peak_activations))


def schedule_chunked(config: Config, failed: Iterable[tuple[int, int]] = (),
                     options: PlannerOptions = PlannerOptions(), caps: Sequence[int] | None = None,
                     variants: Sequence[ChunkVariant] = CHUNK_VARIANTS) -> Plan:
    """The best plan over the variants and two routings (orphans in id order and in slot order), by simulated
    period, then the lower peak. `caps` (chunk activations per stage) overrides the options' cap (chunk_caps);
    the plan is validated and its meta carries the simulator's period and makespan."""
    failed_set = frozenset(failed)
    if caps is None:
        caps = chunk_caps(config, options)
    routings = [chunked_routing(config, failed_set)]
    if failed_set:
        spread = chunked_routing(config, failed_set, slot_major=True)
        if spread != routings[0]:
            routings.append(spread)
    best: tuple[tuple[float, int], Plan, SimResult] | None = None
    errors = []
    for host in routings:
        for variant in variants:
            try:
                plan = list_schedule_chunked(config, failed_set, host, options.decoupled, options.staggered, caps,
                                             variant)
            except PlanError as exc:
                errors.append(str(exc))
                continue
            result = simulate(plan, config)
            if best is None or _rank_key(result) < best[0]:
                best = (_rank_key(result), plan, result)
    if best is None:
        raise PlanError(f"no chunked schedule fits the memory cap: {errors[0]}")
    _, plan, result = best
    validate_plan(plan)
    key = tuple(sum(1 for p in range(config.num_replicas) if (p, s) in failed_set)
                for s in range(config.num_stages))
    cap_full = memory_cap(config, options)
    return plan.with_meta(failure_key=key, predicted_period=result.period, predicted_makespan=result.makespan,
                          lower_bound=chunked_lower_bound(config, failed_set, options), status="FEASIBLE",
                          memory_cap=cap_full or (), config_fingerprint=config.fingerprint(),
                          notes=f"chunked list schedule, {config.topology.chunks_per_worker} chunks per worker "
                                f"({config.topology.chunk_layout} layout), rule {plan.meta.notes}")


def schedule_chunked_key(config: Config, key: Sequence[int], options: PlannerOptions = PlannerOptions()) -> Plan:
    """schedule_chunked on the canonical layout of a failure key (failed replicas of stage s are 0..k_s-1)."""
    return schedule_chunked(config, canonical_failed(key), options)
