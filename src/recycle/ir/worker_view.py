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

__all__ = ["worker_view", "PlanViews", "read_worker_view", "view_json", "view_tail", "view_rows"]


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
    each worker's action tokens) encoded once. Made from the `previous` generation's views (prepared), it encodes
    again only the views that changed: a recovery changes a few workers' lists of thousands, and with them the
    views of the workers they send to and of those whose senders moved; every other view's text after the shared
    part is taken as it was (the same bytes as made afresh: tested on random sequences of failures and joins)."""

    def __init__(self, plan: Plan, previous: PlanViews | None = None) -> None:
        self.plan = plan
        prior = previous if previous is not None and _same_shape(previous.plan, plan) else None
        # Without host and actions: to_dict would encode every action token of the plan, half the cost, to drop it.
        whole = replace(plan, host=(), actions=()).to_dict()
        del whole["host"], whole["actions"]
        owned_alike = prior is not None and prior.plan.pieces == plan.pieces
        self._owners: list[int]
        if prior is not None and owned_alike:
            self._owners = prior._owners
        else:  # (once, not per stage)
            self._owners = [plan.owner(mb) for mb in range(len(plan.host[0]))] if plan.host else []
        # The routing's exceptions row by row; a row the previous plan routed alike is taken from its views.
        self._moved: list[list[list[int]]] = [
            prior._moved[s] if prior is not None and owned_alike and prior.plan.host[s] == row
            else _moved_in(s, row, self._owners) for s, row in enumerate(plan.host)]
        moved = [entry for row in self._moved for entry in row]
        self._shared = (json.dumps(whole, separators=(",", ":"))[:-1] + ',"host_moved":'
                        + json.dumps(moved, separators=(",", ":"))).encode()
        self._lines: dict[int, str] = {}  # rank -> its action tokens as a JSON string
        self._tails: dict[int, bytes] = {}  # rank -> its view after the shared part
        # Kept from prepare() on, for the next generation's views: each rank's senders, the ranks each rank sends
        # to (itself included), and the ranks with an action on each micro-batch that waits for a message.
        self._senders: list[frozenset[int]] | None = None
        self._receivers: list[frozenset[int]] = []
        self._acting: list[tuple[int, ...]] = []
        if prior is not None and prior._senders is not None:
            self._carry(prior)
        elif prior is not None:  # (not prepared: only the tokens are reused)
            before = prior.plan.actions
            self._lines = {r: line for r, line in prior._lines.items() if before[r] == plan.actions[r]}

    def prepare(self) -> PlanViews:
        """Encode every worker's action tokens and view now, and note who sends to whom (off a recovery's path:
        the next generation's views are made from these)."""
        plan = self.plan
        if self._senders is None:
            self._senders = [frozenset(_senders(plan, r)) for r in range(plan.num_workers)]
            receivers: list[set[int]] = [set() for _ in range(plan.num_workers)]
            for rank, senders in enumerate(self._senders):
                for sender in senders:
                    receivers[sender].add(rank)
            self._receivers = [frozenset(r) for r in receivers]
            acting: list[list[int]] = [[] for _ in range(len(self._owners))]
            for rank in range(plan.num_workers):
                for mb in _waiting_mbs(plan, rank):
                    acting[mb].append(rank)
            self._acting = [tuple(ranks) for ranks in acting]
        for rank in plan.live_ranks():
            self._tail(rank)
        return self

    def _carry(self, previous: PlanViews) -> None:
        """Take over `previous`'s prepared views (of a plan of the same shape) where nothing they hold changed."""
        plan, before = self.plan, previous.plan
        assert previous._senders is not None
        # (a tuple comparison in C, element identity first: a plan made from the last one shares its Actions)
        changed = [r for r, (old, new) in enumerate(zip(before.actions, plan.actions)) if old != new]
        acting = list(previous._acting)
        for rank in changed:
            old_mbs, new_mbs = _waiting_mbs(before, rank), _waiting_mbs(plan, rank)
            for mb in old_mbs - new_mbs:
                acting[mb] = tuple(r for r in acting[mb] if r != rank)
            for mb in new_mbs - old_mbs:
                acting[mb] = acting[mb] + (rank,)
        rerouted: set[int] = set()  # micro-batches whose host changed at some stage
        for old_row, new_row in zip(before.host, plan.host):
            if old_row != new_row:
                rerouted.update(mb for mb, (a, b) in enumerate(zip(old_row, new_row)) if a != b)
        # Whose senders may have changed: the changed lists, and every rank with an action on a re-routed micro-batch.
        again = set(changed).union(*(acting[mb] for mb in rerouted))
        senders, receivers = list(previous._senders), list(previous._receivers)
        dirty = set(changed)
        for rank in again:
            new = frozenset(_senders(plan, rank))
            old = senders[rank]
            if new != old:
                senders[rank] = new
                dirty.add(rank)
                for sender in old - new:
                    receivers[sender] = receivers[sender] - {rank}
                for sender in new - old:
                    receivers[sender] = receivers[sender] | {rank}
        for rank in changed:  # a changed list is in the view of every rank it sends to
            dirty.update(receivers[rank])
        self._senders, self._receivers, self._acting = senders, receivers, acting
        self._lines, self._tails = dict(previous._lines), dict(previous._tails)
        for rank in changed:
            self._lines.pop(rank, None)
        for rank in dirty:
            self._tails.pop(rank, None)

    def _line(self, rank: int) -> str:
        line = self._lines.get(rank)
        if line is None:
            line = self._lines[rank] = json.dumps(" ".join(str(a) for a in self.plan.actions[rank]))
        return line

    def _tail(self, rank: int) -> bytes:
        tail = self._tails.get(rank)
        if tail is None:
            senders = self._senders[rank] if self._senders is not None else _senders(self.plan, rank)
            tail = self._tails[rank] = view_tail(rank, "view_actions", {r: self._line(r) for r in senders}).encode()
        return tail

    @property
    def shared(self) -> bytes:
        """What every worker's view starts with (the metadata and the routing's exceptions), stored once per
        generation: it grows with the micro-batches a failure moved (after a rack's loss at 16,384 workers, hundreds
        of KB), and a copy in each of thousands of views took the coordinator's process to tens of GB."""
        return self._shared

    def encoded(self, rank: int) -> bytes:
        """Worker `rank`'s whole view (json_for's text, encoded): `shared` + its tail."""
        return self._shared + self._tail(rank)

    def encoded_tails(self, ranks: list[int]) -> list[bytes]:
        """The part of each of `ranks`' views after `shared`, as the store holds it under the rank's key (one pass:
        at 16,384 workers a call per view is a cost of its own)."""
        tails, tail = self._tails, self._tail
        return [tails.get(rank) or tail(rank) for rank in ranks]

    def encoded_views(self, ranks: list[int]) -> list[bytes]:
        """encoded(rank) of each of `ranks` (benchmarks and tests; the coordinator stores `shared` once and the
        tails)."""
        shared = self._shared
        return [shared + tail for tail in self.encoded_tails(ranks)]

    def json_for(self, rank: int) -> str:
        """Worker `rank`'s view, for read_worker_view."""
        return self.encoded(rank).decode()


def view_json(shared: str, rank: int, field: str, rows: dict[int, str]) -> str:
    """A worker's view: `shared` (a JSON object's text without its closing brace, the same for every worker), then
    view_tail."""
    return shared + view_tail(rank, field, rows)


def view_tail(rank: int, field: str, rows: dict[int, str]) -> str:
    """What follows the shared part of worker `rank`'s view: whose view it is and its rows ({"RANK": row}, each row
    already JSON) under `field`, and the closing brace."""
    encoded = ",".join(f'"{r}":{rows[r]}' for r in sorted(rows))
    return f',"view_of":{rank},"{field}":{{{encoded}}}}}'


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


def _same_shape(before: Plan, plan: Plan) -> bool:
    """Whether views of `before` can be carried to `plan`: the same workers, stages, chunks and routing table."""
    return (before.num_workers == plan.num_workers and before.num_stages == plan.num_stages
            and before.chunks == plan.chunks and before.chunk_stages == plan.chunk_stages
            and len(before.host) == len(plan.host) and all(len(a) == len(b) for a, b in zip(before.host, plan.host)))


def _moved_in(row_index: int, row: tuple[int, ...], owners: list[int]) -> list[list[int]]:
    """The routing's exceptions in one row of host: [row, mb, replica] where the replica is not the owner."""
    return [[row_index, mb, replica] for mb, (replica, owner) in enumerate(zip(row, owners)) if replica != owner]


def _waiting_mbs(plan: Plan, rank: int) -> set[int]:
    """The micro-batches of `rank`'s actions that wait for a message (whose sender follows host)."""
    source = _input_stages(plan.num_chunks)
    return {action.mb for action in plan.actions[rank] if source[action.kind][action.stage] >= 0}


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
