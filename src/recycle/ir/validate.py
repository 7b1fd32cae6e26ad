"""The one plan validator used at every boundary: routing, coverage, per-worker order, and a deadlock dry run."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from recycle.errors import PlanError
from recycle.ir.actions import Action, Kind
from recycle.ir.dependencies import boundary, input_stage, producer, producer_kind
from recycle.ir.pieces import check_pieces
from recycle.ir.plan import Plan

__all__ = ["validate_plan", "check_plan_matches", "format_grid", "dependencies", "opt_group"]


def format_grid(plan: Plan, marks: Iterable[tuple[int, int]] = (), max_cols: int = 40) -> str:
    """The per-worker action lists as a grid (one row per worker); cells in `marks` (rank, index) get >< around."""
    marked = set(marks)
    lines = []
    for rank in range(plan.num_workers):
        replica, stage = plan.worker(rank)
        acts = plan.actions[rank]
        label = f"({replica},{stage})"
        if (replica, stage) in plan.failed:
            lines.append(f"{label:>9} DOWN")
            continue
        cells = []
        for i, a in enumerate(acts):
            token = str(a)
            cells.append(f">{token}<" if (rank, i) in marked else token)
        focus = [i for (r, i) in marked if r == rank]
        start = 0
        if focus and len(cells) > max_cols:
            start = max(0, min(focus) - max_cols // 2)
        shown = cells[start:start + max_cols]
        prefix = "... " if start > 0 else ""
        suffix = " ..." if start + max_cols < len(cells) else ""
        lines.append(f"{label:>9} {prefix}{' '.join(shown)}{suffix}")
    return "\n".join(lines)


def _fail(plan: Plan, message: str, marks: Iterable[tuple[int, int]] = ()) -> PlanError:
    return PlanError(f"{message}\nplan (offending cells marked >like this<):\n{format_grid(plan, marks)}")


def dependencies(plan: Plan, action: Action) -> list[tuple[int, Action, int]]:
    """Cross-worker inputs of a compute action: (producer rank, producer action, stage boundary of the message).

    The producer is recycle.ir.dependencies.producer's; same-worker order (F before B before W) is the list order,
    checked separately.
    """
    source = producer(plan, action)
    if source is None:
        return []
    src = plan.chunk_rank(plan.host[source.stage][action.mb], source.stage)
    return [(src, source, boundary(action.stage, source.stage))]


def check_plan_matches(plan: Plan, num_replicas: int, num_stages: int, num_microbatches: int,
                       source: str = "the plan", chunks: int = 1, chunk_layout: str = "interleaved") -> None:
    """Raise PlanError unless the plan was made for this D, S, M (and chunks per worker and layout)."""
    got = (plan.num_replicas, plan.num_stages, plan.num_microbatches)
    want = (num_replicas, num_stages, num_microbatches)
    if got != want:
        raise PlanError(f"{source} is for D={got[0]}, S={got[1]}, M={got[2]} but the config has D={want[0]}, "
                        f"S={want[1]}, M={want[2]}; make the plan from this config (recycle plan/schedule "
                        "--config ...) or pass the config the plan was made for")
    layout = plan.chunk_layout if plan.chunks > 1 else "interleaved"
    if (plan.chunks, layout) != (chunks, chunk_layout if chunks > 1 else "interleaved"):
        raise PlanError(f"{source} is for {plan.chunks} chunk(s) per worker ({layout} layout) but the config has "
                        f"[topology] chunks_per_worker = {chunks}, chunk_layout = {chunk_layout!r}; make the plan "
                        "from this config or pass the config the plan was made for")


def opt_group(plan: Plan, rank: int) -> list[int]:
    """Ranks whose OPT must all be reached before this rank's OPT runs (its stage's all-reduce, or all if coupled)."""
    if plan.staggered:
        _, stage = plan.worker(rank)
        return [plan.rank(p, stage) for p in plan.live_replicas(stage)]
    return plan.live_ranks()


def validate_plan(plan: Plan) -> Plan:
    """Raise PlanError (with the grid, offending cells marked) unless the plan is well formed; return it."""
    _check_shape(plan)
    seen: dict[tuple[Kind, int, int], tuple[int, int]] = {}  # compute action -> (rank, index) where it runs
    for rank in range(len(plan.actions)):
        _check_worker(plan, rank, seen)
    _check_coverage(plan, seen)
    _dry_run(plan)
    return plan


def _check_shape(plan: Plan) -> None:
    """Sizes, the routing table's shape, failed workers inside the topology, a live replica in every stage."""
    D, S, M = plan.num_replicas, plan.num_stages, plan.num_microbatches
    total = plan.num_microbatch_ids
    if D < 1 or S < 1 or M < 1:
        raise PlanError(f"plan has num_replicas={D}, num_stages={S}, num_microbatches={M}; all must be >= 1")
    check_pieces(plan.pieces, plan.microbatch_size, D * M)
    if len(plan.actions) != D * S:
        raise PlanError(f"plan has {len(plan.actions)} worker lists but D*S = {D * S}; give one list per worker")
    rows = plan.num_chunks
    if len(plan.host) != rows or any(len(row) != total for row in plan.host):
        per = " (one per chunk)" if plan.chunks > 1 else ""
        raise PlanError(f"plan routing must be host[stage][mb] with {rows} rows{per} of {total} entries")
    for p, s in plan.failed:
        if not (0 <= p < D and 0 <= s < S):
            raise PlanError(f"failed worker ({p},{s}) is outside the {D}x{S} topology")
    for s in range(S):
        if not plan.live_replicas(s):
            raise PlanError(f"stage {s} has no live replica; its weights are lost and a checkpoint restore is needed")


def _check_worker(plan: Plan, rank: int, seen: dict[tuple[Kind, int, int], tuple[int, int]]) -> None:
    """One worker's list: its own stage, micro-batches in range and routed here, each action once, order F < B < W,
    exactly one OPT at the end (a failed worker: an empty list). Records each compute action in `seen`."""
    replica, stage = plan.worker(rank)
    acts = plan.actions[rank]
    if (replica, stage) in plan.failed:
        if acts:
            raise _fail(plan, f"worker ({replica},{stage}) is failed but has {len(acts)} actions; a failed "
                              "worker's list must be empty", [(rank, 0)])
        return
    total = plan.num_microbatch_ids
    pos: dict[tuple[Kind, int, int], int] = {}  # (kind, stage or chunk, mb) -> index in the list
    opts = [i for i, a in enumerate(acts) if a.kind is Kind.OPT]
    if len(opts) != 1 or opts[0] != len(acts) - 1:
        raise _fail(plan, f"worker ({replica},{stage}) must end with exactly one {stage}OPT (found "
                          f"{len(opts)} at positions {opts} of {len(acts)})", [(rank, i) for i in opts])
    chunk_stages, chunked = plan.chunk_stages, plan.chunks > 1
    F, B, W, BW, OPT = Kind.F, Kind.B, Kind.W, Kind.BW, Kind.OPT
    for i, a in enumerate(acts):
        kind, mb = a.kind, a.mb
        if kind is OPT:
            if a.stage != stage:
                raise _fail(plan, f"action {a} on worker ({replica},{stage}) is for stage {a.stage}; a worker "
                                  f"steps its own stage ({stage}OPT)", [(rank, i)])
            continue
        if not 0 <= a.stage < len(chunk_stages) or chunk_stages[a.stage] != stage:
            where = (f"; worker ({replica},{stage}) holds chunks "
                     f"{[v for v, w in enumerate(chunk_stages) if w == stage]}" if chunked else "")
            raise _fail(plan, f"action {a} on worker ({replica},{stage}) is for stage {a.stage}; a worker "
                              f"only runs its own stage{where}", [(rank, i)])
        host_row = plan.host[a.stage]
        stage_here = a.stage
        if not 0 <= mb < total:
            raise _fail(plan, f"action {a}: micro-batch {mb} is outside [0, {total})", [(rank, i)])
        key = (kind, stage_here, mb)
        if key in seen:
            other = seen[key]
            raise _fail(plan, f"micro-batch {mb} is processed twice at stage {stage_here}: {a} appears on worker "
                              f"{plan.worker(other[0])} and worker ({replica},{stage})", [other, (rank, i)])
        seen[key] = (rank, i)
        if host_row[mb] != replica:
            raise _fail(plan, f"action {a} runs on replica {replica} but host[{stage_here}][{mb}] = "
                              f"{host_row[mb]}; all actions of a micro-batch at a stage run on its host",
                        [(rank, i)])
        # Same-worker order: F before B/BW, B before W (checked as each action is met in list order).
        if kind is F:
            pos[(F, stage_here, mb)] = i
            continue
        if (F, stage_here, mb) not in pos:
            raise _fail(plan, f"{stage_here}{kind.value}{mb} on worker ({replica},{stage}) comes before its "
                              f"forward {stage_here}F{mb} (or has none here); order must be F before B before W",
                        [(rank, i)])
        if kind is W and (B, stage_here, mb) not in pos:
            raise _fail(plan, f"{stage_here}W{mb} on worker ({replica},{stage}) needs {stage_here}B{mb} earlier on "
                              "the same worker", [(rank, i)])
        if kind is BW and (B, stage_here, mb) in pos:
            raise _fail(plan, f"micro-batch {mb} at stage {stage_here} has both a fused BW and a B", [(rank, i)])
        pos[(kind, stage_here, mb)] = i
    _check_halves(plan, rank, pos)


def _check_halves(plan: Plan, rank: int, pos: dict[tuple[Kind, int, int], int]) -> None:
    """Every decoupled B on the worker has its W, and no micro-batch has both a B and a fused BW."""
    replica, _ = plan.worker(rank)
    for (kind, stage, mb), i in pos.items():
        if kind is Kind.B and (Kind.W, stage, mb) not in pos:
            raise _fail(plan, f"{stage}B{mb} on worker ({replica},{stage}) has no matching {stage}W{mb}; a "
                              "decoupled backward needs both halves", [(rank, i)])
        if kind is Kind.B and (Kind.BW, stage, mb) in pos:
            raise _fail(plan, f"micro-batch {mb} at stage {stage} has both a fused BW and a B", [(rank, i)])


def _check_coverage(plan: Plan, seen: dict[tuple[Kind, int, int], tuple[int, int]]) -> None:
    """Every micro-batch exactly once per stage, routed to a live replica, with its forward and a backward."""
    D = plan.num_replicas
    for s in range(plan.num_chunks):
        w = plan.chunk_stage(s)  # the worker's stage index (s itself unless chunked)
        for mb in range(plan.num_microbatch_ids):
            h = plan.host[s][mb]
            if h < 0 or h >= D:
                raise _fail(plan, f"micro-batch {mb} has no forward at stage {s} (host[{s}][{mb}] = {h}); every "
                                  "micro-batch must be processed exactly once per stage")
            if (h, w) in plan.failed:
                raise _fail(plan, f"host[{s}][{mb}] = {h} but worker ({h},{w}) is failed; route it to a live "
                                  f"replica of stage {w}: {plan.live_replicas(w)}")
            if (Kind.F, s, mb) not in seen:
                raise _fail(plan, f"micro-batch {mb} has no forward {s}F{mb} on its host ({h},{w})")
            if (Kind.BW, s, mb) not in seen and (Kind.B, s, mb) not in seen:
                raise _fail(plan, f"micro-batch {mb} has no backward ({s}B{mb} or {s}BW{mb}) at stage {s}",
                            [seen[(Kind.F, s, mb)]])


def _dry_run(plan: Plan) -> None:
    """Execute the lists in order, ignoring time; raise with the blocked heads marked if no worker can progress."""
    n, S, V = plan.num_workers, plan.num_stages, plan.num_chunks
    decoupled = plan.decoupled_pairs
    ptr = [0] * n
    done: set[tuple[Kind, int, int]] = set()  # compute actions are unique per (kind, stage, mb) in a valid plan
    waiting: dict[tuple[Kind, int, int], list[int]] = defaultdict(list)
    # The dependency rule tabled for the loop: (input stage, producer kind if decoupled there, if fused there).
    rule = {k: [(input_stage(k, s, V), producer_kind(k, True), producer_kind(k, False)) for s in range(V)]
            for k in Kind}
    live = [r for r in range(n) if plan.actions[r]]
    stage_groups = {s: [plan.rank(p, s) for p in plan.live_replicas(s)] for s in range(S)}
    groups = {r: (stage_groups[plan.worker(r)[1]] if plan.staggered else live) for r in live}
    at_opt: dict[int, int] = defaultdict(int)  # group id -> members waiting at their OPT
    ready = list(live)
    finished = 0
    while ready:
        rank = ready.pop()
        acts = plan.actions[rank]
        i = ptr[rank]
        while i < len(acts):
            a = acts[i]
            kind, s, mb = a.kind, a.stage, a.mb
            if kind is Kind.OPT:
                group = groups[rank]
                gid = id(group)
                at_opt[gid] += 1
                if at_opt[gid] == len(group):
                    for g in group:
                        ptr[g] += 1
                        finished += 1
                break
            source, if_decoupled, if_fused = rule[kind][s]
            if source is not None:
                dep = (if_fused if if_decoupled is if_fused or (source, mb) not in decoupled else if_decoupled,
                       source, mb)
                if dep not in done:
                    waiting[dep].append(rank)
                    break
            key = (kind, s, mb)
            done.add(key)
            i += 1
            ptr[rank] = i
            woken = waiting.pop(key, None)
            if woken:
                ready.extend(woken)
    if finished != len(live):
        heads = [(r, ptr[r]) for r in live if ptr[r] < len(plan.actions[r])]
        detail = []
        for r, i in heads[:6]:
            a = plan.actions[r][i]
            if a.kind is Kind.OPT:
                detail.append(f"{plan.worker(r)} waits at {a} for its all-reduce group")
            else:
                deps = ", ".join(f"{d} on {plan.worker(src)}" for src, d, _ in dependencies(plan, a))
                detail.append(f"{plan.worker(r)} waits at {a} for {deps}")
        raise _fail(plan, "plan deadlocks: no worker can make progress. " + "; ".join(detail), heads)
