"""The records written to the job store between the processes of a run (worker <-> launcher): frozen dataclasses
(StoppedReport a named tuple) with a JSON round-trip that names each record's kind, so both sides read and write the
same typed fields; a node's step records (NodeSteps), read a thousand times a second at scale, travel as packed bytes
instead (encode/decode)."""

from __future__ import annotations

import array
import functools
import itertools
import json
import operator
import struct
import sys
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Callable, ClassVar, NamedTuple, Sequence, TypeVar

from recycle.ir.worker import Worker

if TYPE_CHECKING:  # typeshed's type of a dataclass (what fields() takes); it exists only in the stubs
    from _typeshed import DataclassInstance

__all__ = ["RecordError", "StepRecord", "EvalRecord", "ErrorRecord", "FaultRecord", "JoinReady", "Timestamp",
           "TransferRecord", "MigrationRecord", "StoppedReport", "Announcement", "Joined", "Beat", "JobSettings",
           "NodeHello", "WorkerResync", "StepRows", "PackedRows", "NodeSteps", "NodeStops", "NodeStarted", "to_json",
           "from_json", "encode", "decode"]


class RecordError(ValueError):
    """A store record that cannot be read as the record expected (unknown kind, another kind, missing fields):
    a process of another recycle version, or a key written by something else."""


def _field_types(cls: type[DataclassInstance] | type[StoppedReport]) -> dict[str, str]:
    """A record class's fields in order, with their types as written (a dataclass's, or a named tuple's)."""
    if issubclass(cls, tuple):  # (typing keeps a named tuple's postponed annotations as ForwardRefs)
        return {name: getattr(kind, "__forward_arg__", str(kind)) for name, kind in cls.__annotations__.items()}
    return {f.name: str(f.type) for f in fields(cls)}


@dataclass(frozen=True)
class StepRecord:
    """What a worker reports after each step it finished (key metrics/STEP/RANK)."""

    replica: int
    stage: int
    generation: int
    start: float  # wall clock (time.time()) of the iteration's first action
    end: float
    cpu_s: float  # process CPU time of the iteration, all threads (gloo's included)
    loss_sum: float | None  # this worker's scaled micro-batch losses (last stage only)
    stage_loss: float | None  # the batch's loss over the last stage's replicas (last stage only)
    grad_norm: float | None  # the global norm when clipping
    grad_sq: float | None  # this stage's squared gradient norm when not clipping
    digest: str = ""  # parameter digest (verify_replicas), "" when not asked for
    timings: tuple[tuple[str, float, float], ...] = ()  # (action, perf_counter start, end) with record_timings
    lr: float | None = None  # the learning rate of this stage's optimizer step

    @property
    def worker(self) -> str:
        return str(Worker(self.replica, self.stage))


@dataclass(frozen=True)
class EvalRecord:
    """An evaluation on the held-out split after a number of steps (key eval/DONE): the mean loss over its
    micro-batches, run forward-only through the pipeline; written by the last stage's first live replica."""

    loss: float
    microbatches: int
    start: float  # wall clock of the evaluation's first forward on the writer
    end: float
    generation: int


@dataclass(frozen=True)
class ErrorRecord:
    """Why a worker process failed (key error/RANK), written just before it exits non-zero."""

    exception: str  # the exception's class name
    message: str  # the first line of its message
    comm: bool  # a communication error (a peer died): the worker itself is fine
    time: float
    traceback: str


@dataclass(frozen=True)
class FaultRecord:
    """An injected fault (or a chaos kill) about to happen (key fault/RANK): recoveries are timed from it."""

    time: float
    where: str
    mode: str


@dataclass(frozen=True)
class JoinReady:
    """A replacement worker is up and waits to be admitted (key join/RANK/ready)."""

    time: float
    pid: int


@dataclass(frozen=True)
class Timestamp:
    """A moment a worker reached (key resumed/G/RANK: its first action in generation G)."""

    time: float


@dataclass(frozen=True)
class TransferRecord:
    """A joiner's state transfer from a live replica (key genG/transfer/RANK)."""

    bytes: int
    seconds: float
    source: str  # "replica:stage" it took the state from


@dataclass(frozen=True)
class MigrationRecord:
    """What a worker's layer re-partition moved in a generation (key genG/migration/RANK)."""

    layers: tuple[int, int]  # its [first, last) layers afterwards
    layers_in: int
    layers_out: int
    bytes: int
    seconds: float


class StoppedReport(NamedTuple):
    """What a worker says when it leaves a generation after a failure: how far its weights got, and the work it had
    done that a roll-back would throw away. A named tuple, not a dataclass like the other records: a recovery at
    16,384 workers makes 16,384 of them on the path to its announcement (from its nodes' digests), and a tuple is one
    allocation, not an instance and its dict (1.5 us each against ~4 us, measured here with the objects kept)."""

    rank: int
    generation: int
    applied: int  # the last iteration whose optimizer step this worker applied (start_step - 1: none yet)
    iteration: int  # the iteration it was running
    current_actions: int  # actions of `iteration` it had finished
    current_s: float  # their busy time
    previous_actions: int  # actions of iteration `applied` (lost too if that iteration is rolled back)
    previous_s: float
    error: str  # the first line of the error that stopped it
    time: float  # wall clock
    weighed_current: bool = False  # its unfinished action is a BW whose weight-gradient it had accumulated
    completing: bool = False  # it was finishing an interrupted iteration (its actions are the completion's steps)
    reducing: bool = False  # it stopped inside its OPT after the stage all-reduce: its .grad holds sums (it drops them)
    tp_split: str = ""  # T > 1: how its TP ranks' stop points differ ("" when they agree; worker.tp_agreement)


@dataclass(frozen=True)
class Announcement:
    """The coordinator's word for a new generation: who is in it and from which iteration everyone continues."""

    generation: int
    live: tuple[int, ...]  # topology ranks
    redo_step: int  # the first iteration to run (state rolls back to the end of redo_step - 1)
    end_step: int
    reason: str
    joining: tuple[int, ...] = ()  # ranks admitted in this generation (they take their stage's state from a peer)
    restore_step: int = -1  # >= 0: every worker loads this checkpoint step instead of rolling back
    completion: bool = False  # survivors keep redo_step's work and run its completion (key gen/completion)


@dataclass(frozen=True)
class Joined:
    """A worker is in a generation's groups: when, and how long forming them took it ("init": full initialisation
    of the world and the stage groups on the generation's store)."""

    time: float
    formation_s: float
    method: str


@dataclass(frozen=True)
class Beat:
    """A worker's heartbeat: written by its watcher thread, so it goes on while the main thread is stuck. `actions`
    counts the actions the main thread has started; `phase` is what it is doing now ("compute": an action's own
    work, "comm": waiting in a p2p op or collective, "idle": anything else). A worker whose beats go on while
    `actions` stands still in "compute" is hung (coordinator.hung_workers)."""

    beats: int
    actions: int
    phase: str
    incarnation: str = ""  # a replacement counts its beats from 1 again: (incarnation, beats) tells a new beat


@dataclass(frozen=True)
class JobSettings:
    """What every process of a run must agree on (key `job`), written by the coordinator before any worker starts:
    a node launcher started with other flags is refused at once, naming what differs, instead of training something
    else or failing at the end."""

    config: str  # SHA-256 of the config as the run reads it (after --set, --hf, --data-source)
    plan: str  # SHA-256 of the plan the run starts on
    model_factory: str
    end_step: int
    save_path: str
    checkpoint_dir: str
    checkpoint_every: int
    resume_dir: str
    export_hf: str = ""
    # Not agreed but adopted: the coordinator's launch decides (it holds the reports' sinks), and every node tells
    # its workers (runtime.options.LaunchOptions.wants_grad_norm).
    grad_norm: bool = True

    FLAGS: ClassVar[dict[str, str]] = {
        "config": "--config (or --set/--hf/--data-source)", "plan": "--schedule/--plan/--down (the starting plan)",
        "model_factory": "--model-factory", "end_step": "--steps", "save_path": "--save",
        "checkpoint_dir": "--checkpoint-dir", "checkpoint_every": "--checkpoint-every", "resume_dir": "--resume",
        "export_hf": "--export-hf"}

    def differences(self, other: JobSettings) -> list[str]:
        """'FLAG: MINE here, THEIRS at the coordinator' for every setting that differs."""
        out = []
        for f in fields(self):
            if f.name not in self.FLAGS:
                continue  # adopted from the coordinator, not agreed
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs:
                shown = ("a different one", "another") if f.name in ("config", "plan") else (repr(mine), repr(theirs))
                out.append(f"{self.FLAGS[f.name]}: {shown[0]} here, {shown[1]} at the coordinator")
        return out


@dataclass(frozen=True)
class NodeHello:
    """A node launcher's first word to a store it has just connected to (key node/NODE/hello): "fresh" (it starts its
    workers now) or "running" (its workers train already: the store is a restarted coordinator's, which rebuilds the
    run from these and the workers' WorkerResync records). `alive`: its workers whose process runs; `exited`: (rank,
    exit code) of those that ended."""

    state: str
    alive: tuple[int, ...] = ()
    exited: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class WorkerResync:
    """Where a worker stands, told to a store that came back empty (a restarted coordinator; key resync/RANK), after it
    has written again the records that store lacks (its announcement, stop report, recent step records).

    `phase`: "training" (in `generation`), "stopped" (left `generation` after a failure, waits for the next one),
    "admitting" (a replacement not yet admitted), "finished". `oldest_record`: the first step whose StepRecord it wrote
    again (its next step when it has none)."""

    generation: int
    phase: str
    oldest_record: int
    pid: int
    incarnation: str


# StepRows' columns, in groups of the types their values may have (a float column takes an int: a writer may hand one
# over). A group is checked in one pass (set(map(type, ...)): no Python frame per value).
_NUMBER = frozenset({float, int})
_COLUMN_GROUPS: tuple[tuple[frozenset[type], tuple[str, ...]], ...] = (
    (frozenset({int}), ("replica", "stage", "generation")), (_NUMBER, ("start", "end", "cpu_s")),
    (frozenset({float, int, type(None)}), ("loss_sum", "stage_loss", "grad_norm", "grad_sq", "lr")),
    (frozenset({str}), ("digest",)), (frozenset({tuple}), ("timings",)))
_COLUMNS = ("replica", "stage", "generation", "start", "end", "cpu_s", "loss_sum", "stage_loss", "grad_norm", "grad_sq",
            "digest", "timings", "lr")  # StepRecord's fields, in its order


@dataclass(frozen=True)
class StepRows:
    """Several workers' StepRecords of one step as columns (row i of every column is one worker's record): the
    coordinator reports a step from its columns, at 16,384 workers a few C-level passes where a dataclass per worker
    cost most of its CPU (docs/cluster.md, "Step records go through the node"). A node's rows travel packed
    (PackedRows); `gather` joins a step's. Every column is checked on construction: same length, each value of its
    field's type."""

    replica: tuple[int, ...]
    stage: tuple[int, ...]
    generation: tuple[int, ...]
    start: tuple[float, ...]
    end: tuple[float, ...]
    cpu_s: tuple[float, ...]
    loss_sum: tuple[float | None, ...]
    stage_loss: tuple[float | None, ...]
    grad_norm: tuple[float | None, ...]
    grad_sq: tuple[float | None, ...]
    digest: tuple[str, ...]
    timings: tuple[tuple[tuple[str, float, float], ...], ...]
    lr: tuple[float | None, ...]

    def __post_init__(self) -> None:
        _check_columns(_ALL_COLUMNS(self))

    def __len__(self) -> int:
        return len(self.replica)

    @classmethod
    def of(cls, records: StepRows | list[StepRecord] | tuple[StepRecord, ...]) -> StepRows:
        """`records` as rows (rows as they are)."""
        if isinstance(records, StepRows):
            return records
        return cls(*(tuple(getattr(r, name) for r in records) for name in _COLUMNS))

    @classmethod
    def gather(cls, picks: Sequence[tuple[PackedRows | StepRows, int]]) -> StepRows:
        """The rows `picks` names ((rows, index) each), in that order. Consecutive rows of one batch are taken as one
        slice of its packed bytes: a step's picks, in rank order, are mostly each node's batch whole, so the step's
        columns come from a few joins and strided array reads, not a Python step per value. The batches were checked
        when they were made (PackedRows): nothing is checked again."""
        runs: list[tuple[PackedRows | StepRows, int, int]] = []  # (rows, first, past the last)
        last: PackedRows | StepRows | None = None
        first = past = -1
        for rows, i in picks:
            if rows is last and i == past:
                past += 1
                continue
            if last is not None:
                runs.append((last, first, past))
            last, first, past = rows, i, i + 1
        if last is not None:
            runs.append((last, first, past))
        packed: dict[int, PackedRows] = {}  # a StepRows among the picks, packed once
        batches = []
        for rows, _, _ in runs:
            if isinstance(rows, StepRows):
                rows = packed.get(id(rows)) or packed.setdefault(id(rows), PackedRows.of(rows))
            batches.append(rows)
        firsts, pasts = [run[1] for run in runs], [run[2] for run in runs]
        count = sum(map(operator.sub, pasts, firsts))

        def joined(attribute: str, width: int) -> bytes:
            # (each run's bytes of one packed column, joined: C-level calls per run)
            starts, ends = (list(map(operator.mul, positions, itertools.repeat(width)))
                            for positions in (firsts, pasts))
            return b"".join(map(operator.getitem, map(operator.attrgetter(attribute), batches),
                                map(slice, starts, ends)))

        ints, floats = _unpacked("q", joined("ints", _INT_BYTES)), _unpacked("d", joined("floats", _FLOAT_BYTES))
        present = joined("present", len(_OPTIONAL))
        columns: dict[str, Any] = {name: tuple(ints[i::len(_INTS)]) for i, name in enumerate(_INTS)}
        columns.update((name, tuple(floats[i::len(_FLOATS)])) for i, name in enumerate(_FLOATS[:len(_REQUIRED)]))
        for i, name in enumerate(_OPTIONAL):
            values, mask = floats[len(_REQUIRED) + i::len(_FLOATS)], present[i::len(_OPTIONAL)]
            if 0 not in mask:
                columns[name] = tuple(values)
            elif 1 not in mask:
                columns[name] = (None,) * count
            else:  # absent values as None, in C-level passes (a dict of the present ones, read at every row)
                columns[name] = tuple(map(dict(zip(itertools.compress(range(count), mask),
                                                   itertools.compress(values, mask))).get, range(count)))
        for name, empty in (("digest", ""), ("timings", ())):
            if any(getattr(batch, name) for batch in batches):
                columns[name] = tuple(itertools.chain.from_iterable(
                    getattr(batch, name)[first:past] if getattr(batch, name) else (empty,) * (past - first)
                    for batch, first, past in zip(batches, firsts, pasts)))
            else:
                columns[name] = (empty,) * count
        rows = object.__new__(cls)
        rows.__dict__.update((name, columns[name]) for name in _COLUMNS)  # (checked as PackedRows: no __init__)
        return rows

    def record(self, index: int) -> StepRecord:
        """Row `index` as the StepRecord it came from."""
        return StepRecord(*(getattr(self, name)[index] for name in _COLUMNS))


def _timings_as_tuples(timings: tuple[Any, ...]) -> tuple[Any, ...]:
    """A timings column from JSON (lists) as the tuples StepRecord holds; anything else is left for the check."""
    if any(timings) or not set(map(type, timings)) <= {list, tuple}:  # most records carry none: [] each
        return tuple(tuple(tuple(t) if type(t) is list else t for t in ts) if type(ts) in (list, tuple) else ts
                     for ts in timings)
    return ((),) * len(timings)


def _check_columns(columns: tuple[Any, ...]) -> None:
    """Raise RecordError unless `columns` (StepRows' in _COLUMNS' order) are tuples of one length with values of the
    types their fields hold. A few C-level passes over all values: the coordinator checks thousands a second."""
    rows = len(columns[0]) if type(columns[0]) is tuple else -1
    if set(map(type, columns)) != {tuple} or set(map(len, columns)) != {rows}:
        name, column = next((name, column) for name, column in zip(_COLUMNS, columns)
                            if type(column) is not tuple or len(column) != rows)
        shown = f"{len(column)} values" if type(column) is tuple else _shown(column)
        raise RecordError(f"step rows: column {name!r} holds {shown}, not a list of {max(rows, 0)} values like "
                          "'replica'; every process of a run must be the same recycle version")
    for allowed, names in _COLUMN_GROUPS:
        group = [columns[_INDEX[name]] for name in names]
        if not set(map(type, itertools.chain(*group))) <= allowed:
            name, bad = next((name, value) for name, column in zip(names, group) for value in column
                             if type(value) not in allowed)
            raise RecordError(f"step rows: column {name!r} holds {_shown(bad)} ({type(bad).__name__}), not one of "
                              f"{', '.join(sorted(t.__name__ for t in allowed))}; every process of a run must be the "
                              "same recycle version")
    _check_timings(columns[_INDEX["timings"]])


def _check_timings(column: tuple[Any, ...]) -> None:
    """Raise RecordError unless each timing of each row in `column` is (action, start, end)."""
    for timings in column if any(column) else ():
        for timing in timings:
            if not (type(timing) is tuple and len(timing) == 3 and type(timing[0]) is str
                    and type(timing[1]) in _NUMBER and type(timing[2]) in _NUMBER):
                raise RecordError(f"step rows: a timing is {_shown(timing)}, not (action, start, end); every "
                                  "process of a run must be the same recycle version")


_INDEX = {name: i for i, name in enumerate(_COLUMNS)}
_ALL_COLUMNS = operator.attrgetter(*_COLUMNS)  # a StepRows' columns as a tuple, in one C call


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# PackedRows' layout: per row, _INTS as int64 and _FLOATS as float64 (an absent optional float as 0.0), and one
# presence byte per _OPTIONAL float; little-endian.
_INTS = ("replica", "stage", "generation")
_REQUIRED = ("start", "end", "cpu_s")
_OPTIONAL = ("loss_sum", "stage_loss", "grad_norm", "grad_sq", "lr")
_FLOATS = _REQUIRED + _OPTIONAL
_INT_BYTES, _FLOAT_BYTES = 8 * len(_INTS), 8 * len(_FLOATS)
_BLOBS = (("ints", _INT_BYTES), ("floats", _FLOAT_BYTES), ("present", len(_OPTIONAL)))  # (field, bytes per row)
_ROW_BYTES = sum(width for _, width in _BLOBS)
_AGAIN = "every process of a run must be the same recycle version"


def _unpacked(typecode: str, data: bytes) -> array.array[Any]:
    """Little-endian `data` as an array of `typecode` values."""
    values = array.array(typecode)
    values.frombytes(data)
    if sys.byteorder != "little":
        values.byteswap()
    return values


def _packed(typecode: str, values: Any) -> bytes:
    """`values` as little-endian bytes of `typecode` values."""
    out = array.array(typecode, values)
    if sys.byteorder != "little":
        out.byteswap()
    return out.tobytes()


@dataclass(frozen=True)
class PackedRows:
    """A node's step records of one step (NodeSteps' rows), packed row by row: `ints` holds replica, stage and
    generation (int64 each), `floats` start, end, cpu_s, loss_sum, stage_loss, grad_norm, grad_sq and lr (float64,
    0.0 where absent), `present` one byte (1 or 0) per row for each of the five optional floats; little-endian.
    `digest` and `timings` hold one value per row, or nothing when no row has one. At 16,384 workers the coordinator
    reads 2,048 of these a step: they travel as these bytes (NodeSteps.encode), and a step's gather joins bytes
    (StepRows.gather). Checked on construction (sizes, presence bytes, digest and timings), so nothing is checked
    again when a step is gathered."""

    count: int
    ints: bytes
    floats: bytes
    present: bytes
    digest: tuple[str, ...] = ()
    timings: tuple[tuple[tuple[str, float, float], ...], ...] = ()

    def __post_init__(self) -> None:
        count = self.count
        if type(count) is not int or count < 0:
            raise RecordError(f"step rows: the row count is {_shown(count)}, not a whole number >= 0; {_AGAIN}")
        for name, width in _BLOBS:
            blob = getattr(self, name)
            if type(blob) is not bytes or len(blob) != count * width:
                shown = f"{len(blob)} bytes" if type(blob) is bytes else _shown(blob)
                raise RecordError(f"step rows: the packed column {name!r} holds {shown}, not {width} bytes for each "
                                  f"of the {count} rows; {_AGAIN}")
        self._check_rest()

    def _check_rest(self) -> None:
        """The checks past the packed columns' sizes: presence bytes, digest and timings."""
        count = self.count
        if self.present.translate(None, b"\0\1"):
            raise RecordError(f"step rows: a presence byte is not 0 or 1; {_AGAIN}")
        for name, allowed in (("digest", frozenset({str})), ("timings", frozenset({tuple}))):
            column = getattr(self, name)
            if not column and type(column) is tuple:
                continue  # (most batches carry neither)
            if type(column) is not tuple or len(column) != count:
                shown = f"{len(column)} values" if type(column) is tuple else _shown(column)
                raise RecordError(f"step rows: column {name!r} holds {shown}, not one value for each of the "
                                  f"{count} rows (or none when no row has one); {_AGAIN}")
            if not set(map(type, column)) <= allowed:
                bad = next(value for value in column if type(value) not in allowed)
                raise RecordError(f"step rows: column {name!r} holds {_shown(bad)} ({type(bad).__name__}), not "
                                  f"{next(iter(allowed)).__name__}; {_AGAIN}")
        _check_timings(self.timings)

    def __len__(self) -> int:
        return self.count

    @functools.cached_property
    def _ints(self) -> array.array[int]:
        return _unpacked("q", self.ints)

    # The columns the coordinator acts on as a batch arrives (HeldSteps.add); the others are read by StepRows.gather.
    @property
    def replica(self) -> Sequence[int]:
        return self._ints[0::len(_INTS)]

    @property
    def stage(self) -> Sequence[int]:
        return self._ints[1::len(_INTS)]

    @property
    def generation(self) -> Sequence[int]:
        return self._ints[2::len(_INTS)]

    @classmethod
    def of(cls, records: StepRows | list[StepRecord] | tuple[StepRecord, ...]) -> PackedRows:
        """`records` packed (RecordError if a value is not of its field's type)."""
        rows = StepRows.of(records)
        optional = [getattr(rows, name) for name in _OPTIONAL]
        try:
            ints = _packed("q", itertools.chain.from_iterable(zip(rows.replica, rows.stage, rows.generation)))
        except OverflowError:
            raise RecordError(f"step rows: a replica, stage or generation is past int64 ({max(rows.replica)}, "
                              f"{max(rows.stage)}, {max(rows.generation)}); {_AGAIN}") from None
        floats = _packed("d", itertools.chain.from_iterable(zip(
            rows.start, rows.end, rows.cpu_s, *([0.0 if value is None else value for value in column]
                                                for column in optional))))
        present = bytes(itertools.chain.from_iterable(zip(*([value is not None for value in column]
                                                            for column in optional))))
        return cls(len(rows), ints, floats, present, rows.digest if any(rows.digest) else (),
                   rows.timings if any(rows.timings) else ())

    def record(self, index: int) -> StepRecord:
        """Row `index` as the StepRecord it came from."""
        return StepRows.gather([(self, index)]).record(0)


@dataclass(frozen=True)
class NodeSteps:
    """A node launcher's step records of one step (key node_metrics/STEP/NODE/SEQ): its workers write theirs to the
    node's own store, and the launcher hands the coordinator the ones that came in since its last look, one record per
    step, so the coordinator's reads grow with the nodes, not the workers. SEQ counts the launcher's writes: each key
    is written once, so its reader may delete it once read. `rows` given as StepRows or StepRecords is packed.

    Unlike the other records it is not JSON: the coordinator reads 1,024 a second at 16,384 ranks, and JSON (even
    with the rows in one base64 string) cost it 26 us a node's batch of 8 rows against 4-8 us for these bytes
    (`encode`; measured here): a header (_NODE_STEPS_HEADER: magic, node, step, rows, the tail's length), the rows' packed columns (PackedRows),
    and a JSON tail with the digest and timings columns, only when a row has one."""

    node: int
    step: int
    rows: PackedRows

    def __post_init__(self) -> None:
        rows: Any = self.rows
        if isinstance(rows, StepRows) or \
                isinstance(rows, (list, tuple)) and all(isinstance(row, StepRecord) for row in rows):
            object.__setattr__(self, "rows", PackedRows.of(rows))
        elif not isinstance(rows, PackedRows):
            raise RecordError(f"a NodeSteps record holds {_shown(rows)} where step rows were expected; {_AGAIN}")

    def encode(self) -> bytes:
        """The bytes a store key holds for this record (`decode` reads them)."""
        rows = self.rows
        tail = json.dumps({"digest": list(rows.digest), "timings": _data(rows.timings)}).encode() \
            if rows.digest or rows.timings else b""
        return _NODE_STEPS_HEADER.pack(_NODE_STEPS_MAGIC, self.node, self.step, rows.count, len(tail)) + rows.ints + \
            rows.floats + rows.present + tail

    @classmethod
    def decode(cls, raw: bytes | str, where: str = "a NodeSteps record") -> NodeSteps:
        """The record `encode` wrote; anything else raises RecordError naming what is wrong."""
        data = raw.encode() if isinstance(raw, str) else raw
        header = _NODE_STEPS_HEADER.size
        if type(data) is not bytes or len(data) < header or data[:len(_NODE_STEPS_MAGIC)] != _NODE_STEPS_MAGIC:
            shown = _shown(data[:40]) if isinstance(data, bytes) else type(data).__name__
            raise RecordError(f"{where} holds {shown}, not a node's packed step records (they start with "
                              f"{_NODE_STEPS_MAGIC!r}); {_AGAIN}")
        _, node, step, count, tail_length = _NODE_STEPS_HEADER.unpack_from(data)
        if count < 0 or len(data) != header + count * _ROW_BYTES + tail_length:
            raise RecordError(f"{where} holds {len(data)} bytes, not the {header} of its header, {_ROW_BYTES} for "
                              f"each of its {count} rows and its {tail_length}-byte tail; {_AGAIN}")
        ints_end = header + count * _INT_BYTES
        floats_end = ints_end + count * _FLOAT_BYTES
        rows_end = floats_end + count * len(_OPTIONAL)
        digest: Any = ()
        timings: Any = ()
        if tail_length:
            try:
                tail = json.loads(data[rows_end:])
            except (json.JSONDecodeError, UnicodeDecodeError):
                tail = None
            columns: list[Any] = [tail.get(name) for name in ("digest", "timings")] if type(tail) is dict \
                else [None, None]
            if set(map(type, columns)) != {list}:
                raise RecordError(f"{where}: its tail {_shown(tail)} is not the digest and timings columns as "
                                  f"lists; {_AGAIN}")
            digest, timings = tuple(columns[0]), _timings_as_tuples(tuple(columns[1]))
        rows = object.__new__(PackedRows)  # (the sizes are checked above: no __init__, which sets each field by hand)
        rows.__dict__.update(count=count, ints=data[header:ints_end], floats=data[ints_end:floats_end],
                             present=data[floats_end:rows_end], digest=digest, timings=timings)
        rows._check_rest()
        batch = object.__new__(cls)
        batch.__dict__.update(node=node, step=step, rows=rows)
        return batch

    @property
    def records(self) -> tuple[StepRecord, ...]:
        """Each row as a StepRecord (tests and tools; the coordinator reads the columns)."""
        rows = StepRows.gather([(self.rows, i) for i in range(len(self.rows))])
        return tuple(rows.record(i) for i in range(len(rows)))


_NODE_STEPS_MAGIC = b"RCYSTEP1"
_NODE_STEPS_HEADER = struct.Struct("<8sqqqI")  # magic, node, step, rows, the JSON tail's length in bytes


def encode(record: Any) -> bytes | str:
    """What a store key holds for `record`: NodeSteps' bytes, any other record's JSON (to_json)."""
    return record.encode() if type(record) is NodeSteps else to_json(record)


def decode(cls: type[R], raw: bytes | str) -> R:
    """The record of class `cls` that `encode` wrote; RecordError for anything else."""
    if cls is NodeSteps:
        return NodeSteps.decode(raw)  # type: ignore[return-value]
    return from_json(cls, raw)


@dataclass(frozen=True)
class NodeStops:
    """A node launcher's digest of its workers' stop reports of one generation (key node_stopped/GENERATION/NODE/SEQ):
    its workers hand their reports to the node's own store, and the launcher writes the coordinator one record with
    all that came in, so a recovery's reports cost the coordinator's store one request per node, not per worker. A
    report that comes late goes in a later digest (SEQ counts the launcher's writes: each key is written once).
    The reports travel as columns (kind "stop_rows": one JSON array per StoppedReport field), read back in a few
    C-level passes: at 16,384 workers a recovery's 2,048 digests took the coordinator 0.2 s of CPU as one JSON object
    and one dataclass call per report, on the path to its announcement."""

    node: int
    generation: int
    reports: tuple[StoppedReport, ...]

    # to_json writes this field as columns (_data), and __post_init__ reads them back.
    COLUMNS: ClassVar[dict[str, type]] = {"reports": StoppedReport}

    def __post_init__(self) -> None:
        reports = self.reports
        if isinstance(reports, dict):  # from_json: the columns JSON holds
            object.__setattr__(self, "reports", _stops_from_columns(reports, "a NodeStops record's reports"))
        elif not isinstance(reports, tuple):
            raise RecordError(f"a NodeStops record's reports are {type(reports).__name__}, not StoppedReport records "
                              "as columns; every process of a run must be the same recycle version")
        elif any(not isinstance(report, StoppedReport) for report in reports):
            # A list of report objects (as JSON writes single records): each read as the StoppedReport it must be.
            object.__setattr__(self, "reports", tuple(
                report if isinstance(report, StoppedReport) else
                _from_data(StoppedReport, report, "a StoppedReport in a NodeStops record") for report in reports))


_STOP_FIELDS = StoppedReport._fields
# The types each column's values may have (a float column takes an int: a writer may hand one over); checked per
# column in one pass (set(map(type, ...))).
_STOP_TYPES = {name: {"int": frozenset({int}), "float": _NUMBER, "str": frozenset({str}),
                      "bool": frozenset({bool})}[kind] for name, kind in _field_types(StoppedReport).items()}
_STOP_DEFAULTS = StoppedReport._field_defaults


def _stop_columns(reports: tuple[StoppedReport, ...]) -> dict[str, Any]:
    """StoppedReports as the columns NodeStops travels with."""
    return {"kind": "stop_rows", **{name: [getattr(r, name) for r in reports] for name in _STOP_FIELDS}}


_STOP_GROUPS = tuple((types, tuple(_STOP_FIELDS.index(n) for n in _STOP_FIELDS if _STOP_TYPES[n] == types))
                     for types in set(_STOP_TYPES.values()))  # (types, the columns that take them)


def _stops_from_columns(data: dict[str, Any], where: str) -> tuple[StoppedReport, ...]:
    """The StoppedReports of _stop_columns' data; RecordError naming the column when one is missing (and has no
    default), is not a list as long as the others, or holds a value not of its field's type."""
    columns: list[Any] = list(map(data.get, _STOP_FIELDS))
    # Every check in a few C-level passes (one per group of columns of one type), not one per column and report.
    if data.get("kind") == "stop_rows" and set(map(type, columns)) == {list} and len(set(map(len, columns))) == 1 \
            and all(set(map(type, itertools.chain.from_iterable(map(columns.__getitem__, group)))) <= types
                    for types, group in _STOP_GROUPS):
        return tuple(map(_new_stopped, zip(*columns)))
    return _stops_from_columns_checked(data, where)


def _stops_from_columns_checked(data: dict[str, Any], where: str) -> tuple[StoppedReport, ...]:
    """_stops_from_columns column by column: the defaults of columns an older writer lacks, or the column that is
    wrong, named."""
    if data.get("kind") != "stop_rows":
        raise RecordError(f"{where} have kind {_shown(data.get('kind'))}, not 'stop_rows'; every process of a run must "
                          "be the same recycle version")
    rows = data.get("rank")
    count = len(rows) if isinstance(rows, list) else -1
    columns = []
    for name in _STOP_FIELDS:
        column = data.get(name)
        if column is None and name in _STOP_DEFAULTS and count >= 0:
            column = [_STOP_DEFAULTS[name]] * count  # (an older writer's digest lacks a newer field)
        if not isinstance(column, list) or len(column) != count:
            raise RecordError(f"{where} lack the column {name!r} of {max(count, 0)} values (found "
                              f"{_shown(column)}); every process of a run must be the same recycle version")
        wrong = set(map(type, column)) - _STOP_TYPES[name]
        if wrong:
            bad = next(v for v in column if type(v) in wrong)
            raise RecordError(f"{where} hold {_shown(bad)} in the column {name!r}, which takes "
                              f"{' or '.join(sorted(t.__name__ for t in _STOP_TYPES[name]))}; every process of a run "
                              "must be the same recycle version")
        columns.append(column)
    return tuple(map(_new_stopped, zip(*columns)))


# StoppedReport(*row) as one C call per row (the values are checked by column first).
_new_stopped: Callable[[tuple[Any, ...]], StoppedReport] = functools.partial(tuple.__new__, StoppedReport)


@dataclass(frozen=True)
class NodeStarted:
    """A node launcher's digest of its workers' records of a generation's start (key node_started/GENERATION/NODE/SEQ):
    each worker's Joined (groups formed) and Resumed (first action) go to the node's own store, and the launcher writes
    the coordinator one record with all that came in, so a recovery's start costs the coordinator's store a request
    or two per node, not two per worker (32,768 at 16,384 workers). Rows, each checked on construction:
    joined (rank, time, formation_s, method) and resumed (rank, time)."""

    node: int
    generation: int
    joined: tuple[tuple[int, float, float, str], ...] = ()
    resumed: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name, types in (("joined", _JOINED_ROW), ("resumed", _RESUMED_ROW)):
            rows = getattr(self, name)
            bad = next((row for row in rows if not isinstance(row, tuple) or len(row) != len(types)
                        or any(type(value) not in allowed for value, allowed in zip(row, types))), None) \
                if isinstance(rows, tuple) else rows
            if bad is not None:
                raise RecordError(f"a NodeStarted record holds {_shown(bad)} among its {name} rows, which are "
                                  f"({', '.join('|'.join(sorted(t.__name__ for t in allowed)) for allowed in types)}); "
                                  "every process of a run must be the same recycle version")

    @property
    def joined_records(self) -> dict[int, Joined]:
        return {rank: Joined(time, formation_s, method) for rank, time, formation_s, method in self.joined}

    @property
    def resumed_records(self) -> dict[int, Timestamp]:
        return {rank: Timestamp(time) for rank, time in self.resumed}


_JOINED_ROW = (frozenset({int}), _NUMBER, _NUMBER, frozenset({str}))
_RESUMED_ROW = (frozenset({int}), _NUMBER)


_KINDS: dict[str, type[DataclassInstance] | type[StoppedReport]] = {
    "job": JobSettings, "beat": Beat, "joined": Joined, "step": StepRecord, "eval": EvalRecord, "error": ErrorRecord,
    "fault": FaultRecord,
    "join_ready": JoinReady, "timestamp": Timestamp, "transfer": TransferRecord, "migration": MigrationRecord,
    "stopped": StoppedReport, "announce": Announcement, "node_hello": NodeHello, "worker_resync": WorkerResync,
    "node_stops": NodeStops, "node_started": NodeStarted}
_NAMES = {cls: kind for kind, cls in _KINDS.items()}
_RECORD_FIELDS = {cls: tuple(_field_types(cls)) for cls in _KINDS.values()}
_FIELD_NAMES = {kind: frozenset(_RECORD_FIELDS[cls]) for kind, cls in _KINDS.items()}  # (read per record)
# The fields that hold tuples: only their JSON arrays are turned back into tuples (the coordinator reads thousands of
# step records a second at scale, and walking every field of each was most of that).
_TUPLE_FIELDS = {kind: frozenset(name for name, kind_ in _field_types(cls).items() if kind_.startswith("tuple"))
                 for kind, cls in _KINDS.items()}

R = TypeVar("R")


def to_json(record: Any) -> str:
    """The record as one JSON object with its "kind"; floats keep every bit (JSON writes their repr)."""
    kind = _NAMES.get(type(record))
    if kind is None:
        raise TypeError(f"{type(record).__name__} is not a store record; use one of "
                        f"{', '.join(c.__name__ for c in _KINDS.values())}")
    return json.dumps(_data(record))


def _data(value: Any) -> Any:
    """A record as JSON data, each record (nested ones too) with its "kind"; a NodeStops' reports as columns."""
    kind = _NAMES.get(type(value))
    if kind is not None:  # (before the tuples below: a StoppedReport is one)
        columns = getattr(value, "COLUMNS", {})
        return {"kind": kind, **{name: _stop_columns(getattr(value, name)) if name in columns
                                 else _data(getattr(value, name)) for name in _RECORD_FIELDS[type(value)]}}
    if isinstance(value, (tuple, list)):
        return [_data(v) for v in value]
    return value


def _tuples(value: Any) -> Any:
    """JSON arrays back into the tuples the dataclasses hold."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def from_json(cls: type[R], text: bytes | str) -> R:
    """Read a record of class `cls` written by to_json; anything else raises RecordError naming what was found.
    Fields this version does not know are ignored (a newer writer may add some)."""
    where = f"a {cls.__name__} store record"
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RecordError(f"{where} is not JSON ({exc}); every process of a run must be the same recycle version") \
            from None
    return _from_data(cls, data, where)


def _from_data(cls: type[R], data: Any, where: str) -> R:
    kind = data.get("kind") if isinstance(data, dict) else None
    if not isinstance(kind, str) or kind not in _KINDS:
        raise RecordError(f"{where} has kind {kind!r}, which is unknown (known: {', '.join(_KINDS)}); every "
                          "process of a run must be the same recycle version")
    if _KINDS[kind] is not cls:
        raise RecordError(f"{where} was expected, but the key holds a {_KINDS[kind].__name__} (kind {kind!r})")
    names, tuples = _FIELD_NAMES[kind], _TUPLE_FIELDS[kind]  # cls's, checked above
    try:
        return cls(**{k: _tuples(v) if k in tuples else v for k, v in data.items() if k in names})
    except TypeError as exc:
        raise RecordError(f"{where} lacks a field ({exc}); every process of a run must be the same recycle "
                          "version") from None
