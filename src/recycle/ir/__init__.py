"""Plan IR: actions, the plan container, validation, text/CSV forms (no torch import)."""

from recycle.ir.actions import BACKWARD_KINDS, COMPUTE_KINDS, Action, Kind
from recycle.ir.plan import Plan, PlanMeta, derive_host, read_plan
from recycle.ir.provider import PlanChoice, PlanProvider, PlanSource
from recycle.ir.text import dump_csv, load_csv, read_csv, write_csv
from recycle.ir.validate import dependencies, format_grid, opt_group, validate_plan
from recycle.ir.worker import Worker, workers_text

__all__ = ["Action", "Kind", "COMPUTE_KINDS", "BACKWARD_KINDS", "Plan", "PlanMeta", "derive_host", "read_plan",
           "PlanChoice", "PlanProvider", "PlanSource",
           "validate_plan", "format_grid", "dependencies", "opt_group",
           "dump_csv", "load_csv", "read_csv", "write_csv", "Worker", "workers_text"]
