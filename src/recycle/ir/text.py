"""Plan <-> CSV text: a `# key=value` header (D, S, M, optimizer mode, failed workers, metadata), one row per rank."""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path

from recycle.errors import PlanError
from recycle.fileio import atomic_write_text
from recycle.ir.actions import Action
from recycle.ir.plan import Plan, PlanMeta, derive_host
from recycle.ir.worker import workers_text

__all__ = ["dump_csv", "load_csv", "write_csv", "read_csv", "CSV_COLUMNS"]

CSV_COLUMNS = "rank,replica,stage,actions"
_TITLE = "# recycle plan (csv v1): one row per worker, actions in execution order; routing = where each F runs"
_TUPLE_META = ("failure_key", "memory_cap")


def dump_csv(plan: Plan) -> str:
    """The plan as CSV text. Failed workers get a row with no actions; `failed` lists them as replica:stage."""
    meta = asdict(plan.meta)
    for key in _TUPLE_META:
        meta[key] = list(meta[key])
    failed = workers_text(plan.failed, ";")
    lines = [
        _TITLE,
        f"# num_replicas={plan.num_replicas}",
        f"# num_stages={plan.num_stages}",
        f"# num_microbatches={plan.num_microbatches}",
        f"# staggered={'true' if plan.staggered else 'false'}",
        f"# failed={failed}",
        f"# meta={json.dumps(meta, sort_keys=True, separators=(',', ':'))}",
        CSV_COLUMNS,
    ]
    for rank, acts in enumerate(plan.actions):
        replica, stage = plan.worker(rank)
        lines.append(f"{rank},{replica},{stage},{' '.join(str(a) for a in acts)}")
    return "\n".join(lines) + "\n"


def _int(value: str, what: str, where: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise PlanError(f"{where}: {what} = {value!r} is not an integer; write a whole number") from None


def _parse_failed(value: str, where: str) -> frozenset[tuple[int, int]]:
    out = set()
    for item in filter(None, (v.strip() for v in value.split(";"))):
        parts = item.split(":")
        if len(parts) != 2:
            raise PlanError(f"{where}: failed worker {item!r} is malformed; write replica:stage, separated by ';' "
                            "(e.g. failed=1:2;0:3)")
        out.add((_int(parts[0], "replica", where), _int(parts[1], "stage", where)))
    return frozenset(out)


def _parse_meta(value: str, where: str) -> PlanMeta:
    try:
        raw = json.loads(value)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{where}: meta is not valid JSON ({exc}); write meta={{...}} on one line") from None
    known = {f.name for f in fields(PlanMeta)}
    if not isinstance(raw, dict) or set(raw) - known:
        extra = sorted(set(raw) - known) if isinstance(raw, dict) else raw
        raise PlanError(f"{where}: meta has unknown entries {extra}; known: {sorted(known)}")
    for key in _TUPLE_META:
        if key in raw:
            raw[key] = tuple(raw[key])
    return PlanMeta(**raw)


def load_csv(text: str, source: str = "plan csv") -> Plan:
    """Parse dump_csv's format. Routing is derived from where each forward runs; call validate_plan to check it."""
    header: dict[str, tuple[str, str]] = {}  # key -> (value, "source:line")
    rows: dict[int, tuple[int, int, tuple[Action, ...], str]] = {}  # rank -> (replica, stage, actions, where)
    for number, line in enumerate(text.splitlines(), start=1):
        where = f"{source}:{number}"
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("#"):
            body = stripped[1:].strip()
            if "=" in body:  # comment lines without '=' (the title) carry no data
                key, value = body.split("=", 1)
                header[key.strip()] = (value.strip(), where)
            continue
        if stripped == CSV_COLUMNS:
            continue
        parts = stripped.split(",", 3)
        if len(parts) < 3:
            raise PlanError(f"{where}: row {stripped!r} needs the columns {CSV_COLUMNS}")
        rank = _int(parts[0], "rank", where)
        replica = _int(parts[1], "replica", where)
        stage = _int(parts[2], "stage", where)
        if rank in rows:
            raise PlanError(f"{where}: rank {rank} has a second row; give one row per rank")
        tokens = parts[3].split() if len(parts) > 3 else []
        rows[rank] = (replica, stage, tuple(Action.parse(t) for t in tokens), where)

    for key in ("num_replicas", "num_stages", "num_microbatches"):
        if key not in header:
            raise PlanError(f"{source}: header line '# {key}=...' is missing; plan CSVs start with num_replicas, "
                            "num_stages and num_microbatches")
    D = _int(*_value_and_what(header, "num_replicas"))
    S = _int(*_value_and_what(header, "num_stages"))
    M = _int(*_value_and_what(header, "num_microbatches"))
    if D < 1 or S < 1 or M < 1:
        raise PlanError(f"{source}: num_replicas={D}, num_stages={S}, num_microbatches={M} must all be >= 1")
    staggered_text, where = header.get("staggered", ("false", source))
    if staggered_text not in ("true", "false"):
        raise PlanError(f"{where}: staggered = {staggered_text!r} must be true or false")
    failed = _parse_failed(*header.get("failed", ("", source)))
    meta = _parse_meta(*header["meta"]) if "meta" in header else PlanMeta()

    actions: list[tuple[Action, ...]] = [() for _ in range(D * S)]
    for rank, (replica, stage, acts, where) in rows.items():
        if not 0 <= rank < D * S:
            raise PlanError(f"{where}: rank {rank} is outside 0..{D * S - 1} for D={D}, S={S}")
        if (replica, stage) != divmod(rank, S):
            raise PlanError(f"{where}: rank {rank} is worker {rank // S}:{rank % S} (rank = replica*S + stage) "
                            f"but the row says replica:stage = {replica}:{stage}; fix the replica and stage columns")
        actions[rank] = acts
    host = derive_host(D, S, M, actions)
    return Plan(D, S, M, host, tuple(actions), failed, staggered_text == "true", meta)


def _value_and_what(header: dict[str, tuple[str, str]], key: str) -> tuple[str, str, str]:
    value, where = header[key]
    return value, key, where


def write_csv(plan: Plan, path: str | Path) -> Path:
    """Write the plan's CSV atomically."""
    return atomic_write_text(path, dump_csv(plan))


def read_csv(path: str | Path) -> Plan:
    """Read a plan CSV written by write_csv (or by hand)."""
    path = Path(path)
    if not path.is_file():
        raise PlanError(f"plan CSV {str(path)!r} does not exist; write one with `recycle schedule --csv FILE`")
    return load_csv(path.read_text(), source=str(path))
