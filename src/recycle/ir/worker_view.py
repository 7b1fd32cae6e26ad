"""A worker's view of a plan: the part one worker needs to run it (its own actions, the action lists of the workers
that send to it, whose order is its receive order, and the routing as the few entries that differ from each micro-
batch's owner), so that a recovery at thousands of workers sends each a few KB instead of the whole plan."""

from __future__ import annotations

import json
from dataclasses import replace
from functools import lru_cache
from typing import Any

from recycle.errors import PlanError
from recycle.inputs import json_list, json_object, strict_json_loads
from recycle.ir.actions import Kind
from recycle.ir.dependencies import input_stage_table
from recycle.ir.plan import Plan

__all__ = ["worker_view", "PlanViews", "read_worker_view", "view_json", "view_rows"]


def _senders(plan: Plan, rank: int) -> set[int]:
    """`rank` and every worker whose message one of `rank`'s actions waits for."""
    # input_stage and chunk_rank inlined through tables: a recovery at 16,384 workers walks 280,000 actions here, on
    # the path to its announcement (every view's JSON: 0.21 s of CPU with the calls, 0.09 s without).
    source = _input_stages(plan.num_chunks)
    host, chunk_stages, num_stages = plan.host, plan.chunk_stages, plan.num_stages
    keep = {host[src][action.mb] * num_stages + chunk_stages[src] for action in plan.actions[rank]
            if (src := source[action.kind][action.stage]) >= 0}
    keep.add(rank)
    return keep


@lru_cache(maxsize=16)
def _input_stages(num_chunks: int) -> dict[Kind, tuple[int, ...]]:
    """input_stage of every (kind, chunk), -1 for none."""
    kinds = tuple(Kind)
    return dict(zip(kinds, input_stage_table(kinds, num_chunks)))


def worker_view(plan: Plan, rank: int) -> Plan:
    """`plan` with every action list but `rank`'s and its senders' left empty: the executor, the transport and the
    evaluation of worker `rank` run it exactly as the whole plan (they read nothing else of other workers)."""
    keep = _senders(plan, rank)
    return replace(plan, actions=tuple(acts if r in keep else () for r, acts in enumerate(plan.actions)))


class PlanViews:
    """Every live worker's view of one plan as JSON, with what they share (the routing's exceptions, the metadata,
    each worker's action tokens) encoded once. Given the `previous` generation's views, a worker's action tokens
    whose list did not change are taken from them (a recovery changes a few workers' lists of thousands)."""

    def __init__(self, plan: Plan, previous: PlanViews | None = None) -> None:
        self.plan = plan
        # Without host and actions: to_dict would encode every action token of the plan, half the cost, to drop it.
        whole = replace(plan, host=(), actions=()).to_dict()
        del whole["host"], whole["actions"]
        owners = [plan.owner(mb) for mb in range(len(plan.host[0]))] if plan.host else []  # (once, not per stage)
        moved = [[s, mb, replica] for s, row in enumerate(plan.host) for mb, (replica, owner) in
                 enumerate(zip(row, owners)) if replica != owner]
        self._shared = json.dumps(whole, separators=(",", ":"))[:-1] + ',"host_moved":' \
            + json.dumps(moved, separators=(",", ":"))
        self._lines: dict[int, str] = {}
        if previous is not None and len(previous.plan.actions) == len(plan.actions):
            before = previous.plan.actions
            # (a tuple comparison in C, element identity first: a plan made from the last one shares its Actions)
            self._lines = {rank: line for rank, line in previous._lines.items()
                           if before[rank] == plan.actions[rank]}

    def prepare(self) -> PlanViews:
        """Encode every worker's action tokens now (before a failure: the next generation's views reuse them)."""
        for rank in range(len(self.plan.actions)):
            self._line(rank)
        return self

    def _line(self, rank: int) -> str:
        line = self._lines.get(rank)
        if line is None:
            line = self._lines[rank] = json.dumps(" ".join(str(a) for a in self.plan.actions[rank]))
        return line

    def json_for(self, rank: int) -> str:
        """Worker `rank`'s view, for read_worker_view."""
        return view_json(self._shared, rank, "view_actions", {r: self._line(r) for r in _senders(self.plan, rank)})


def view_json(shared: str, rank: int, field: str, rows: dict[int, str]) -> str:
    """A worker's view: `shared` (a JSON object's text without its closing brace, the same for every worker), then
    whose view it is and its rows ({"RANK": row}, each row already JSON) under `field`."""
    encoded = ",".join(f'"{r}":{rows[r]}' for r in sorted(rows))
    return f'{shared},"view_of":{rank},"{field}":{{{encoded}}}}}'


def view_rows(raw: dict[str, Any], field: str, rank: int, num_workers: int, empty: Any) -> list[Any]:
    """The rows of the view view_json wrote, one per worker (`empty` for the ranks it leaves out), after checking
    that it is worker `rank`'s and that every rank in it is one of the `num_workers`; ValueError otherwise."""
    if raw.get("view_of") != rank:
        raise ValueError(f"it is not worker {rank}'s view")
    rows = [empty] * num_workers
    for key, row in json_object(raw[field]).items():
        if not (key.isdigit() and int(key) < num_workers):
            raise ValueError(f"worker {key!r} is outside the plan's {num_workers} workers")
        rows[int(key)] = row
    return rows


def read_worker_view(text: str | bytes, rank: int) -> Plan:
    """The view PlanViews.json_for(rank) wrote, checked as strictly as a whole plan (it comes from the job store):
    a Plan whose other workers' lists are empty."""
    try:
        raw = strict_json_loads(text)
        if not isinstance(raw, dict):
            raise ValueError("not a JSON object")
        moved = raw.pop("host_moved")
        D, S, M, chunks = (_whole(raw.get(k, 1 if k == "chunks" else None))
                           for k in ("num_replicas", "num_stages", "num_microbatches", "chunks"))
        if D * S * M * chunks > 1 << 26:
            raise ValueError(f"its shape {D} x {S} x {M} x {chunks} is too large")
        owners = [source // M for source in _sources(raw.get("pieces", []), D * M)]
        host = [list(owners) for _ in range(S * chunks)]
        for entry in json_list(moved):
            s, mb, replica = json_list(entry)
            if not (_index(s, S * chunks) and _index(mb, len(owners)) and _index(replica, D)):
                raise ValueError(f"routing entry {entry!r} is outside the plan's shape")
            host[s][mb] = replica
        raw["host"], raw["actions"] = host, view_rows(raw, "view_actions", rank, D * S, "")
        del raw["view_of"], raw["view_actions"]
        return Plan.from_dict(raw)
    except PlanError:
        raise
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise PlanError(f"worker {rank}'s view of the plan is malformed ({type(exc).__name__}: {exc}); the "
                        "coordinator and the workers must run the same recycle version") from None


def _sources(pieces: Any, total: int) -> list[int]:
    """The data micro-batch of every micro-batch id (a split plan's pieces; Plan.from_dict checks them in full)."""
    if not pieces:
        return list(range(total))
    sources = [json_list(p)[0] for p in json_list(pieces)]
    if not all(_index(source, total) for source in sources):
        raise ValueError(f"a piece's micro-batch is outside [0, {total})")
    return sources


def _whole(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"its shape {str(value)[:40]!r} is not whole numbers >= 1")
    return value


def _index(value: Any, size: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < size
