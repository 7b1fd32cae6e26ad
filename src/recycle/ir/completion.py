"""Finishing an interrupted iteration: survivors keep their work, only what died with the failed workers is redone.

A failure stops every survivor somewhere in iteration k (or, past its own optimizer step of k, in k + 1). The
classic recovery throws the iteration away and runs it again on the new plan. Here the survivors keep what they
computed: the weight-gradients they accumulated, the graphs of their forwards, the output-gradients they took
delivery of, and a log of the tensors they sent. `complete_iteration` derives, from the old plan, each survivor's
progress and the new plan's routing, the smallest set of steps that finishes iteration k exactly:

- every (stage, micro-batch) cell whose weight-gradient is not held by a survivor (its host died, or had not got
  there) is computed, on its old host if alive, else on the new plan's host;
- a message a needed step waits for is re-sent from its producer's log when the producer survived and had sent it,
  else produced by recomputing the producer (which can cascade up or down the pipeline);
- each stage that had not stepped iteration k steps it once, over its live replicas.

A stage that had already stepped iteration k keeps its step; when a message it had sent died unread with the broken
generation, it computes that forward or input-gradient again with its weights from before the step (its roll-back
snapshot). The per-rank order comes from one list schedule of the whole step graph (unit times), so every rank's
sequence is a projection of one global order: no rank waits on a message whose sender is blocked behind it. Cases
the completion cannot finish exactly (a stage whose replicas disagree on whether they stepped, a stage stepped alone
although the step is collective, ...) return the reason instead, and the caller redoes the whole iteration.
"""

from __future__ import annotations

import heapq
import itertools
import json
from dataclasses import dataclass
from typing import Any, Mapping

from recycle.collector import collector_paused
from recycle.errors import PlanError
from recycle.inputs import json_list, strict_json_loads
from recycle.ir.actions import Kind
from recycle.ir.plan import Plan
from recycle.ir.worker_view import view_json, view_rows

__all__ = ["WorkerProgress", "Step", "Completion", "CompletionViews", "complete_iteration", "SEND_ACTIVATION",
           "SEND_GRADIENT"]

SEND_ACTIVATION = "SA"  # re-send a logged forward output downstream
SEND_GRADIENT = "SG"  # re-send a logged input-gradient upstream
_KINDS = ("F", "B", "W", "OPT", SEND_ACTIVATION, SEND_GRADIENT)
_PRIORITY = {SEND_ACTIVATION: 0, SEND_GRADIENT: 0, "B": 1, "F": 2, "W": 3, "OPT": 4}


@dataclass(frozen=True)
class WorkerProgress:
    """How far a surviving worker got in the broken generation (from its stop report)."""

    rank: int
    applied: int  # the last iteration whose optimizer step it applied
    iteration: int  # the iteration it was running
    finished: int  # actions of `iteration` it had finished
    weighed_current: bool = False  # its unfinished action is a BW whose weight-gradient it had already accumulated
    reducing: bool = False  # it stopped in its OPT after the stage all-reduce: its .grad holds sums, it drops them


@dataclass(frozen=True)
class Step:
    """One step of a completion: compute `kind` of micro-batch `mb` at `stage` (F, B, W, OPT), receiving its input
    from rank `src` first and sending its output to rank `dst` (-1: none); or re-send the logged activation
    (SA) or input-gradient (SG) of `mb` to `dst`."""

    kind: str
    stage: int
    mb: int = -1
    src: int = -1
    dst: int = -1

    def __str__(self) -> str:
        route = (f" <- {self.src}" if self.src >= 0 else "") + (f" -> {self.dst}" if self.dst >= 0 else "")
        return f"{self.stage}{self.kind}{self.mb if self.mb >= 0 else ''}{route}"


@dataclass(frozen=True)
class Completion:
    """The steps each rank runs to finish `iteration` in the new generation (empty for ranks not in it)."""

    iteration: int
    steps: tuple[tuple[Step, ...], ...]
    # Stages that had stepped the iteration: they re-send from their logs, and compute a lost forward or
    # input-gradient again with their weights from before that step; they run no W and no OPT of it.
    applied_stages: tuple[int, ...]
    redone_actions: int  # work done before and run again: survivors' dropped next-iteration actions + `lost_actions`
    # The failed workers' actions of the iteration that may have finished (an upper bound: their lost work).
    lost_actions: int
    rerouted_actions: int  # compute steps run for cells whose host died
    resent: int  # messages re-sent from a survivor's log

    @property
    def num_steps(self) -> int:
        return sum(len(s) for s in self.steps)

    def to_json(self) -> str:
        return json.dumps({
            "iteration": self.iteration,
            "steps": [[[s.kind, s.stage, s.mb, s.src, s.dst] for s in rank] for rank in self.steps],
            "applied_stages": list(self.applied_stages),
            "redone_actions": self.redone_actions, "lost_actions": self.lost_actions,
            "rerouted_actions": self.rerouted_actions, "resent": self.resent,
        }, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, plan: Plan, rank: int | None = None) -> "Completion":
        """A completion for `plan`'s shape, every field checked (it comes from the job's store); with `rank`, the
        view CompletionViews wrote for that worker (its steps and its senders'; every other rank's left empty)."""
        try:
            raw = strict_json_loads(text)
            if not isinstance(raw, dict):
                raise ValueError("not a JSON object")
            counts = [_whole(raw[k], k) for k in ("iteration", "redone_actions", "lost_actions", "rerouted_actions",
                                                  "resent")]
            if rank is None:
                rows = raw["steps"]
            else:
                rows = view_rows(raw, "steps_of", rank, plan.num_workers, [])
            if not isinstance(rows, list) or len(rows) != plan.num_workers:
                raise ValueError(f"steps must list {plan.num_workers} ranks")
            steps = tuple(tuple(_step(item, plan) for item in json_list(row)) for row in rows)
            applied = tuple(_whole(s, "applied_stages") for s in json_list(raw["applied_stages"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise PlanError(f"the completion of an interrupted iteration is malformed ({exc}); the coordinator and "
                            "the workers must run the same recycle version") from None
        return cls(counts[0], steps, applied, *counts[1:])


class CompletionViews:
    """Every worker's view of a completion as JSON: its own steps and those of the ranks whose steps send to it (its
    receive order), so that each worker reads a few KB, not every rank's steps, after a failure at scale."""

    def __init__(self, completion: Completion) -> None:
        self.completion = completion
        self._senders: dict[int, set[int]] = {}
        for src, steps in enumerate(completion.steps):
            for step in steps:
                if step.dst >= 0:
                    self._senders.setdefault(step.dst, set()).add(src)
        counts = {k: getattr(completion, k) for k in ("iteration", "redone_actions", "lost_actions",
                                                      "rerouted_actions", "resent")}
        self._shared = json.dumps({**counts, "applied_stages": list(completion.applied_stages)},
                                  separators=(",", ":"))[:-1]
        self._rows: dict[int, str] = {}

    def _row(self, rank: int) -> str:
        row = self._rows.get(rank)
        if row is None:
            row = self._rows[rank] = json.dumps([[s.kind, s.stage, s.mb, s.src, s.dst]
                                                 for s in self.completion.steps[rank]], separators=(",", ":"))
        return row

    def encoded_views(self, ranks: list[int]) -> list[bytes]:
        """The views of `ranks` as the store holds them."""
        return [self.json_for(rank).encode() for rank in ranks]

    def json_for(self, rank: int) -> str:
        """Worker `rank`'s view, for Completion.from_json(text, plan, rank)."""
        return view_json(self._shared, rank, "steps_of",
                         {r: self._row(r) for r in self._senders.get(rank, set()) | {rank}})


def _whole(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < -1:
        raise ValueError(f"{where} {str(value)[:40]!r} is not a whole number")
    return value


def _step(item: Any, plan: Plan) -> Step:
    kind, stage, mb, src, dst = json_list(item)
    if kind not in _KINDS:
        raise ValueError(f"step kind {str(kind)[:20]!r} is not one of {', '.join(_KINDS)}")
    stage, mb, src, dst = (_whole(v, "step") for v in (stage, mb, src, dst))
    if stage >= plan.num_stages or mb >= plan.total_microbatches or max(src, dst) >= plan.num_workers:
        raise ValueError(f"step {item!r} is outside the plan's {plan.num_replicas}x{plan.num_stages} shape")
    return Step(kind, stage, mb, src, dst)


@dataclass
class _Cell:
    """What survives of one (stage, micro-batch) cell, and what the completion must do for it."""

    host: int  # rank that runs it in the completion (its old host if alive, else the new plan's)
    forward: bool = False  # a survivor holds its forward's graph
    grad_out: bool = False  # a survivor holds its output-gradient (B ran, W not yet)
    act_logged: bool = False  # its forward output is in a survivor's log
    grad_logged: bool = False  # its input-gradient is in a survivor's log
    weighed: bool = False  # its weight-gradient is in a survivor's .grad or in a stepped stage
    need_f: bool = False
    need_b: bool = False


def complete_iteration(old: Plan, new: Plan, iteration: int, progress: Mapping[int, WorkerProgress],
                       collective_step: bool = False, tied: bool = False) -> Completion | str:
    """The completion of `iteration` after the workers of `old` not in `progress` died, or why there is none.

    `progress` holds every survivor of `old`; `new` is the plan of the next generation (its routing places the dead
    workers' cells). `collective_step`: the optimizer step waits for every stage (coupled optimizer, or global-norm
    clipping), so no stage may have stepped alone. `tied`: the first and the last stage share a tied weight and step
    it together."""
    S, total = old.num_stages, old.total_microbatches
    if (new.num_replicas, new.num_stages, new.num_microbatches) != (old.num_replicas, S, old.num_microbatches):
        return "the new plan has another shape"
    if new.partition != old.partition:
        return "the new plan moves layers between stages"
    if old.pieces or new.pieces:  # the cells below are whole micro-batches: a split plan redoes the iteration
        return "a plan splits micro-batches into pieces"
    alive = set(progress)
    if not alive <= set(old.live_ranks()):
        return "a worker outside the broken generation reported"
    if any(old.worker(r) in new.failed for r in alive):
        return "the new plan drops a survivor"
    stepped: dict[int, bool] = {}
    for stage in range(S):
        flags = {progress[r].applied >= iteration for r in alive if old.worker(r)[1] == stage}
        if not flags:
            return f"stage {stage} has no surviving replica"
        if len(flags) > 1:
            return f"the replicas of stage {stage} disagree on whether they stepped iteration {iteration + 1}"
        stepped[stage] = flags.pop()
    if any(stepped.values()) and collective_step:
        return "a stage stepped alone although the optimizer step waits for every stage"
    if tied and stepped[0] != stepped[S - 1]:
        return "the tied first and last stages are on different sides of their step"
    if all(stepped.values()):
        return f"every stage had stepped iteration {iteration + 1}"
    for r in alive:
        p = progress[r]
        if p.applied < iteration - 1 or not iteration <= p.iteration <= iteration + 1 or \
                (p.iteration == iteration + 1 and p.applied < iteration):
            return f"rank {r} is at iteration {p.iteration + 1}, not at {iteration + 1}"
    if not any(stepped.values()) and not any(progress[r].finished for r in alive):
        return "no survivor had finished any work of the iteration"

    # Cells and tasks hold no cycles: on a coordinator holding many plans, full collections took a third of a
    # 16,384-rank completion, on the recovery's path.
    with collector_paused():
        cells = _cells(old, new, iteration, progress, stepped)
        _settle(cells, S, total)
        tasks = _tasks(old, cells, {r for r in alive if not stepped[old.worker(r)[1]]})
        order = _list_schedule(tasks, old.num_workers)
    if isinstance(order, str):
        return order
    dead = set(old.live_ranks()) - alive
    lost = sum(_possible_prefix(old, rank, cells, stepped, dead) for rank in sorted(dead))
    dropped = sum(p.finished for p in progress.values() if p.iteration == iteration + 1)
    # A stage that stepped has every weight-gradient of the iteration; what it computes again (with its pre-step
    # weights) is a forward or input-gradient whose message died with the broken generation: redone work too.
    again = sum(1 for t in tasks.values() if t.cell is not None and stepped[t.cell[0]])
    rerouted = sum(1 for t in tasks.values() if t.cell is not None and old.rank(old.host[t.cell[0]][t.cell[1]],
                                                                                    t.cell[0]) in dead)
    resent = sum(1 for t in tasks.values() if t.step.kind in (SEND_ACTIVATION, SEND_GRADIENT))
    return Completion(iteration, order, tuple(s for s in range(S) if stepped[s]), dropped + lost + again, lost,
                      rerouted, resent)


def _cells(old: Plan, new: Plan, iteration: int, progress: Mapping[int, WorkerProgress],
           stepped: Mapping[int, bool]) -> dict[tuple[int, int], _Cell]:
    """Every cell with what the survivors hold of it."""
    cells: dict[tuple[int, int], _Cell] = {}
    for stage in range(old.num_stages):
        for mb in range(old.total_microbatches):
            host = old.rank(old.host[stage][mb], stage)
            if host not in progress:
                host = new.rank(new.host[stage][mb], stage)
                cells[(stage, mb)] = _Cell(host, weighed=stepped[stage])
            else:
                cells[(stage, mb)] = _Cell(host)
    for rank, p in progress.items():
        actions = old.actions[rank]
        finished = actions if p.applied >= iteration else actions[:p.finished]
        done: dict[tuple[int, int], set[Kind]] = {}
        for action in finished:
            if action.kind is not Kind.OPT:
                done.setdefault((action.stage, action.mb), set()).add(action.kind)
        dropped = p.reducing and p.applied < iteration
        for key, kinds in done.items():
            cell = cells[key]
            backward = bool(kinds & {Kind.B, Kind.BW})
            weighed = bool(kinds & {Kind.W, Kind.BW})
            cell.act_logged = Kind.F in kinds and key[0] < old.num_stages - 1
            cell.grad_logged = backward and key[0] > 0
            if dropped:
                continue  # its gradients and graphs are gone: only its log of sent tensors stands
            cell.weighed = weighed
            cell.forward = Kind.F in kinds and not weighed
            cell.grad_out = backward and not weighed
        if p.applied < iteration and p.weighed_current and p.finished < len(actions):
            current = actions[p.finished]
            if current.kind is Kind.BW:  # its weight-gradient is in .grad, its graph freed, its send not done
                cell = cells[(current.stage, current.mb)]
                cell.weighed, cell.forward = True, False
    return cells


def _settle(cells: dict[tuple[int, int], _Cell], num_stages: int, total: int) -> None:
    """The fixed point of what must run: a cell's W needs its B (unless the output-gradient is held) and its
    forward's graph; a B or F that must run needs its input message, which comes from the producer's log or from
    running the producer again."""
    changed = True
    while changed:
        changed = False
        for stage in range(num_stages):
            for mb in range(total):
                cell = cells[(stage, mb)]
                lower = cells.get((stage - 1, mb))
                upper = cells.get((stage + 1, mb))
                need_w = not cell.weighed
                need_b = (need_w and not cell.grad_out) or \
                    (lower is not None and lower.need_b and not cell.grad_logged)
                need_f = ((need_b or need_w) and not cell.forward) or \
                    (upper is not None and upper.need_f and not cell.act_logged)
                if need_b != cell.need_b or need_f != cell.need_f:
                    cell.need_b, cell.need_f, changed = need_b or cell.need_b, need_f or cell.need_f, True


@dataclass
class _Task:
    step: Step
    rank: int
    cell: tuple[int, int] | None
    after: list[tuple[str, int, int]]  # keys of the tasks it waits for


def _tasks(old: Plan, cells: dict[tuple[int, int], _Cell], stepping: set[int]) -> dict[tuple[str, int, int], _Task]:
    """Every step of the completion, keyed (kind, stage, mb), with what it waits for."""
    tasks: dict[tuple[str, int, int], _Task] = {}
    for (stage, mb), cell in cells.items():
        lower, upper = cells.get((stage - 1, mb)), cells.get((stage + 1, mb))
        if upper is not None and upper.need_f and cell.act_logged:
            tasks[(SEND_ACTIVATION, stage, mb)] = _Task(Step(SEND_ACTIVATION, stage, mb, dst=upper.host), cell.host,
                                                        None, [])
        if lower is not None and lower.need_b and cell.grad_logged:
            tasks[(SEND_GRADIENT, stage, mb)] = _Task(Step(SEND_GRADIENT, stage, mb, dst=lower.host), cell.host,
                                                      None, [])
        if cell.need_f:
            src = lower.host if lower is not None else -1
            dst = upper.host if upper is not None and upper.need_f and not cell.act_logged else -1
            after = [(SEND_ACTIVATION if lower.act_logged else "F", stage - 1, mb)] if lower is not None else []
            tasks[("F", stage, mb)] = _Task(Step("F", stage, mb, src, dst), cell.host, (stage, mb), after)
        if cell.need_b:
            src = upper.host if upper is not None else -1
            dst = lower.host if lower is not None and lower.need_b and not cell.grad_logged else -1
            after = [(SEND_GRADIENT if upper.grad_logged else "B", stage + 1, mb)] if upper is not None else []
            if cell.need_f:
                after.append(("F", stage, mb))
            tasks[("B", stage, mb)] = _Task(Step("B", stage, mb, src, dst), cell.host, (stage, mb), after)
        if not cell.weighed:
            after = [(k, stage, mb) for k in ("F", "B") if (k, stage, mb) in tasks]
            tasks[("W", stage, mb)] = _Task(Step("W", stage, mb), cell.host, (stage, mb), after)
    by_rank: dict[int, list[tuple[str, int, int]]] = {}  # one pass, not one per stepping rank (quadratic at scale)
    for key, task in tasks.items():
        by_rank.setdefault(task.rank, []).append(key)
    for rank in sorted(stepping):
        stage = old.worker(rank)[1]
        tasks[("OPT", stage, rank)] = _Task(Step("OPT", stage), rank, None, by_rank.get(rank, []))
    return tasks


def _list_schedule(tasks: dict[tuple[str, int, int], _Task], num_ranks: int) -> tuple[tuple[Step, ...], ...] | str:
    """Each rank's steps in the order of one unit-time list schedule of all of them."""
    waiting = {key: len(task.after) for key, task in tasks.items()}
    for key, task in tasks.items():
        for dep in task.after:
            if dep not in tasks:
                return f"step {task.step} waits for {dep[0]} of micro-batch {dep[2]} at stage {dep[1]}, never run"
    users: dict[tuple[str, int, int], list[tuple[str, int, int]]] = {}
    for key, task in tasks.items():
        for dep in task.after:
            users.setdefault(dep, []).append(key)
    # Per rank, a heap of its ready steps by (priority, micro-batch, stage), ties by the order they became ready;
    # each tick looks only at the ranks that have one (a scan of every rank per tick was most of the time at scale).
    ready: dict[int, list[tuple[int, int, int, int, tuple[str, int, int]]]] = {}
    counter = itertools.count()

    def make_ready(key: tuple[str, int, int]) -> None:
        heapq.heappush(ready.setdefault(tasks[key].rank, []), (_PRIORITY[key[0]], key[2], key[1], next(counter), key))

    for key, count in waiting.items():
        if count == 0:
            make_ready(key)
    order: list[list[Step]] = [[] for _ in range(num_ranks)]
    left = len(tasks)
    while left:
        ran = [heapq.heappop(heap)[-1] for heap in ready.values() if heap]
        if not ran:
            stuck = sorted(str(tasks[k].step) for k, n in waiting.items() if n > 0)[:4]
            return f"the completion's steps wait on each other ({', '.join(stuck)})"
        for key in ran:
            task = tasks[key]
            order[task.rank].append(task.step)
            left -= 1
        for key in ran:  # the next tick sees what this one finished
            for user in users.get(key, ()):
                waiting[user] -= 1
                if waiting[user] == 0:
                    make_ready(user)
        for rank in [r for r, heap in ready.items() if not heap]:
            del ready[rank]
    return tuple(tuple(steps) for steps in order)


def _possible_prefix(old: Plan, rank: int, cells: Mapping[tuple[int, int], _Cell], stepped: Mapping[int, bool],
                     dead: set[int]) -> int:
    """How many of a dead worker's actions may have finished: all of them up to the first whose input a surviving
    producer had not sent yet (it cannot have got past that one), and never its OPT unless its stage stepped. An
    upper bound on its lost work, so that what is reported as redone is never less than what was."""
    if stepped[old.worker(rank)[1]]:
        return 0  # its stage stepped: its whole share of the iteration is in the applied step, nothing is lost
    actions = old.actions[rank]
    for index, action in enumerate(actions):
        if action.kind is Kind.F and action.stage > 0:
            producer, logged = (action.stage - 1, action.mb), "act_logged"
        elif action.kind in (Kind.B, Kind.BW) and action.stage < old.num_stages - 1:
            producer, logged = (action.stage + 1, action.mb), "grad_logged"
        else:
            continue
        if old.rank(old.host[producer[0]][producer[1]], producer[0]) in dead:
            continue  # a dead producer: whether it had sent is unknown, so assume it had
        if not getattr(cells[producer], logged):
            return index
    return len(actions) - 1  # its OPT did not finish: its stage has not stepped
