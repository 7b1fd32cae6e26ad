"""The plan container: routing host[stage][mb], per-worker ordered action lists, failure state and metadata."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable, Sequence

from recycle.errors import PlanError
from recycle.ir.actions import Action, Kind

__all__ = ["PlanMeta", "Plan", "derive_host", "read_plan"]


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


@dataclass(frozen=True)
class Plan:
    """A complete schedule for one failure state.

    `actions[rank]` is the ordered list of worker (replica, stage), rank = replica * num_stages + stage; failed
    workers have an empty list. `host[stage][mb]` is the replica whose stage-`stage` worker runs all of micro-batch
    `mb`'s actions at that stage. `staggered` selects the optimizer mode: each stage steps after its own reduce
    (True) or all stages step together after every stage has finished (False). `partition` is the number of
    contiguous model layers each stage holds when the plan re-partitions layers (empty: the config's own layout).
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

    def owner(self, mb: int) -> int:
        """The replica whose data shard micro-batch `mb` belongs to."""
        return mb // self.num_microbatches

    def live_replicas(self, stage: int) -> list[int]:
        return [p for p in range(self.num_replicas) if (p, stage) not in self.failed]

    def live_ranks(self) -> list[int]:
        return [r for r in range(self.num_workers) if self.worker(r) not in self.failed]

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
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        if not isinstance(d, dict):
            raise PlanError(f"plan data is a JSON {type(d).__name__}, not a plan object ({{\"num_replicas\": ..., "
                            "\"actions\": ...}); regenerate the plan with `recycle plan --save`")
        try:
            meta_raw = dict(d.get("meta", {}))
            meta_raw["failure_key"] = tuple(meta_raw.get("failure_key", ()))
            meta_raw["memory_cap"] = tuple(meta_raw.get("memory_cap", ()))
            partition = _read_partition(d.get("partition", []), int(d["num_stages"]))
            return cls(
                num_replicas=int(d["num_replicas"]),
                num_stages=int(d["num_stages"]),
                num_microbatches=int(d["num_microbatches"]),
                host=tuple(tuple(int(x) for x in row) for row in d["host"]),
                actions=tuple(tuple(Action.parse(t) for t in line.split()) for line in d["actions"]),
                failed=frozenset((int(p), int(s)) for p, s in d.get("failed", [])),
                staggered=bool(d.get("staggered", False)),
                meta=PlanMeta(**meta_raw),
                partition=partition,
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PlanError(f"plan data is malformed ({type(exc).__name__}: {exc}); regenerate the plan with "
                            "`recycle plan` or `recycle schedule`") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan file is not valid JSON: {exc}") from None

    @classmethod
    def from_worker_lists(cls, num_replicas: int, num_stages: int, num_microbatches: int,
                          actions: Sequence[Iterable[Action]], failed: Iterable[tuple[int, int]] = (),
                          staggered: bool = False, meta: PlanMeta | None = None) -> "Plan":
        """Build a plan whose routing is read off the lists (the worker that runs F of mb at stage s hosts it)."""
        acts = tuple(tuple(a) for a in actions)
        host = derive_host(num_replicas, num_stages, num_microbatches, acts)
        return cls(num_replicas, num_stages, num_microbatches, host, acts, frozenset(failed), staggered,
                   meta or PlanMeta())


def _read_partition(raw: Any, num_stages: int) -> tuple[int, ...]:
    """The optional "partition" of a plan's JSON: [] or one whole number >= 1 of layers per stage."""
    ok = isinstance(raw, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in raw)
    if not ok or (raw and len(raw) != num_stages):
        raise PlanError(f"plan field \"partition\" = {raw!r} must list one whole number >= 1 of layers per stage "
                        f"({num_stages} stages), or be left out for the config's own layout; regenerate the plan "
                        "with `recycle plan --repartition --save`")
    return tuple(raw)


def read_plan(path: str | Path, flag: str = "--plan") -> Plan:
    """A plan from a JSON file written by `recycle plan --save`; every failure names the file and the format."""
    p = Path(path)
    want = "a plan JSON file written by `recycle plan --save`"
    if p.is_dir():
        raise PlanError(f"{flag} {str(path)!r} is a directory; pass {want}")
    if not p.is_file():
        raise PlanError(f"{flag} {str(path)!r} does not exist; pass {want}")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise PlanError(f"{flag} {str(path)!r} is not UTF-8 text; pass {want}") from None
    except OSError as exc:
        raise PlanError(f"{flag} {str(path)!r} cannot be read ({exc.strerror}); pass {want}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        looks_csv = "," in text.splitlines()[0] if text.strip() else False
        hint = " (it looks like CSV: `--csv` output is for reading, not for the runtime)" if looks_csv else ""
        raise PlanError(f"{flag} {str(path)!r} is not JSON{hint}: {exc.msg} at line {exc.lineno}; pass "
                        f"{want}") from None
    try:
        return Plan.from_dict(data)
    except PlanError as exc:
        raise PlanError(f"{flag} {str(path)!r}: {exc}") from None


def derive_host(num_replicas: int, num_stages: int, num_microbatches: int,
                actions: Sequence[Sequence[Action]]) -> tuple[tuple[int, ...], ...]:
    """host[stage][mb] from the position of each forward; unrouted micro-batches get -1 (the validator flags it)."""
    total = num_replicas * num_microbatches
    host = [[-1] * total for _ in range(num_stages)]
    for rank, acts in enumerate(actions):
        replica = rank // num_stages
        for a in acts:
            if a.kind is Kind.F and 0 <= a.stage < num_stages and 0 <= a.mb < total:
                if host[a.stage][a.mb] == -1:
                    host[a.stage][a.mb] = replica
    return tuple(tuple(row) for row in host)
