"""Outputs of a timed run: a text grid, a Gantt PNG and a Chrome/Perfetto trace (all files written atomically)."""

from recycle.report.chrome_trace import chrome_trace_events, write_chrome_trace
from recycle.report.gantt import write_gantt
from recycle.report.grid import timed_grid
from recycle.report.timeline import TimedAction, timed_actions

__all__ = ["timed_grid", "write_gantt", "write_chrome_trace", "chrome_trace_events", "TimedAction", "timed_actions"]
