"""The records written to the job store between the processes of a run (worker <-> launcher): frozen dataclasses
with a JSON round-trip that names each record's kind, so both sides read and write the same typed fields."""

from __future__ import annotations

import itertools
import json
import operator
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from recycle.ir.worker import Worker

if TYPE_CHECKING:  # typeshed's type of a dataclass (what fields() takes); it exists only in the stubs
    from _typeshed import DataclassInstance

__all__ = ["RecordError", "StepRecord", "EvalRecord", "ErrorRecord", "FaultRecord", "JoinReady", "Timestamp",
           "TransferRecord", "MigrationRecord", "StoppedReport", "Announcement", "Joined", "Beat", "JobSettings",
           "NodeHello", "WorkerResync", "StepRows", "NodeSteps", "NodeStops", "NodeStarted", "to_json",
           "from_json"]


class RecordError(ValueError):
    """A store record that cannot be read as the record expected (unknown kind, another kind, missing fields):
    a process of another recycle version, or a key written by something else."""


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


@dataclass(frozen=True)
class StoppedReport:
    """What a worker says when it leaves a generation after a failure: how far its weights got, and the work it had
    done that a roll-back would throw away."""

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
    coordinator reads thousands a second at scale, and one JSON array per field decodes and checks in a few C-level
    passes where a dataclass per worker cost most of its CPU (docs/cluster.md, "Step records go through the node").
    Every column is checked on construction: same length, each value of its field's type."""

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
    def gather(cls, picks: list[tuple[StepRows, int]]) -> StepRows:
        """The rows `picks` names ((rows, index) each), in that order, checked (a batch read by `unchecked` is
        checked here, once for the whole step: RecordError if a value is not of its field's type). Consecutive rows
        of one batch are taken as one slice per column: a step's picks, in rank order, are mostly each node's batch
        whole."""
        runs: list[tuple[StepRows, int, int]] = []  # (rows, first, past the last)
        last: StepRows | None = None
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
        batches, firsts, pasts = zip(*runs) if runs else ((), (), ())
        slices = list(map(slice, firsts, pasts))
        columns = [tuple(itertools.chain.from_iterable(map(operator.getitem, map(attribute, batches), slices)))
                   for attribute in _ATTRIBUTES]
        columns[_TIMINGS] = _timings_as_tuples(columns[_TIMINGS])
        return cls(*columns)

    @classmethod
    def unchecked(cls, data: Any, where: str) -> StepRows:
        """Rows from the JSON data to_json wrote, with only what the coordinator acts on at once checked: 13
        columns of one length, and int replica, stage and generation (anything else raises RecordError). The other
        values are checked when the step is gathered (`gather`), in one pass over all of the step's rows instead of
        one per node: the coordinator reads a node's batch per step and node, thousands a second at scale. Until
        then the columns are the JSON's lists."""
        if not isinstance(data, dict) or data.get("kind") != "step_rows":
            raise RecordError(f"{where} holds {_shown(data)} where step rows (kind 'step_rows') were expected; every "
                              "process of a run must be the same recycle version")
        columns: list[Any] = list(map(data.get, _COLUMNS))
        if set(map(type, columns)) != {list} or len(set(map(len, columns))) != 1 or \
                not set(map(type, itertools.chain(*columns[:3]))) <= {int}:
            cls.from_data(data, where)  # the full check names what is wrong
        rows = object.__new__(cls)
        rows.__dict__.update(zip(_COLUMNS, columns))  # (a frozen dataclass: no __init__, whose check comes later)
        return rows

    @classmethod
    def from_data(cls, data: Any, where: str) -> StepRows:
        """Rows from the JSON data to_json wrote (arrays back into tuples); anything else raises RecordError."""
        if not isinstance(data, dict) or data.get("kind") != "step_rows":
            raise RecordError(f"{where} holds {_shown(data)} where step rows (kind 'step_rows') were expected; every "
                              "process of a run must be the same recycle version")
        if set(map(type, map(data.get, _COLUMNS))) != {list}:  # one C-level pass over the 13 columns
            missing = [name for name in _COLUMNS if type(data.get(name)) is not list]
            raise RecordError(f"{where}: the step rows lack the column(s) {', '.join(missing)} (or hold no list "
                              "there); every process of a run must be the same recycle version")
        columns = [tuple(data[name]) for name in _COLUMNS]
        columns[_TIMINGS] = _timings_as_tuples(columns[_TIMINGS])
        return cls(*columns)

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
    for timings in columns[_INDEX["timings"]] if any(columns[_INDEX["timings"]]) else ():
        for timing in timings:
            if not (type(timing) is tuple and len(timing) == 3 and type(timing[0]) is str
                    and type(timing[1]) in _NUMBER and type(timing[2]) in _NUMBER):
                raise RecordError(f"step rows: a timing is {_shown(timing)}, not (action, start, end); every "
                                  "process of a run must be the same recycle version")


_INDEX = {name: i for i, name in enumerate(_COLUMNS)}
_ALL_COLUMNS = operator.attrgetter(*_COLUMNS)  # a StepRows' columns as a tuple, in one C call
_ATTRIBUTES = tuple(map(operator.attrgetter, _COLUMNS))
_TIMINGS = _COLUMNS.index("timings")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class NodeSteps:
    """A node launcher's step records of one step (key node_metrics/STEP/NODE/SEQ): its workers write theirs to the
    node's own store, and the launcher hands the coordinator the ones that came in since its last look, one record per
    step, so the coordinator's reads grow with the nodes, not the workers. SEQ counts the launcher's writes: each key
    is written once, so its reader may delete it once read. The records travel as columns (StepRows)."""

    node: int
    step: int
    rows: StepRows

    def __post_init__(self) -> None:
        # from_json hands the nested rows over as the dict JSON holds: read it as the StepRows it must be.
        if not isinstance(self.rows, StepRows):
            object.__setattr__(self, "rows", StepRows.from_data(self.rows, "a NodeSteps record"))

    @classmethod
    def read_unchecked(cls, text: bytes | str) -> NodeSteps:
        """The coordinator's read of a batch: from_json's, with the rows read by `StepRows.unchecked` (their values
        are checked when their step is gathered, for all of the step's nodes at once)."""
        try:
            data = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError):
            data = None
        if not isinstance(data, dict) or data.get("kind") != "node_steps" or not _NODE_STEPS_FIELDS <= data.keys():
            return from_json(cls, text)  # which names what is wrong
        return cls(data["node"], data["step"], StepRows.unchecked(data["rows"], "a NodeSteps record"))

    @property
    def records(self) -> tuple[StepRecord, ...]:
        """Each row as a StepRecord (tests and tools; the coordinator reads the columns)."""
        return tuple(self.rows.record(i) for i in range(len(self.rows)))


_NODE_STEPS_FIELDS = frozenset({"node", "step", "rows"})


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


_STOP_FIELDS = tuple(f.name for f in fields(StoppedReport))
# The types each column's values may have (a float column takes an int: a writer may hand one over); checked per
# column in one pass (set(map(type, ...))).
_STOP_TYPES = {f.name: {"int": frozenset({int}), "float": _NUMBER, "str": frozenset({str}),
                        "bool": frozenset({bool})}[str(f.type)] for f in fields(StoppedReport)}
_STOP_DEFAULTS = {f.name: f.default for f in fields(StoppedReport) if f.default is not MISSING}


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


def _new_stopped(row: tuple[Any, ...]) -> StoppedReport:
    """StoppedReport(*row) without the frozen dataclass's __init__, which sets each of its 14 fields through
    object.__setattr__ (the values are checked by column first)."""
    report = object.__new__(StoppedReport)
    report.__dict__.update(zip(_STOP_FIELDS, row))
    return report


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


_KINDS: dict[str, type[DataclassInstance]] = {
    "job": JobSettings, "beat": Beat, "joined": Joined, "step": StepRecord, "eval": EvalRecord, "error": ErrorRecord,
    "fault": FaultRecord,
    "join_ready": JoinReady, "timestamp": Timestamp, "transfer": TransferRecord, "migration": MigrationRecord,
    "stopped": StoppedReport, "announce": Announcement, "node_hello": NodeHello, "worker_resync": WorkerResync,
    "node_steps": NodeSteps, "step_rows": StepRows, "node_stops": NodeStops, "node_started": NodeStarted}
_NAMES = {cls: kind for kind, cls in _KINDS.items()}
_FIELD_NAMES = {kind: frozenset(f.name for f in fields(cls)) for kind, cls in _KINDS.items()}  # (read per record)
# The fields that hold tuples: only their JSON arrays are turned back into tuples (the coordinator reads thousands of
# step records a second at scale, and walking every field of each was most of that).
_TUPLE_FIELDS = {kind: frozenset(f.name for f in fields(cls) if str(f.type).startswith("tuple"))
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
    if kind is not None:
        columns = getattr(value, "COLUMNS", {})
        return {"kind": kind, **{f.name: _stop_columns(getattr(value, f.name)) if f.name in columns
                                 else _data(getattr(value, f.name)) for f in fields(value)}}
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
