"""Read failure traces: `time_ms,add|remove,node` event logs, `time_ms,live` availability logs and Bamboo's
`date, time, live` availability logs, messy input included (BOM, header, comments, out-of-order lines)."""

from __future__ import annotations

import collections
import datetime
import itertools
import os
import re
import stat
from dataclasses import replace
from pathlib import Path
from typing import IO, Callable, Iterable, Iterator

from recycle.errors import TraceError
from recycle.inputs import MIB, describe_kind
from recycle.traces.placement import availability_to_events
from recycle.traces.trace import (ADD, MAX_NODES_WHY, MAX_TRACE_LINES, MAX_TRACE_NODES, REMOVE, AvailabilityTrace,
                                  EventTrace, TraceEvent, TraceNotes, WorkerGrid)

__all__ = [
    "parse_event_lines",
    "parse_availability_lines",
    "parse_dated_availability_lines",
    "read_trace",
    "MAX_TRACE_BYTES",
]

MAX_TRACE_BYTES = 512 * MIB  # MAX_TRACE_LINES lines of ~20 bytes plus comments
MAX_LINE_CHARS = 4096
MAX_NODE_NAME = 200  # characters (node_order reads the digits of a name as one number)

def _where(source: str, lineno: int) -> str:
    return f"{source or 'trace'}:{lineno}"


def _split(line: str) -> list[str]:
    return [part.strip() for part in line.split(",")]


def _parse_time(text: str, source: str, lineno: int, line: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise TraceError(f"{_where(source, lineno)}: time {text!r} in line {line!r} is not a number; the first "
                         "column must be milliseconds since the start of the trace (e.g. 3600000)") from None
    if value != value or value < 0 or value in (float("inf"), float("-inf")):
        raise TraceError(f"{_where(source, lineno)}: time {text!r} must be a finite number >= 0 (milliseconds); "
                         "fix or delete that line")
    return int(round(value))


_NUMBER = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_HEADER_FIELD = re.compile(r"^[A-Za-z_#][A-Za-z0-9_ #()/.\-]*$")


def _is_number(text: str) -> bool:
    return bool(_NUMBER.match(text.strip()))


def _header(first: tuple[int, str] | None, source: str, columns: tuple[int, ...]) -> bool:
    """Whether the first content line is a header (every field a name, e.g. `time_ms,live` or `date, time,
    #instances`). A first line that is neither a header nor data is an error, never skipped silently."""
    if first is None:
        return False
    lineno, line = first
    fields = _split(line)
    if _is_number(fields[0]) or _DATE.match(fields[0]):
        return False
    names = [f.lower() for f in fields]
    if (len(fields) in columns and all(_HEADER_FIELD.match(f) for f in fields)
            and (names[0].startswith(("time", "date", "ts", "t_")) or names[0] == "t")
            and not {"add", "remove"} & set(names)):
        return True
    raise TraceError(f"{_where(source, lineno)}: first line {line[:80]!r} is neither data nor a header; a trace is "
                     "CSV lines time_ms,add|remove,node (events), time_ms,live or YYYY-MM-DD, HH:MM:SS, live "
                     "(availability), optionally under one header line of column names")


class _Skipped:
    """Blank and comment lines seen so far (the lines are read lazily, so the counts grow as they are)."""

    def __init__(self) -> None:
        self.blank = self.comments = 0


def _content_lines(lines: Iterable[str], skipped: _Skipped) -> Iterator[tuple[int, str]]:
    """Non-blank, non-comment lines with their 1-based numbers, lazily; the skipped ones are counted in `skipped`.
    A UTF-8 byte-order mark at the start is dropped (editors on Windows write one)."""
    for lineno, raw in enumerate(lines, start=1):
        line = (raw.lstrip("\ufeff") if lineno == 1 else raw).strip()
        if not line:
            skipped.blank += 1
        elif line.startswith("#"):
            skipped.comments += 1
        else:
            yield lineno, line


def _data_rows(lines: Iterable[str], source: str, width: int,
               form: str) -> tuple[Callable[[], TraceNotes], Iterator[tuple[int, str, list[str]]]]:
    """A function giving the notes on the skipped lines (blank, comment, header: complete once the rows are
    consumed), and the data lines as (line number, line, fields), each checked to have `width` fields (else a
    TraceError saying the line's `form`), lazily, in file order; more than MAX_TRACE_LINES data lines is an error."""
    skipped = _Skipped()
    kept = _content_lines(lines, skipped)
    first = next(kept, None)
    header = _header(first, source, (width,))

    def rows() -> Iterator[tuple[int, str, list[str]]]:
        pending = [] if header or first is None else [first]
        for count, (lineno, line) in enumerate(itertools.chain(pending, kept), start=1):
            if count > MAX_TRACE_LINES:
                raise TraceError(f"{_where(source, lineno)}: more than {MAX_TRACE_LINES:,} data lines, the limit for "
                                 "one trace (each becomes a change point of the replay, which keeps the live set at "
                                 "every one); cut the trace into shorter windows")
            parts = _split(line)
            if len(parts) != width:
                raise TraceError(f"{_where(source, lineno)}: line {line!r} has {len(parts)} field(s); {form}")
            yield lineno, line, parts

    return (lambda: TraceNotes(skipped.blank, skipped.comments, header)), rows()


def parse_event_lines(lines: Iterable[str], source: str = "", strict: bool = False,
                      end_ms: int | None = None) -> EventTrace:
    """Parse `time_ms,add|remove,node` lines into a cleaned EventTrace.

    Messy input is handled deliberately and counted in `notes`: blank and `#` lines are skipped; a header line is
    recognised; out-of-order lines are sorted stably by time; at one timestamp the events are applied in file
    order as one change; a remove of an absent node or an add of a present node is dropped. With `strict=True`
    every one of those fixes (except blank lines, comments and the header) is a TraceError instead.
    Malformed lines always raise a TraceError naming the line number, the value and the fix.
    """
    notes, rows = _data_rows(lines, source, 3, "an event trace line is time_ms,add|remove,node (e.g. "
                                                "60000,remove,node7)")
    parsed, out_of_order = _timed_events(rows, source, strict)
    if not parsed:
        raise TraceError(f"{source or 'trace'}: no events found; an event trace has lines time_ms,add|remove,node")
    last = parsed[-1][0]
    events, initial, counts = _net_changes(parsed, source, strict)
    del parsed
    end = last if end_ms is None else end_ms
    if end < last:
        raise TraceError(f"{source or 'trace'}: the trace ends at {end} ms but has events up to {last} ms; give an "
                         "end time at or after the last event")
    notes = replace(notes(), out_of_order=out_of_order, **counts)
    return EventTrace(tuple(events), frozenset(initial), end, source, notes)


def _timed_events(rows: Iterable[tuple[int, str, list[str]]], source: str,
                  strict: bool) -> tuple[list[tuple[int, int, TraceEvent]], int]:
    """(time, line number, event) for every line, sorted stably by time, and how many lines were out of order."""
    parsed: list[tuple[int, int, TraceEvent]] = []
    out_of_order = 0
    last_time = -1
    names: dict[str, str] = {}  # one string per node name, not one per line
    for lineno, line, parts in rows:
        t = _parse_time(parts[0], source, lineno, line)
        action = parts[1].lower()
        if action not in (ADD, REMOVE):
            raise TraceError(f"{_where(source, lineno)}: action {parts[1]!r} in line {line!r} must be 'add' or "
                             "'remove'")
        if not parts[2]:
            raise TraceError(f"{_where(source, lineno)}: line {line!r} has an empty node name; name the node "
                             "(e.g. node7)")
        if t < last_time:
            out_of_order += 1
            if strict:
                raise TraceError(f"{_where(source, lineno)}: time {t} is earlier than the line before ({last_time});"
                                 " sort the trace by time (or read it without --strict)")
        last_time = max(last_time, t)
        if len(parts[2]) > MAX_NODE_NAME:
            raise TraceError(f"{_where(source, lineno)}: node name {parts[2][:40]!r}... has {len(parts[2]):,} "
                             f"characters, above the limit of {MAX_NODE_NAME}; name nodes briefly (e.g. node7)")
        node = names.setdefault(parts[2], parts[2])
        if len(names) > MAX_TRACE_NODES:
            raise TraceError(f"{_where(source, lineno)}: node {node[:40]!r} is the trace's {len(names):,}th distinct "
                             f"node, above the limit of {MAX_TRACE_NODES:,} ({MAX_NODES_WHY}); name fewer nodes")
        parsed.append((t, lineno, TraceEvent(t, ADD if action == ADD else REMOVE, node)))
    if out_of_order:
        parsed.sort(key=lambda item: item[0])  # stable: simultaneous events keep their file order
    return parsed, out_of_order


def _net_changes(parsed: list[tuple[int, int, TraceEvent]], source: str,
                 strict: bool) -> tuple[list[TraceEvent], set[str], dict[str, int]]:
    """(events, nodes live at time 0, counts for TraceNotes): the events of each timestamp applied in file order,
    then collapsed to their net effect, one change of the live set per timestamp."""
    live: set[str] = set()
    initial: set[str] = set()
    events: list[TraceEvent] = []
    counts = dict.fromkeys(("repeated_adds", "repeated_removes", "simultaneous_groups", "cancelled_pairs"), 0)
    for t, items in itertools.groupby(parsed, key=lambda item: item[0]):
        group = [(lineno, e) for _, lineno, e in items]
        counts["simultaneous_groups"] += len(group) > 1
        before = set(live)
        for lineno, e in group:
            dropped = _apply(e, lineno, live, source, strict)
            if dropped:
                counts[dropped] += 1
        per_node = collections.Counter(e.node for _, e in group)
        counts["cancelled_pairs"] += sum(1 for n, k in per_node.items() if k >= 2 and (n in before) == (n in live))
        if t == 0:
            initial = set(live)
        else:
            events.extend(TraceEvent(t, REMOVE, node) for node in sorted(before - live))
            events.extend(TraceEvent(t, ADD, node) for node in sorted(live - before))
    return events, initial, counts


def _apply(e: TraceEvent, lineno: int, live: set[str], source: str, strict: bool) -> str | None:
    """Apply one event to `live`; an add of a present node or a remove of an absent one is dropped, and its
    TraceNotes count named (a TraceError with `strict`)."""
    if e.action == ADD and e.node in live:
        if strict:
            raise TraceError(f"{_where(source, lineno)}: node {e.node!r} is added at {e.time_ms} ms but is already "
                             "present; delete the repeated add (or read the trace without --strict)")
        return "repeated_adds"
    if e.action == REMOVE and e.node not in live:
        if strict:
            raise TraceError(f"{_where(source, lineno)}: node {e.node!r} is removed at {e.time_ms} ms but is not "
                             "present; delete the repeated remove (or read the trace without --strict)")
        return "repeated_removes"
    (live.add if e.action == ADD else live.discard)(e.node)
    return None


def parse_availability_lines(lines: Iterable[str], source: str = "", strict: bool = False,
                             end_ms: int | None = None) -> AvailabilityTrace:
    """Parse `time_ms,live` lines (live = number of available nodes from that time on); see `_availability`."""
    notes, rows = _data_rows(lines, source, 2, "an availability line is time_ms,live (e.g. 3600000,22)")
    samples = [(lineno, _parse_time(parts[0], source, lineno, line), _parse_count(parts[1], source, lineno, line))
               for lineno, line, parts in rows]
    return _availability(samples, source, strict, end_ms, notes())


def parse_dated_availability_lines(lines: Iterable[str], source: str = "", strict: bool = False,
                                   end_ms: int | None = None) -> AvailabilityTrace:
    """Parse Bamboo's availability logs, `YYYY-MM-DD, HH:MM:SS, live` (its published GCP traces); times count
    from the earliest line. See `_availability` for the treatment of out-of-order lines."""
    notes, rows = _data_rows(lines, source, 3, "a dated availability line is YYYY-MM-DD, HH:MM:SS, live (e.g. "
                                                "2021-12-11, 11:11:30, 55)")
    stamped: list[tuple[int, datetime.datetime, int]] = []
    for lineno, line, parts in rows:
        try:
            when = datetime.datetime.fromisoformat(f"{parts[0]}T{parts[1]}")
        except ValueError:
            raise TraceError(f"{_where(source, lineno)}: {parts[0]!r}, {parts[1]!r} in line {line!r} is not a date "
                             "and time like 2021-12-11, 11:11:30") from None
        stamped.append((lineno, when, _parse_count(parts[2], source, lineno, line)))
    if not stamped:
        raise TraceError(f"{source or 'trace'}: no samples found; a dated availability trace has lines "
                         "YYYY-MM-DD, HH:MM:SS, live")
    origin = min(when for _, when, _ in stamped)
    rows_ms = [(lineno, int(round((when - origin).total_seconds() * 1000)), count) for lineno, when, count in stamped]
    return _availability(rows_ms, source, strict, end_ms, notes())


def _parse_count(text: str, source: str, lineno: int, line: str) -> int:
    try:
        count = int(text)
    except ValueError:
        raise TraceError(f"{_where(source, lineno)}: live count {text!r} in line {line!r} must be a whole "
                         "number of nodes >= 0") from None
    if count < 0:
        raise TraceError(f"{_where(source, lineno)}: live count {count} must be >= 0")
    if count > MAX_TRACE_NODES:
        raise TraceError(f"{_where(source, lineno)}: live count {count} is above the limit of {MAX_TRACE_NODES:,} "
                         f"nodes ({MAX_NODES_WHY}); check the column (it counts nodes, not GPUs or bytes)")
    return count


def _availability(rows: list[tuple[int, int, int]], source: str, strict: bool, end_ms: int | None,
                  notes: TraceNotes) -> AvailabilityTrace:
    """(line, time_ms, live) rows in file order -> an AvailabilityTrace.

    The file order is taken as the order of observation: a line whose time is earlier than the line before does
    not get sorted in among older samples (Bamboo's monitors log each reading three times a minute apart, and the
    next reading can start before the last repeat: sorting turned 80, 79, 80 into 80, 79, 80, 79, 80). Instead it
    replaces every sample recorded for its time or later, and holds from its time on. Counted in the notes; an
    error with `strict`. Several samples at one time: the last one in the file wins.
    """
    if not rows:
        raise TraceError(f"{source or 'trace'}: no samples found; an availability trace has lines time_ms,live")
    samples: list[tuple[int, int]] = []  # (time, live), times strictly increasing
    superseded = groups = 0
    last_time = -1
    for lineno, t, count in rows:
        if t < last_time:
            superseded += 1
            if strict:
                raise TraceError(f"{_where(source, lineno)}: time {t} ms is earlier than the line before "
                                 f"({last_time} ms); sort the trace by time (or read it without --strict: then the "
                                 "later line replaces the samples from its time on)")
        elif t == last_time:
            groups += 1
        while samples and samples[-1][0] >= t:
            samples.pop()
        samples.append((t, count))
        last_time = t
    times: list[int] = []
    live: list[int] = []
    for t, count in samples:
        if live and live[-1] == count:
            continue  # no change
        times.append(t)
        live.append(count)
    if times[0] != 0:
        raise TraceError(f"{source or 'trace'}: the first sample is at {times[0]} ms; an availability trace must "
                         "say how many nodes are live at time 0 (add a line 0,N)")
    last = max(t for _, t, _ in rows)
    end = last if end_ms is None else end_ms
    notes = replace(notes, simultaneous_groups=groups, superseded=superseded)
    return AvailabilityTrace(tuple(times), tuple(live), end, source, notes)


def read_trace(path: str | Path, strict: bool = False, end_ms: int | None = None, seed: int = 0,
               placement: str = "random", grid: WorkerGrid | None = None) -> EventTrace:
    """Read an event trace (3 columns) or an availability trace (2 columns) from a file, as an EventTrace.
    `seed`, `placement` and `grid` choose the failing nodes of an availability trace (`availability_to_events`).
    The file is read line by line (never whole), at most MAX_TRACE_BYTES of a regular file."""
    path = Path(path)
    fix = ("pass --trace with a CSV of time_ms,add|remove,node lines (e.g. ../shared/data/traces/bamboo-ec2-p3.csv) "
           "or use --generate")
    try:
        info = os.stat(path)
    except OSError:
        raise TraceError(f"trace file {str(path)!r} does not exist; {fix}") from None
    if not stat.S_ISREG(info.st_mode):
        raise TraceError(f"trace file {str(path)!r} is {describe_kind(info.st_mode)}, not a regular file; {fix}")
    if info.st_size > MAX_TRACE_BYTES:
        raise TraceError(f"trace file {str(path)!r} is {info.st_size / MIB:.0f} MiB, above the limit of "
                         f"{MAX_TRACE_BYTES / MIB:g} MiB for one trace; cut it into shorter windows")
    try:
        with _open_text(path) as f:
            kind = _detect(f, str(path))
        with _open_text(path) as f:
            lines = _bounded(f, str(path))
            if kind == "event":
                return parse_event_lines(lines, str(path), strict, end_ms)
            parse = parse_availability_lines if kind == "availability" else parse_dated_availability_lines
            counts = parse(lines, str(path), strict, end_ms)
    except UnicodeDecodeError:
        raise TraceError(f"trace file {str(path)!r} is not UTF-8 text; pass a CSV file") from None
    except OSError as exc:
        raise TraceError(f"trace file {str(path)!r} cannot be read ({exc.strerror or exc}); {fix}") from None
    return availability_to_events(counts, seed=seed, placement=placement, grid=grid)


def _open_text(path: Path) -> IO[str]:
    # utf-8-sig: a byte-order mark is not part of the first line; universal newlines (\n, \r\n, \r)
    return open(path, encoding="utf-8-sig", newline=None)


def _bounded(lines: Iterable[str], source: str) -> Iterator[str]:
    """The lines, refusing any longer than MAX_LINE_CHARS (a binary file with no newline would otherwise be one
    line of the whole file) and stopping at MAX_TRACE_BYTES read (a file that grows while it is read)."""
    read = 0
    for lineno, line in enumerate(lines, start=1):
        if len(line) > MAX_LINE_CHARS:
            raise TraceError(f"{_where(source, lineno)}: line of {len(line):,} characters, above the limit of "
                             f"{MAX_LINE_CHARS:,}; a trace line is a few fields of CSV")
        read += len(line)
        if read > MAX_TRACE_BYTES:
            raise TraceError(f"{source}: more than {MAX_TRACE_BYTES / MIB:g} MiB read, the limit for one trace; cut "
                             "it into shorter windows")
        yield line


def _detect(lines: Iterable[str], source: str) -> str:
    """'event', 'availability' or 'dated' from the first data line (after an optional header); reads only up to
    that line."""
    kept = _content_lines(_bounded(lines, source), _Skipped())
    first = next(kept, None)
    if first is None:
        raise TraceError(f"{source}: no data lines; a trace is CSV lines time_ms,add|remove,node (events), "
                         "time_ms,live or YYYY-MM-DD, HH:MM:SS, live (availability)")
    if _header(first, source, (2, 3)):
        first = next(kept, None)
    if first is None:
        raise TraceError(f"{source}: only a header line; add the data lines under it")
    lineno, line = first
    fields = _split(line)
    if len(fields) == 3 and _DATE.match(fields[0]):
        return "dated"
    if len(fields) == 2:
        return "availability"
    if len(fields) == 3:
        return "event"
    raise TraceError(f"{_where(source, lineno)}: line {line[:80]!r} has {len(fields)} field(s); a trace line is "
                     "time_ms,add|remove,node (events), time_ms,live or YYYY-MM-DD, HH:MM:SS, live (availability)")
