"""Text grid of a timed run: one row per worker, one column per time slot (or a fixed number of scaled columns)."""

from __future__ import annotations

from typing import Callable

from recycle.ir.actions import Kind
from recycle.ir.plan import Plan
from recycle.report.timeline import TimedAction, timed_actions
from recycle.sim.simulator import SimResult

__all__ = ["timed_grid", "KIND_LETTER"]

# One character per kind for scaled grids; re-routed work is shown in lower case.
KIND_LETTER = {Kind.F: "F", Kind.B: "B", Kind.W: "W", Kind.BW: "X", Kind.OPT: "O"}
_IDLE = "."


def _is_whole(x: float) -> bool:
    return abs(x - round(x)) < 1e-9


def timed_grid(result: SimResult, plan: Plan, iteration: int | None = 0, columns: int = 100) -> str:
    """The timeline of one iteration (None: all recorded ones) as text.

    Slot mode, when every start and end is a whole number and the span fits in `columns`: one cell per time unit
    holding the action's compact label ("F7", "BW3", "OPT", '*' = re-routed) in its first slot and '-' in the
    slots it continues into. Otherwise scaled mode: `columns` one-character cells, each showing the action that
    covers the cell's midpoint (letters in the legend).
    """
    events = timed_actions(result, plan, None if iteration is None else {iteration})
    if not events:
        raise ValueError(f"no recorded actions for iteration {iteration}; the run has {result.num_iterations}")
    t0 = min(e.start for e in events)
    t1 = max(e.end for e in events)
    by_rank: dict[int, list[TimedAction]] = {}
    for e in events:
        by_rank.setdefault(e.rank, []).append(e)
    span = t1 - t0
    slot_mode = span <= columns and all(_is_whole(e.start) and _is_whole(e.end) for e in events)
    if slot_mode:
        body, axis = _slot_rows(plan, by_rank, t0, int(round(span)))
        legend = "cells: F/B/W/BW + micro-batch, OPT = all-reduce + optimizer step, '-' continues, '.' idle, " \
                 "'*' re-routed"
    else:
        body, axis = _scaled_rows(plan, by_rank, t0, span, columns)
        legend = (f"1 column = {span / columns:.4g} time units; F forward, B input-grad, W weight-grad, X fused "
                  "backward, O optimizer; lower case = re-routed; '.' idle")
    which = "all iterations" if iteration is None else f"iteration {iteration}"
    header = f"timeline of {which}: t = {t0:g} .. {t1:g}"
    return "\n".join([header, axis, *body, legend])


def _row_label(plan: Plan, rank: int) -> str:
    replica, stage = plan.worker(rank)
    return f"({replica},{stage})"


def _rows(plan: Plan, by_rank: dict[int, list[TimedAction]],
          cells: Callable[[list[TimedAction]], str]) -> tuple[list[str], int]:
    """One row per worker: its label, then `cells` of its actions (or DOWN / no actions); and the label width."""
    label_w = max(len(_row_label(plan, r)) for r in range(plan.num_workers))
    rows = []
    for rank in range(plan.num_workers):
        label = _row_label(plan, rank).rjust(label_w)
        if rank not in by_rank:
            rows.append(f"{label} DOWN" if plan.worker(rank) in plan.failed else f"{label} (no actions)")
        else:
            rows.append(f"{label} {cells(by_rank[rank])}".rstrip())
    return rows, label_w


def _slot_rows(plan: Plan, by_rank: dict[int, list[TimedAction]], t0: float, slots: int) -> tuple[list[str], str]:
    width = max(len(e.label) for events in by_rank.values() for e in events)

    def cells(events: list[TimedAction]) -> str:
        row = [_IDLE.ljust(width)] * slots
        for e in events:
            first = int(round(e.start - t0))
            last = int(round(e.end - t0))
            if last == first:  # zero-duration action (e.g. a free optimizer): still show it
                last = first + 1
            for c in range(first, min(last, slots)):
                row[c] = (e.label if c == first else "-").ljust(width)
        return " ".join(row)

    rows, label_w = _rows(plan, by_rank, cells)
    marks = "".join(f"{c:<{width + 1}}" if c % 5 == 0 else " " * (width + 1) for c in range(slots))
    return rows, f"{'t'.rjust(label_w)} {marks}".rstrip()


def _scaled_rows(plan: Plan, by_rank: dict[int, list[TimedAction]], t0: float, span: float,
                 columns: int) -> tuple[list[str], str]:
    step = span / columns if span > 0 else 1.0

    def cells(actions: list[TimedAction]) -> str:
        row = [_IDLE] * columns
        events = sorted(actions, key=lambda e: e.start)
        i = 0
        for c in range(columns):
            mid = t0 + (c + 0.5) * step
            while i < len(events) and events[i].end <= mid:
                i += 1
            if i < len(events) and events[i].start <= mid:
                e = events[i]
                letter = KIND_LETTER[e.action.kind]
                row[c] = letter.lower() if e.rerouted else letter
        return "".join(row)  # letters and '.', never a space: the row's rstrip keeps every cell

    rows, label_w = _rows(plan, by_rank, cells)
    marks = "".join("|" if c % 10 == 0 else " " for c in range(columns))
    return rows, f"{'t'.rjust(label_w)} {marks}  (| every {10 * step:.4g})"
