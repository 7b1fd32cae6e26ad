"""The one plan validator used at every boundary: routing, coverage, per-worker order, and a deadlock dry run."""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable

from recycle.errors import PlanError
from recycle.ir.actions import Action, Kind
from recycle.ir.dependencies import boundary, input_stage, producer, producer_kind
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
    src = plan.rank(plan.host[source.stage][action.mb], source.stage)
    return [(src, source, boundary(action.stage, source.stage))]


def check_plan_matches(plan: Plan, num_replicas: int, num_stages: int, num_microbatches: int,
                       source: str = "the plan") -> None:
    """Raise PlanError unless the plan was made for this D, S, M."""
    got = (plan.num_replicas, plan.num_stages, plan.num_microbatches)
    want = (num_replicas, num_stages, num_microbatches)
    if got != want:
        raise PlanError(f"{source} is for D={got[0]}, S={got[1]}, M={got[2]} but the config has D={want[0]}, "
                        f"S={want[1]}, M={want[2]}; make the plan from this config (recycle plan/schedule "
                        "--config ...) or pass the config the plan was made for")


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
    total = D * M
    if D < 1 or S < 1 or M < 1:
        raise PlanError(f"plan has num_replicas={D}, num_stages={S}, num_microbatches={M}; all must be >= 1")
    if len(plan.actions) != D * S:
        raise PlanError(f"plan has {len(plan.actions)} worker lists but D*S = {D * S}; give one list per worker")
    if len(plan.host) != S or any(len(row) != total for row in plan.host):
        raise PlanError(f"plan routing must be host[stage][mb] with {S} rows of {total} entries")
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
    total = plan.num_replicas * plan.num_microbatches
    pos: dict[tuple[Kind, int], int] = {}
    opts = [i for i, a in enumerate(acts) if a.kind is Kind.OPT]
    if len(opts) != 1 or opts[0] != len(acts) - 1:
        raise _fail(plan, f"worker ({replica},{stage}) must end with exactly one {stage}OPT (found "
                          f"{len(opts)} at positions {opts} of {len(acts)})", [(rank, i) for i in opts])
    host_row = plan.host[stage]
    F, B, W, BW, OPT = Kind.F, Kind.B, Kind.W, Kind.BW, Kind.OPT
    for i, a in enumerate(acts):
        kind, mb = a.kind, a.mb
        if a.stage != stage:
            raise _fail(plan, f"action {a} on worker ({replica},{stage}) is for stage {a.stage}; a worker "
                              "only runs its own stage", [(rank, i)])
        if kind is OPT:
            continue
        if not 0 <= mb < total:
            raise _fail(plan, f"action {a}: micro-batch {mb} is outside [0, {total})", [(rank, i)])
        key = (kind, stage, mb)
        if key in seen:
            other = seen[key]
            raise _fail(plan, f"micro-batch {mb} is processed twice at stage {stage}: {a} appears on worker "
                              f"{plan.worker(other[0])} and worker ({replica},{stage})", [other, (rank, i)])
        seen[key] = (rank, i)
        if host_row[mb] != replica:
            raise _fail(plan, f"action {a} runs on replica {replica} but host[{stage}][{mb}] = "
                              f"{host_row[mb]}; all actions of a micro-batch at a stage run on its host",
                        [(rank, i)])
        # Same-worker order: F before B/BW, B before W (checked as each action is met in list order).
        if kind is F:
            pos[(F, mb)] = i
            continue
        if (F, mb) not in pos:
            raise _fail(plan, f"{stage}{kind.value}{mb} on worker ({replica},{stage}) comes before its "
                              f"forward {stage}F{mb} (or has none here); order must be F before B before W",
                        [(rank, i)])
        if kind is W and (B, mb) not in pos:
            raise _fail(plan, f"{stage}W{mb} on worker ({replica},{stage}) needs {stage}B{mb} earlier on "
                              "the same worker", [(rank, i)])
        if kind is BW and (B, mb) in pos:
            raise _fail(plan, f"micro-batch {mb} at stage {stage} has both a fused BW and a B", [(rank, i)])
        pos[(kind, mb)] = i
    _check_halves(plan, rank, pos)


def _check_halves(plan: Plan, rank: int, pos: dict[tuple[Kind, int], int]) -> None:
    """Every decoupled B on the worker has its W, and no micro-batch has both a B and a fused BW."""
    replica, stage = plan.worker(rank)
    for (kind, mb), i in pos.items():
        if kind is Kind.B and (Kind.W, mb) not in pos:
            raise _fail(plan, f"{stage}B{mb} on worker ({replica},{stage}) has no matching {stage}W{mb}; a "
                              "decoupled backward needs both halves", [(rank, i)])
        if kind is Kind.B and (Kind.BW, mb) in pos:
            raise _fail(plan, f"micro-batch {mb} at stage {stage} has both a fused BW and a B", [(rank, i)])


def _check_coverage(plan: Plan, seen: dict[tuple[Kind, int, int], tuple[int, int]]) -> None:
    """Every micro-batch exactly once per stage, routed to a live replica, with its forward and a backward."""
    D = plan.num_replicas
    for s in range(plan.num_stages):
        for mb in range(D * plan.num_microbatches):
            h = plan.host[s][mb]
            if h < 0 or h >= D:
                raise _fail(plan, f"micro-batch {mb} has no forward at stage {s} (host[{s}][{mb}] = {h}); every "
                                  "micro-batch must be processed exactly once per stage")
            if (h, s) in plan.failed:
                raise _fail(plan, f"host[{s}][{mb}] = {h} but worker ({h},{s}) is failed; route it to a live "
                                  f"replica of stage {s}: {plan.live_replicas(s)}")
            if (Kind.F, s, mb) not in seen:
                raise _fail(plan, f"micro-batch {mb} has no forward {s}F{mb} on its host ({h},{s})")
            if (Kind.BW, s, mb) not in seen and (Kind.B, s, mb) not in seen:
                raise _fail(plan, f"micro-batch {mb} has no backward ({s}B{mb} or {s}BW{mb}) at stage {s}",
                            [seen[(Kind.F, s, mb)]])


def _dry_run(plan: Plan) -> None:
    """Execute the lists in order, ignoring time; raise with the blocked heads marked if no worker can progress."""
    n, S = plan.num_workers, plan.num_stages
    decoupled = plan.decoupled_pairs
    ptr = [0] * n
    done: set[tuple[Kind, int, int]] = set()  # compute actions are unique per (kind, stage, mb) in a valid plan
    waiting: dict[tuple[Kind, int, int], list[int]] = defaultdict(list)
    # The dependency rule tabled for the loop: (input stage, producer kind if decoupled there, if fused there).
    rule = {k: [(input_stage(k, s, S), producer_kind(k, True), producer_kind(k, False)) for s in range(S)]
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
