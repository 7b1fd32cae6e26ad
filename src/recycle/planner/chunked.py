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
from recycle.planner.failures import normalize
from recycle.planner.memory_cap import memory_cap
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import balanced_routing, failed_routing, traffic
from recycle.sim.simulator import SimResult, simulate

__all__ = ["ChunkVariant", "CHUNK_VARIANTS", "FAILURE_VARIANTS", "ALL_CHUNK_VARIANTS", "chunk_caps", "chunked_routing",
           "canonical_chunked_routing", "list_schedule_chunked", "schedule_chunked", "chunked_lower_bound"]


@dataclass(frozen=True)
class ChunkVariant:
    """A priority rule. A free worker runs a ready backward first (B or fused BW: it feeds the critical path), then
    a ready forward while its live chunk activations stay under the cap, then a W (the filler).

    forward_order / backward_order pick among several ready ones: "deep" = the chunk nearest the loss (forward) or
    nearest the input (backward) first, then the lowest micro-batch; "mb" = the lowest micro-batch first, then the
    deeper chunk; "ready" = the earliest-ready first; "shallow" = the chunk nearest the input first (a forward
    only); "round" = by rounds of S micro-batches (mb // S), then the shallower chunk first (forward) or the deeper
    one (backward): every chunk of a round before the next round, the order of Megatron's interleaved 1F1B.
    `w_first_at` > 0 runs a ready W instead of a forward once the worker holds at least cap - w_first_at chunk
    activations (frees memory before the cap stalls the forwards)."""

    forward_order: str = "deep"
    backward_order: str = "deep"
    w_first_at: int = 0
    # Admit a micro-batch into the pipeline (its chunk-0 forward) only when every worker on its path has room for all
    # the chunks it will hold there, reserved until each one's W (or BW) ends; every later forward then always fits.
    # Never deadlocks under a cap (the greedy rules can: a worker full of shallow chunks' activations waits for a deep
    # chunk's forward it has no room for), at the price of holding room earlier than needed.
    reserve: bool = False
    # When a forward and a backward are both ready, run the kind the worker did not run last (a steady F, B, W
    # rhythm per worker instead of bursts of backwards that starve the next chunk's forwards).
    alternate: bool = False
    # Greedy rules (no reserve) keep `guard` of the cap for later chunks: a forward that opens a micro-batch on a
    # worker (its first chunk there) starts only while the worker holds fewer than cap - guard activations.
    guard: int = 0

    @property
    def name(self) -> str:
        return (f"f-{self.forward_order}/b-{self.backward_order}" + (f"/w{self.w_first_at}" if self.w_first_at else "")
                + ("/alternate" if self.alternate else "") + ("/reserve" if self.reserve else "")
                + (f"/guard{self.guard}" if self.guard else ""))


# Every combination (160 rules, 320 with reserve); the sweeps that chose the sets below tried the ones they name.
ALL_CHUNK_VARIANTS = tuple(ChunkVariant(f, b, w, reserve, alt) for reserve in (False, True) for alt in (False, True)
                           for f in ("deep", "mb", "ready", "shallow", "round")
                           for b in ("deep", "mb", "ready", "round") for w in (0, 1, 2, 1 << 20))
# The rules the planner tries without failures: a greedy cover of the rules that reached the best period over the 96
# without reserve on the fault-free sweep of benchmarks/bench_chunks.py (S 2-8, M S..4S, unit and F=2 B=3 W=1
# costs, both layouts, coupled and staggered, at torch's best peak), plus the plain deep-first rule, the
# earliest-ready alternating one, the round-robin one for fused backwards and two reserving ones (which never
# deadlock).
CHUNK_VARIANTS = (
    ChunkVariant("mb", "ready", alternate=True),
    ChunkVariant("deep", "deep", alternate=True),
    ChunkVariant("mb", "deep"),
    ChunkVariant("deep", "ready", w_first_at=2, alternate=True),
    ChunkVariant("deep", "deep", w_first_at=1),
    ChunkVariant("mb", "ready", w_first_at=1, alternate=True),
    ChunkVariant("deep", "deep"),
    ChunkVariant("ready", "ready", alternate=True),
    # With a fused backward (interleaved 1F1B) this rule alone matched torch's ScheduleInterleaved1F1B at its peak
    # on all 24 shapes tried (S 3, 4, 6, 8; M S, 2S, 4S; both cost sets), among 80 rules with the "round" orders.
    ChunkVariant("round", "round", alternate=True),
    ChunkVariant("deep", "deep", alternate=True, reserve=True),
    ChunkVariant("mb", "ready", alternate=True, reserve=True),
)
# Added after failures: a greedy cover of the best of 96 rules (every forward and backward order and W threshold,
# with and without reserve, not alternating; each with both routings) over 24 failure cases
# (D x S x M in 4x4x8, 4x8x8, 3x5x5, 3x6x12, 4x6x6, 2x4x8; one and two random failures; unit and F=2 B=3 W=1 costs;
# V layout, coupled, a cap of S full-stage activations). Most reserve: a survivor holds two pipelines' chunks, and
# the greedy rules then often deadlock or fill the cap with shallow chunks.
FAILURE_VARIANTS = (
    ChunkVariant("deep", "deep", w_first_at=2, reserve=True),
    ChunkVariant("mb", "mb", w_first_at=1),
    ChunkVariant("deep", "ready", reserve=True),
    ChunkVariant("deep", "ready", w_first_at=1 << 20, reserve=True),
    ChunkVariant("mb", "ready", reserve=True),
    ChunkVariant("deep", "deep", w_first_at=1, reserve=True),
    ChunkVariant("ready", "ready"),
    ChunkVariant("ready", "ready", w_first_at=1 << 20),
    ChunkVariant("deep", "ready", w_first_at=2, reserve=True),
    ChunkVariant("mb", "mb", reserve=True),
    # Greedy rules that keep one chunk activation of the cap for later chunks (`guard`): a greedy cover of the 120
    # guard-1 rules (every forward and backward order, W threshold 0-2, alternating or not; no reserve) over a
    # sweep held out from benchmarks/bench_chunks.py (benchmarks/chunk_guard_sweep.py: D x S x M in 4x4x8, 3x5x5,
    # 4x6x6, 2x4x8, 3x4x8, 4x5x10; one and two random failures, seed 7; unit and F=2 B=3 W=1 costs; V layout,
    # coupled, a cap of S full-stage activations; the guard rules on the id-order routing and the canonical one),
    # in the order picked, each gaining at least one time unit over the sweep (the sum of the 24 best periods:
    # 1,460.5 without guard rules, 1,424.5 with these five, 1,423 with all 120). Where reserve holds a
    # micro-batch's deep chunks' room from its admission on, the guard holds one slot for all of them.
    ChunkVariant("deep", "deep", alternate=True, guard=1),
    ChunkVariant("deep", "round", alternate=True, guard=1),
    ChunkVariant("ready", "round", w_first_at=1, guard=1),
    ChunkVariant("deep", "mb", w_first_at=1, alternate=True, guard=1),
    ChunkVariant("ready", "deep", alternate=True, guard=1),
)


def chunk_caps(config: Config, options: PlannerOptions) -> tuple[int, ...] | None:
    """The activation cap per stage in chunk activations: `--memory-cap N` means N full-stage activations per worker
    and a chunk's activation is 1/C of one, so N x C chunk activations (None: unlimited)."""
    caps = memory_cap(config, options)
    C = config.topology.chunks_per_worker
    return None if caps is None else tuple(c * C for c in caps)


def chunked_routing(config: Config, failed: frozenset[tuple[int, int]], slot_major: bool = False,
                    rotate: bool = False) -> tuple[tuple[int, ...], ...]:
    """host[chunk][mb]: a failed worker's micro-batches go, for every chunk it held, to the same chunks on its live
    peers; only the failed workers' micro-batches move and the loads of a stage's survivors differ by at most one.

    Each chunk's orphans are dealt round-robin over the live replicas of its worker's stage like the one-chunk
    traffic-aware routing (in id order, or (slot, owner) order with `slot_major`). Without `rotate` every chunk of a
    worker takes the same deal (a micro-batch's chunks on the dead worker all go to one peer); with it the j-th
    chunk of a worker starts the deal j survivors further, so they go to different peers (spread over time).
    """
    t = config.topology
    D, S, M = t.num_replicas, t.num_stages, config.num_microbatches
    where = chunk_workers(S, t.chunks_per_worker, t.chunk_layout)
    per_stage = failed_routing(config, failed, slot_major)  # also refuses a stage with no live replica
    rows = []
    for v, w in enumerate(where):
        shift = where[:v].count(w) if rotate else 0
        live = [p for p in range(D) if (p, w) not in failed]
        # the deal gave the i-th orphan live[i mod n]; rotated, it gets live[(i + shift) mod n]
        rows.append(tuple(h if (mb // M, w) not in failed else live[(live.index(h) + shift) % len(live)]
                          for mb, h in enumerate(per_stage[w])))
    return tuple(rows)


def canonical_chunked_routing(config: Config, failed: frozenset[tuple[int, int]]) -> tuple[tuple[int, ...], ...]:
    """host[chunk][mb]: the one-chunk planner's canonical routing of the failure set's key (`balanced_routing`),
    relabelled onto the real ranks per stage like `FailureState.to_real`, every chunk taking its worker's row.

    Micro-batch ids keep their owners, so this also moves healthy micro-batches through other pipelines' workers of
    the same stage (what `make_plan` falls back to for one chunk when that is faster); `schedule_chunked` tries it
    for non-nested failure sets only.
    """
    t = config.topology
    state = normalize(failed, t.num_replicas, t.num_stages)
    canonical = balanced_routing(config.one_chunk(), state.key)
    real = [tuple(state.perm[s][c] for c in row) for s, row in enumerate(canonical)]
    return tuple(real[w] for w in chunk_workers(t.num_stages, t.chunks_per_worker, t.chunk_layout))


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
    # reserve: the chunks each micro-batch runs on each worker (its footprint), and what admitted ones hold there
    footprint: list[dict[int, int]] = []
    if variant.reserve:
        for mb in range(total):
            counts: dict[int, int] = {}
            for v in range(V):
                counts[rank(v, mb)] = counts.get(rank(v, mb), 0) + 1
            footprint.append(counts)
            worst = max(counts.items(), key=lambda kv: kv[1] - limit[kv[0]])
            if worst[1] > limit[worst[0]]:
                raise PlanError(f"micro-batch {mb} runs {worst[1]} chunks on worker {worst[0] // S}:{worst[0] % S}, "
                                f"more than its cap of {limit[worst[0]]} chunk activations; raise --memory-cap")
    reserved = [0] * n
    entries = sorted({rank(0, mb) for mb in range(total)})  # the workers that run chunk 0

    opening: dict[tuple[int, int], int] = {}  # (rank, mb) -> the micro-batch's first chunk on that worker
    if variant.guard:
        for v in range(V - 1, -1, -1):
            for mb in range(total):
                opening[(rank(v, mb), mb)] = v

    def admissible(r: int, item: tuple[float, Kind, int, int]) -> bool:
        if not variant.reserve:
            if variant.guard and opening[(r, item[3])] == item[2]:
                return held[r] < limit[r] - variant.guard
            return held[r] < limit[r]
        if item[2] > 0:
            return True  # reserved when the micro-batch was admitted
        return all(reserved[q] + k <= limit[q] for q, k in footprint[item[3]].items())

    def f_key(item: tuple[float, Kind, int, int]) -> tuple:
        ready, _, v, mb = item
        if variant.forward_order == "deep":
            return (-v, mb)
        if variant.forward_order == "mb":
            return (mb, -v)
        if variant.forward_order == "shallow":
            return (v, mb)
        if variant.forward_order == "round":
            return (mb // S, v, mb)
        return (ready, -v, mb)

    def b_key(item: tuple[float, Kind, int, int]) -> tuple:
        ready, _, v, mb = item
        if variant.backward_order == "deep":
            return (v, mb)
        if variant.backward_order == "mb":
            return (mb, v)
        if variant.backward_order == "round":
            return (mb // S, -v, mb)
        return (ready, v, mb)

    while wake:
        now, _, r = heapq.heappop(wake)
        if free[r] > now or todo[r] == 0:
            continue
        ready = [it for it in pending[r] if it[0] <= now]
        backs = [it for it in ready if it[1] is back]
        fwds = [it for it in ready if it[1] is Kind.F and admissible(r, it)]
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
            if variant.reserve and v == 0:
                for q, k in footprint[mb].items():
                    reserved[q] += k
            nxt.append((Kind.F, v + 1) if v + 1 < V else (back, v))
        elif kind is Kind.B or kind is Kind.BW:
            if kind is Kind.BW:
                held[r] -= 1
                reserved[r] -= 1
            else:
                nxt.append((Kind.W, v))
            if v > 0:
                nxt.append((back, v - 1))
        else:
            held[r] -= 1
            reserved[r] -= 1
        if variant.reserve and kind is not Kind.F and kind is not Kind.B:
            # room freed here may admit a micro-batch at a pipeline entry elsewhere: let the entries look again
            for q in entries:
                heapq.heappush(wake, (end, seq, q))
                seq += 1
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
                     variants: Sequence[ChunkVariant] | None = None) -> Plan:
    """The best plan over the variants (default: CHUNK_VARIANTS, with FAILURE_VARIANTS too when workers failed) and
    three routings (chunked_routing: orphans in id order, in slot order, and in id order rotated per chunk), by
    simulated period, then the lower peak. A non-nested failure set also tries the key's canonical routing
    relabelled per stage (canonical_chunked_routing), taken only when its period is strictly lower; it moves healthy
    micro-batches, and the plan's meta.routing_fallback says so (as make_plan's one-chunk fall-back does). `caps`
    (chunk activations per stage) overrides the options' cap (chunk_caps); the plan is validated and its meta
    carries the simulator's period and makespan."""
    failed_set = frozenset(failed)
    if variants is None:
        variants = CHUNK_VARIANTS + FAILURE_VARIANTS if failed_set else CHUNK_VARIANTS
    if caps is None:
        caps = chunk_caps(config, options)
    routings = [chunked_routing(config, failed_set)]
    canonical: tuple[tuple[int, ...], ...] | None = None
    if failed_set:
        for other in (chunked_routing(config, failed_set, slot_major=True),
                      chunked_routing(config, failed_set, rotate=True)):
            if other not in routings:
                routings.append(other)
        if not normalize(failed_set, config.num_replicas, config.num_stages).symmetric:
            canonical = canonical_chunked_routing(config, failed_set)
            canonical = canonical if canonical not in routings else None
    errors: list[str] = []
    best = _best_schedule(config, failed_set, options, caps, variants, routings, errors)
    fallback = ""
    if canonical is not None:
        other = _best_schedule(config, failed_set, options, caps, variants, [canonical], errors)
        if other is not None and (best is None or other[2].period < best[2].period - 1e-9):
            fallback = (_fallback_reason(config, other, best, failed_set) if best is not None else
                        "canonical routing: no rule fits the cap on the traffic-aware routings")
            best = other
    if best is None:
        raise PlanError(f"no chunked schedule fits the memory cap: {errors[0]}")
    _, plan, result = best
    validate_plan(plan)
    key = tuple(sum(1 for p in range(config.num_replicas) if (p, s) in failed_set)
                for s in range(config.num_stages))
    cap_full = memory_cap(config, options)
    notes = (f"chunked list schedule, {config.topology.chunks_per_worker} chunks per worker "
             f"({config.topology.chunk_layout} layout), rule {plan.meta.notes}")
    return plan.with_meta(failure_key=key, predicted_period=result.period, predicted_makespan=result.makespan,
                          lower_bound=chunked_lower_bound(config, failed_set, options), status="FEASIBLE",
                          memory_cap=cap_full or (), config_fingerprint=config.fingerprint(),
                          routing_fallback=fallback,
                          notes=notes + ("; canonical routing: faster than traffic-aware" if fallback else ""))


_Scored = tuple[tuple[float, int], Plan, SimResult]


def _best_schedule(config: Config, failed: frozenset[tuple[int, int]], options: PlannerOptions,
                   caps: Sequence[int] | None, variants: Sequence[ChunkVariant],
                   routings: Sequence[Sequence[Sequence[int]]], errors: list[str]) -> _Scored | None:
    """The best (rank key, plan, simulation) over every rule and routing; rules that stall add to `errors`."""
    best: _Scored | None = None
    for host in routings:
        for variant in variants:
            try:
                plan = list_schedule_chunked(config, failed, host, options.decoupled, options.staggered, caps,
                                             variant)
            except PlanError as exc:
                errors.append(str(exc))
                continue
            result = simulate(plan, config)
            if best is None or _rank_key(result) < best[0]:
                best = (_rank_key(result), plan, result)
    return best


def _fallback_reason(config: Config, chosen: _Scored, traffic_best: _Scored, failed: frozenset[tuple[int, int]]
                     ) -> str:
    """Why the canonical routing was taken, in make_plan's words: both periods and the healthy work it moves."""
    plan = chosen[1]
    faster, period = chosen[2].period, traffic_best[2].period
    moved = traffic(plan.host, config.num_microbatches, failed, stage_of=plan.chunk_stages)["moved_healthy"]
    return (f"canonical routing: period {faster:g} beats the traffic-aware plan's {period:g} "
            f"({100 * (period - faster) / faster:.1f} % slower), at the price of moving {moved} healthy "
            "(chunk, micro-batch) pairs off their pipeline")
