"""Plans for a running job: every normalized failure state up to `max_failures` planned before training starts (or
read from a plan store made by `recycle plan --max-failures F --out DIR`), and the heuristic for any state beyond,
so a failure costs a lookup, not a solve."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from recycle.config import Config
from recycle.ir.plan import Plan
from recycle.planner.api import plan_for_key, resolve_options
from recycle.planner.failures import enumerate_keys, normalize
from recycle.planner.options import PlannerOptions
from recycle.planner.store import PlanStore

__all__ = ["PlanLookup", "PlanLibrary"]


@dataclass(frozen=True)
class PlanLookup:
    plan: Plan  # on the real ranks
    source: str  # "store": precomputed; "heuristic": planned online
    seconds: float


class PlanLibrary:
    """A plan store in memory; `lookup(failed)` maps a real failure set to a plan on the real ranks."""

    def __init__(self, store: PlanStore) -> None:
        self.store = store

    @classmethod
    def build(cls, config: Config, options: PlannerOptions, max_failures: int,
              progress: TextIO | None = None) -> "PlanLibrary":
        """Plan every key with at most `max_failures` failures now (heuristic: milliseconds per key)."""
        options = resolve_options(config, options)
        started = time.perf_counter()
        plans = {key: plan_for_key(config, key, options, "heuristic")
                 for key in enumerate_keys(config.num_replicas, config.num_stages, max_failures)}
        if progress is not None:
            print(f"plan store: {len(plans)} failure states (up to {max_failures} failures) planned in "
                  f"{time.perf_counter() - started:.2f} s", file=progress, flush=True)
        return cls(PlanStore(Path("<memory>"), config, options, max_failures, {}, plans))

    @classmethod
    def load(cls, directory: str | Path, config: Config) -> "PlanLibrary":
        return cls(PlanStore.load(directory, config))

    def lookup(self, failed: frozenset[tuple[int, int]]) -> PlanLookup:
        started = time.perf_counter()
        key = normalize(failed, self.store.config.num_replicas, self.store.config.num_stages).key
        source = "store" if self.store.plan_for_key(key) is not None else "heuristic"
        plan = self.store.lookup(failed)
        return PlanLookup(plan, source, time.perf_counter() - started)

    def provider(self, make: Callable[[Plan, str, float], object]) -> Callable[[frozenset[tuple[int, int]]], object]:
        """The lookup as the runtime's plan-provider callable (`make` builds the runtime's PlanChoice)."""
        def provide(failed: frozenset[tuple[int, int]]) -> object:
            found = self.lookup(failed)
            return make(found.plan, found.source, found.seconds)
        return provide
