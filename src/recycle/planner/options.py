"""Planner options: which ReCycle techniques are on and the activation-memory cap."""

from __future__ import annotations

from dataclasses import dataclass

from recycle.errors import ConfigError

__all__ = ["PlannerOptions"]


@dataclass(frozen=True)
class PlannerOptions:
    """decoupled: split backward into B and W; staggered: per-stage optimizer step (no cross-stage barrier);
    memory_cap: max live micro-batches per worker, one entry per stage (None = the config's memory capacity,
    which is unlimited when capacity_bytes = 0); search: let the heuristic improve small instances left above the
    lower bound by a local search bounded by a work budget (recycle.planner.budget; False: the priority rules
    only, the fastest); split_microbatches: where a stage's survivors carry unequal numbers of whole micro-batches,
    also try cutting micro-batches into pieces of equal shares and keep that plan when it is strictly faster
    (recycle.planner.split; off by default: split plans need the built-in GPT's runtime path); rules: the heuristic
    list-schedules only the first `rules` priority rules of `heuristic.VARIANTS` (no random restarts, first-stage or
    waiting rules): a cheaper, possibly slower plan, for screens that rank candidates (ReCycle+'s partition screen
    in trace replays; None, the default: every rule)."""

    decoupled: bool = True
    staggered: bool = True
    memory_cap: tuple[int, ...] | None = None
    search: bool = True
    split_microbatches: bool = False
    rules: int | None = None

    def __post_init__(self) -> None:
        if self.rules is not None and (type(self.rules) is not int or self.rules < 1):
            raise ConfigError(f"PlannerOptions.rules {self.rules!r} must be a whole number >= 1 (the first rules of "
                             "heuristic.VARIANTS a plan tries) or None for every rule")
