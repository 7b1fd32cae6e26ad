"""The plan container: routing host[stage][mb], per-worker ordered action lists, failure state and metadata."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

from recycle.config import SIZE_LIMITS
from recycle.errors import PlanError
from recycle.inputs import MIB, UnsafeJSON, read_input_text, strict_json_loads
from recycle.ir.actions import Action, Kind
from recycle.ir.chunks import CHUNK_LAYOUTS, MAX_CHUNKS, chunk_workers
from recycle.ir.pieces import Piece, check_pieces, loss_weight, read_pieces

__all__ = ["PlanMeta", "Plan", "derive_host", "read_plan", "MAX_PLAN_FILE_BYTES"]

# The largest plan a config allows (config.MAX_PLAN_PAIRS pairs, ~3 actions each) is about 25 MB of JSON.
MAX_PLAN_FILE_BYTES = 64 * MIB


@dataclass(frozen=True)
class PlanMeta:
    """Informational metadata; none of it changes what the plan does."""

    schedule: str = ""  # e.g. "1f1b", "zb-h1", "adaptive"
    decoupled: bool = False
    failure_key: tuple[int, ...] = ()  # failed replicas per stage
    solver: str = ""  # "builtin", "heuristic", "exact"
    status: str = ""  # solver status, e.g. "OPTIMAL", "FEASIBLE"
    predicted_period: float | None = None  # the simulator's period for this plan
    predicted_makespan: float | None = None
    lower_bound: float | None = None  # a lower bound on the period of any plan for this state
    memory_cap: tuple[int, ...] = ()  # activation slots per stage the plan was made under (empty: none)
    config_fingerprint: str = ""
    notes: str = ""
    # Why the plan relabels the key's canonical plan per stage (moving healthy micro-batches) although the failure set
    # was planned with traffic-aware routing: that plan was slower. Empty: no fall-back (left out of the JSON).
    routing_fallback: str = ""


@dataclass(frozen=True)
class Plan:
    """A complete schedule for one failure state.

    `actions[rank]` is the ordered list of worker (replica, stage), rank = replica * num_stages + stage; failed
    workers have an empty list. `host[stage][mb]` is the replica whose stage-`stage` worker runs all of micro-batch
    `mb`'s actions at that stage. `staggered` selects the optimizer mode: each stage steps after its own reduce
    (True) or all stages step together after every stage has finished (False). `partition` is the number of
    contiguous model layers each stage holds when the plan re-partitions layers (empty: the config's own layout).

    Chunked plans (`chunks` > 1, [topology] chunks_per_worker): the model is cut into num_stages x chunks chunks
    (virtual stages) and each worker holds `chunks` of them, placed by `chunk_layout` (recycle.ir.chunks). An
    action's `stage` is then its chunk (the position in the dependency chain: F of chunk v needs F of chunk v-1),
    `host` has one row per chunk, and the worker that runs it is (host[chunk][mb], chunk_stage(chunk)); OPT keeps
    the worker's own stage index (it steps every chunk the worker holds). With chunks = 1 both readings coincide.
    """

    num_replicas: int
    num_stages: int
    num_microbatches: int
    host: tuple[tuple[int, ...], ...]
    actions: tuple[tuple[Action, ...], ...]
    failed: frozenset[tuple[int, int]] = frozenset()
    staggered: bool = False
    meta: PlanMeta = field(default_factory=PlanMeta)
    partition: tuple[int, ...] = ()
    chunks: int = 1
    chunk_layout: str = "interleaved"
    pieces: tuple[Piece, ...] = ()
    microbatch_size: int = 0  # samples of a whole micro-batch; set only with pieces

    # -- topology helpers -------------------------------------------------------------------------------------
    @property
    def num_workers(self) -> int:
        return self.num_replicas * self.num_stages

    @property
    def total_microbatches(self) -> int:
        return self.num_replicas * self.num_microbatches

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.num_stages + stage

    def worker(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.num_stages)

    @property
    def num_chunks(self) -> int:
        """Virtual stages of one pipeline: num_stages x chunks (num_stages when not chunked)."""
        return self.num_stages * self.chunks

    @cached_property
    def chunk_stages(self) -> tuple[int, ...]:
        """chunk_stage of every chunk, for loops."""
        return chunk_workers(self.num_stages, self.chunks, self.chunk_layout)

    def chunk_stage(self, chunk: int) -> int:
        """The stage index of the worker that holds `chunk` (the chunk itself when not chunked)."""
        return self.chunk_stages[chunk]

    def chunk_rank(self, replica: int, chunk: int) -> int:
        """The rank of the worker of `replica` that holds `chunk`."""
        return replica * self.num_stages + self.chunk_stages[chunk]

    @property
    def num_microbatch_ids(self) -> int:
        """Micro-batch ids the plan runs per stage: D x M, plus the extra pieces of a split plan."""
        return len(self.pieces) if self.pieces else self.num_replicas * self.num_microbatches

    def source(self, mb: int) -> int:
        """The data micro-batch (0 .. D x M - 1) that micro-batch id `mb` is (a piece of)."""
        return self.pieces[mb].source if self.pieces else mb

    def owner(self, mb: int) -> int:
        """The replica whose data shard micro-batch id `mb` belongs to (a piece's: its source's)."""
        return self.source(mb) // self.num_microbatches

    def work_fraction(self, mb: int) -> float:
        """The share of a whole micro-batch's F, B and W that id `mb` costs: its samples / microbatch_size."""
        return self.pieces[mb].samples / self.microbatch_size if self.pieces else 1.0

    def loss_weight(self, mb: int) -> float:
        """The factor of id `mb`'s mean token loss under the global-token rule (recycle.ir.pieces.loss_weight)."""
        if not self.pieces:
            return 1.0 / self.total_microbatches
        return loss_weight(self.pieces[mb].samples, self.microbatch_size, self.total_microbatches)

    def live_replicas(self, stage: int) -> list[int]:
        return [p for p in range(self.num_replicas) if (p, stage) not in self.failed]

    def live_ranks(self) -> list[int]:
        # (no call per rank: 16,384 of them)
        failed = {self.rank(replica, stage) for replica, stage in self.failed if 0 <= stage < self.num_stages}
        return [r for r in range(self.num_workers) if r not in failed]

    def worker_actions(self, replica: int, stage: int) -> tuple[Action, ...]:
        return self.actions[self.rank(replica, stage)]

    @cached_property
    def decoupled_pairs(self) -> frozenset[tuple[int, int]]:
        """(stage, mb) pairs whose backward is split into B and W (the rest use a fused BW)."""
        return frozenset((a.stage, a.mb) for acts in self.actions for a in acts if a.kind is Kind.B)

    @property
    def num_actions(self) -> int:
        return sum(len(a) for a in self.actions)

    def with_meta(self, **changes: Any) -> "Plan":
        return replace(self, meta=replace(self.meta, **changes))

    # -- serialisation ----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        meta = asdict(self.meta)
        meta["failure_key"] = list(self.meta.failure_key)
        meta["memory_cap"] = list(self.meta.memory_cap)
        if not self.meta.routing_fallback:  # only when set: plans without it keep their JSON byte for byte
            del meta["routing_fallback"]
        out = {
            "num_replicas": self.num_replicas,
            "num_stages": self.num_stages,
            "num_microbatches": self.num_microbatches,
            "staggered": self.staggered,
            "failed": sorted([list(w) for w in self.failed]),
            "host": [list(row) for row in self.host],
            "actions": [" ".join(str(a) for a in acts) for acts in self.actions],
            "meta": meta,
        }
        if self.partition:  # only when set: plans without it keep their JSON byte for byte
            out["partition"] = list(self.partition)
        if self.chunks > 1:  # likewise
            out["chunks"] = self.chunks
            out["chunk_layout"] = self.chunk_layout
        if self.pieces:  # likewise
            out["microbatch_size"] = self.microbatch_size
            out["pieces"] = [p.to_list() for p in self.pieces]
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        """A plan from its JSON object, every field of its JSON type: counts are whole numbers within the config
        limits (not 2.5, "2" or true), flags are true or false (not "no"), actions are strings."""
        if not isinstance(d, dict):
            raise PlanError(f"plan data is a JSON {type(d).__name__}, not a plan object ({{\"num_replicas\": ..., "
                            "\"actions\": ...}); regenerate the plan with `recycle plan --save`")
        try:
            D = _count(d, "num_replicas", SIZE_LIMITS["topology", "num_replicas"][0])
            S = _count(d, "num_stages", SIZE_LIMITS["topology", "num_stages"][0])
            M = _count(d, "num_microbatches", SIZE_LIMITS["workload", "num_microbatches"][0])
            meta = _read_meta(d.get("meta", {}))
            partition = _read_partition(d.get("partition", []), S)
            chunks, layout = _read_chunks(d.get("chunks", 1), d.get("chunk_layout", "interleaved"))
            pieces, size = read_pieces(d.get("pieces", []), d.get("microbatch_size", 0), D * M)
            host = tuple(_int_row(row, f"host[{s}]") for s, row in enumerate(_list(d, "host")))
            actions = tuple(tuple(Action.parse(t) for t in _text(line, f"actions[{r}]").split())
                            for r, line in enumerate(_list(d, "actions")))
            failed = frozenset(_worker(w) for w in d.get("failed", []))
            staggered = d.get("staggered", False)
            if not isinstance(staggered, bool):
                raise PlanError(f"plan field \"staggered\" = {staggered!r} must be true or false (JSON booleans, "
                                "not strings)")
            return cls(num_replicas=D, num_stages=S, num_microbatches=M, host=host, actions=actions, failed=failed,
                       staggered=staggered, meta=meta, partition=partition, chunks=chunks, chunk_layout=layout,
                       pieces=pieces, microbatch_size=size)
        except PlanError as exc:
            if "regenerate" in str(exc):
                raise
            raise PlanError(f"{exc}; regenerate the plan with `recycle plan` or `recycle schedule`") from None
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanError(f"plan data is malformed ({type(exc).__name__}: {exc}); regenerate the plan with "
                            "`recycle plan` or `recycle schedule`") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            return cls.from_dict(strict_json_loads(text))
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan file is not valid JSON: {exc}") from None
        except UnsafeJSON as exc:
            raise PlanError(f"plan file cannot be read: {exc}") from None

    @classmethod
    def from_worker_lists(cls, num_replicas: int, num_stages: int, num_microbatches: int,
                          actions: Sequence[Iterable[Action]], failed: Iterable[tuple[int, int]] = (),
                          staggered: bool = False, meta: PlanMeta | None = None, chunks: int = 1,
                          chunk_layout: str = "interleaved", pieces: Sequence[Piece] = (),
                          microbatch_size: int = 0) -> "Plan":
        """Build a plan whose routing is read off the lists (the worker that runs F of mb at stage s hosts it)."""
        acts = tuple(tuple(a) for a in actions)
        if pieces:
            check_pieces(pieces, microbatch_size, num_replicas * num_microbatches)
        host = derive_host(num_replicas, num_stages, num_microbatches, acts, chunks, len(pieces))
        return cls(num_replicas, num_stages, num_microbatches, host, acts, frozenset(failed), staggered,
                   meta or PlanMeta(), chunks=chunks, chunk_layout=chunk_layout, pieces=tuple(pieces),
                   microbatch_size=microbatch_size if pieces else 0)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _count(d: dict[str, Any], key: str, limit: int) -> int:
    value = d[key]
    if not _is_int(value):
        raise PlanError(f"plan field \"{key}\" = {_short(value)} must be a whole number (a JSON integer, not "
                        f"{'a boolean' if isinstance(value, bool) else 'a ' + type(value).__name__})")
    if not 1 <= value <= limit:
        raise PlanError(f"plan field \"{key}\" = {value} must be in [1, {limit:,}] (the config limit)")
    return value


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _list(d: dict[str, Any], key: str) -> list:
    value = d[key]
    if not isinstance(value, list):
        raise PlanError(f"plan field \"{key}\" must be a JSON list, not {_short(value)}")
    return value


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise PlanError(f"plan field \"{where}\" = {_short(value)} must be a string of actions (e.g. \"0F0 0B0\")")
    return value


def _int_row(row: Any, where: str) -> tuple[int, ...]:
    if not isinstance(row, list) or not all(type(x) is int for x in row):  # noqa: E721 -- bools are not replicas
        raise PlanError(f"plan field \"{where}\" must be a list of whole numbers (replicas), got {_short(row)}")
    return tuple(row)


def _worker(item: Any) -> tuple[int, int]:
    if not (isinstance(item, list) and len(item) == 2 and all(_is_int(x) for x in item)):
        raise PlanError(f"plan field \"failed\" lists {_short(item)}; each entry must be [replica, stage], two whole "
                        "numbers")
    return item[0], item[1]


_META_TYPES = {"str": (str,), "bool": (bool,), "float | None": (int, float, type(None)),
               "tuple[int, ...]": (list,)}


def _read_meta(raw: Any) -> PlanMeta:
    """PlanMeta from the plan's "meta" object, each entry of its field's JSON type."""
    if not isinstance(raw, dict):
        raise PlanError(f"plan field \"meta\" must be a JSON object, not {_short(raw)}")
    known = {f.name: f.type for f in fields(PlanMeta)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise PlanError(f"plan field \"meta\" has unknown entries {unknown[:5]}; known: {sorted(known)}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        kind = str(known[key])
        ok = isinstance(value, _META_TYPES[kind]) and not (kind == "float | None" and isinstance(value, bool))
        if kind == "tuple[int, ...]":
            ok = ok and all(_is_int(x) for x in value)
            value = tuple(value) if ok else value
        if not ok:
            raise PlanError(f"plan field \"meta.{key}\" = {_short(value)} must be of type {kind} (JSON: "
                            f"{'a list of whole numbers' if kind.startswith('tuple') else kind})")
        out[key] = value
    return PlanMeta(**out)


def _read_partition(raw: Any, num_stages: int) -> tuple[int, ...]:
    """The optional "partition" of a plan's JSON: [] or one whole number >= 1 of layers per stage."""
    ok = isinstance(raw, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in raw)
    if not ok or (raw and len(raw) != num_stages):
        raise PlanError(f"plan field \"partition\" = {raw!r} must list one whole number >= 1 of layers per stage "
                        f"({num_stages} stages), or be left out for the config's own layout; regenerate the plan "
                        "with `recycle plan --repartition --save`")
    return tuple(raw)


def _read_chunks(chunks: Any, layout: Any) -> tuple[int, str]:
    """The optional "chunks" and "chunk_layout" of a plan's JSON (left out: one chunk per worker)."""
    if not _is_int(chunks) or not 1 <= chunks <= MAX_CHUNKS:
        raise PlanError(f"plan field \"chunks\" = {_short(chunks)} must be a whole number in [1, {MAX_CHUNKS}] "
                        "(model chunks per worker)")
    if layout not in CHUNK_LAYOUTS or (layout == "v" and chunks != 2):
        raise PlanError(f"plan field \"chunk_layout\" = {_short(layout)} must be one of {list(CHUNK_LAYOUTS)} "
                        "(\"v\" with exactly 2 chunks per worker)")
    return chunks, layout


def read_plan(path: str | Path, flag: str = "--plan") -> Plan:
    """A plan from a JSON file written by `recycle plan --save`; every failure names the file and the format."""
    want = "a plan JSON file written by `recycle plan --save`"
    if Path(path).is_dir():
        raise PlanError(f"{flag} {str(path)!r} is a directory; pass {want}")
    text = read_input_text(path, f"{flag} {str(path)!r}", MAX_PLAN_FILE_BYTES, f"pass {want}", PlanError)
    try:
        data = strict_json_loads(text)
    except json.JSONDecodeError as exc:
        looks_csv = "," in text.splitlines()[0] if text.strip() else False
        hint = " (it looks like CSV: `--csv` output is for reading, not for the runtime)" if looks_csv else ""
        raise PlanError(f"{flag} {str(path)!r} is not JSON{hint}: {exc.msg} at line {exc.lineno}; pass "
                        f"{want}") from None
    except UnsafeJSON as exc:
        raise PlanError(f"{flag} {str(path)!r} cannot be read: {exc}; pass {want}") from None
    try:
        return Plan.from_dict(data)
    except PlanError as exc:
        raise PlanError(f"{flag} {str(path)!r}: {exc}") from None


def derive_host(num_replicas: int, num_stages: int, num_microbatches: int,
                actions: Sequence[Sequence[Action]], chunks: int = 1,
                num_ids: int = 0) -> tuple[tuple[int, ...], ...]:
    """host[stage][mb] (one row per chunk when chunked) from the position of each forward; unrouted micro-batches
    get -1 (the validator flags it). `num_ids`: a split plan's micro-batch ids (0: D x M)."""
    total = num_ids or num_replicas * num_microbatches
    rows = num_stages * chunks
    host = [[-1] * total for _ in range(rows)]
    for rank, acts in enumerate(actions):
        replica = rank // num_stages
        for a in acts:
            if a.kind is Kind.F and 0 <= a.stage < rows and 0 <= a.mb < total:
                if host[a.stage][a.mb] == -1:
                    host[a.stage][a.mb] = replica
    return tuple(tuple(row) for row in host)
