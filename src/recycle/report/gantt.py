"""Gantt chart PNG of a timed run (matplotlib, Agg backend): one row per worker, one colour per action kind."""

from __future__ import annotations

import io
from collections import defaultdict
from pathlib import Path

from recycle.fileio import atomic_write_bytes
from recycle.report.units import time_axis
from recycle.ir.actions import Kind
from recycle.ir.plan import Plan
from recycle.report.timeline import timed_actions
from recycle.sim.simulator import SimResult

__all__ = ["write_gantt", "gantt_figure", "KIND_COLOURS", "REROUTED_HATCH"]

KIND_COLOURS = {Kind.F: "#4C78A8", Kind.B: "#F58518", Kind.W: "#54A24B", Kind.BW: "#E45756", Kind.OPT: "#8C8C8C"}
KIND_NAMES = {Kind.F: "F forward", Kind.B: "B input-grad", Kind.W: "W weight-grad", Kind.BW: "BW fused backward",
              Kind.OPT: "OPT all-reduce + step"}
_WIDTH_IN = 14.0
_DPI = 110
_MAX_LABELLED_ROWS = 64  # beyond this, rows are too thin for text
REROUTED_HATCH = "////"


def _pyplot():
    """pyplot on the Agg backend (files only, never a display); imported lazily so the CLI starts fast."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_gantt(result: SimResult, plan: Plan, path: str | Path, title: str = "", time_unit: str = "") -> Path:
    """Draw every recorded action as a bar; re-routed micro-batches (host != owner) are hatched. Written atomically."""
    plt = _pyplot()
    fig = gantt_figure(result, plan, title, time_unit)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    return atomic_write_bytes(path, buffer.getvalue())


def gantt_figure(result: SimResult, plan: Plan, title: str = "", time_unit: str = ""):
    """The matplotlib Figure behind write_gantt (the caller closes it)."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    events = timed_actions(result, plan)
    n = plan.num_workers
    t0 = min(e.start for e in events)
    t1 = max(e.end for e in events)
    span = max(t1 - t0, 1e-9)
    row_in = 0.32 if n <= 32 else max(0.02, 12.0 / n)
    fig, ax = plt.subplots(figsize=(_WIDTH_IN, 1.6 + row_in * n), dpi=_DPI)
    # Bars grouped per (row, kind, re-routed) so that a big plan is a few hundred draw calls, not one per action.
    groups: dict[tuple[int, Kind, bool], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        groups[(e.rank, e.action.kind, e.rerouted)].append((e.start, max(e.end - e.start, span * 1e-4)))
    for (rank, kind, rerouted), bars in groups.items():
        # The hatch takes the edge colour: dark on re-routed bars so the stripes show, white separators otherwise.
        ax.broken_barh(bars, (rank - 0.4, 0.8), facecolors=KIND_COLOURS[kind],
                       edgecolors="#333333" if rerouted else "white",
                       linewidth=0.4 if n <= _MAX_LABELLED_ROWS else 0.0, hatch=REROUTED_HATCH if rerouted else None)
    if n <= _MAX_LABELLED_ROWS:
        points_per_unit = _WIDTH_IN * 0.8 * 72 / span  # approximate bar width in points per time unit
        for e in events:
            text = e.label.rstrip("*")
            if (e.end - e.start) * points_per_unit >= 4.2 * len(text) + 2:  # only where the text fits
                # On hatched bars the id sits on a solid patch of the bar colour, so it stays readable.
                box = dict(facecolor=KIND_COLOURS[e.action.kind], edgecolor="none", pad=0.6) if e.rerouted else None
                ax.text((e.start + e.end) / 2, e.rank, text, ha="center", va="center", fontsize=6.5,
                        color="white", clip_on=True, bbox=box)
    for replica, stage in plan.failed:
        rank = plan.rank(replica, stage)
        ax.broken_barh([(t0, span)], (rank - 0.4, 0.8), facecolors="#EEEEEE", edgecolors="#BBBBBB")
        ax.text(t0 + span / 2, rank, "DOWN", ha="center", va="center", fontsize=7, color="#777777")
    ax.set_ylim(n - 0.5, -0.5)  # rank 0 on top
    ax.set_xlim(t0, t1)
    if n <= _MAX_LABELLED_ROWS:
        ax.set_yticks(range(n))
        ax.set_yticklabels([f"({r // plan.num_stages},{r % plan.num_stages})" for r in range(n)], fontsize=7)
    ax.set_ylabel("worker (replica, stage)")
    divisor, label = time_axis(time_unit, span)
    if divisor != 1.0:  # ticks in ms or s rather than µs with a x1e7 offset
        from matplotlib.ticker import FuncFormatter

        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x / divisor:g}"))
    ax.set_xlabel(label)
    kinds_present = sorted({e.action.kind for e in events}, key=list(KIND_COLOURS).index)
    handles = [Patch(facecolor=KIND_COLOURS[k], label=KIND_NAMES[k]) for k in kinds_present]
    if any(e.rerouted for e in events):
        handles.append(Patch(facecolor="#CCCCCC", hatch=REROUTED_HATCH, label="re-routed micro-batch"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.3 / (1.6 + row_in * n), 1, 1))  # leave the bottom strip to the legend
    return fig
