"""Plans for a running job: every normalized failure state up to `max_failures` planned before training starts (or
read from a plan store made by `recycle plan --max-failures F --out DIR`), and the heuristic for any state beyond,
so a failure costs a lookup, not a solve. A library built here also plans the failure patterns that no single
relabelling of pipelines maps onto their key's plan, so that every lookup moves only the failed workers'
micro-batches off their pipelines."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TextIO

from recycle.config import Config
from recycle.errors import FailureStateError
from recycle.ir.plan import Plan
from recycle.planner.api import plan_for_failed, plan_for_key, resolve_options
from recycle.planner.failures import MAX_PLANNED_STATES, check_failure_states, enumerate_keys, normalize
from recycle.planner.patterns import enumerate_patterns, pattern_of
from recycle.planner.options import PlannerOptions
from recycle.planner.store import PlanStore

__all__ = ["PlanLookup", "PlanLibrary"]


@dataclass(frozen=True)
class PlanLookup:
    plan: Plan  # on the real ranks
    source: str  # "store": precomputed; "heuristic": planned online
    seconds: float


def _check_states(config: Config, max_failures: int) -> None:
    """At most MAX_PLANNED_STATES keys and failure patterns to plan before training starts (--max-failures)."""
    D, S = config.num_replicas, config.num_stages
    check_failure_states(D, S, max_failures)
    sets = sum(math.comb(S, k) for k in range(1, min(max_failures, S) + 1))  # the patterns' stage sets
    patterns = sets if sets > MAX_PLANNED_STATES else \
        sum(1 for _ in itertools.islice(enumerate_patterns(D, S, max_failures), MAX_PLANNED_STATES + 1))
    if patterns > MAX_PLANNED_STATES:
        raise FailureStateError(
            f"--max-failures {max_failures} over D={D} x S={S} is more than {MAX_PLANNED_STATES:,} failure patterns "
            "across pipelines to plan ahead (each takes milliseconds to seconds); lower --max-failures (a state "
            "beyond it is planned when it happens)")


class PlanLibrary:
    """A plan store in memory; `lookup(failed)` maps a real failure set to a plan on the real ranks."""

    def __init__(self, store: PlanStore, patterns: dict[tuple, Plan] | None = None) -> None:
        self.store = store
        # Canonical failed set of a pattern (its `lost` per replica) -> its traffic-aware plan.
        self.patterns = patterns or {}

    @classmethod
    def build(cls, config: Config, options: PlannerOptions, max_failures: int,
              progress: TextIO | None = None) -> "PlanLibrary":
        """Plan every key with at most `max_failures` failures now (heuristic: milliseconds per key), and every
        failure pattern that a key's plan would serve only by relabelling each stage on its own."""
        options = resolve_options(config, options)
        _check_states(config, max_failures)
        started = time.perf_counter()
        plans = {key: plan_for_key(config, key, options, "heuristic")
                 for key in enumerate_keys(config.num_replicas, config.num_stages, max_failures)}
        store = PlanStore(Path("<memory>"), config, options, max_failures, {}, plans)
        patterns = cls._plan_patterns(store, max_failures)
        if progress is not None:
            print(f"plan store: {len(plans)} failure states and {len(patterns)} failure pattern(s) across pipelines "
                  f"(up to {max_failures} failures) planned in {time.perf_counter() - started:.2f} s",
                  file=progress, flush=True)
        return cls(store, patterns)

    @staticmethod
    def _plan_patterns(store: PlanStore, max_failures: int) -> dict[tuple, Plan]:
        """The traffic-aware plan of every pattern whose failures are not nested, kept when it is as fast as the
        key's plan relabelled per stage (which routes healthy micro-batches through other pipelines)."""
        config, options = store.config, store.options
        patterns: dict[tuple, Plan] = {}
        for pattern in enumerate_patterns(config.num_replicas, config.num_stages, max_failures):
            failed = pattern.canonical_failed()
            state = normalize(failed, config.num_replicas, config.num_stages)
            if state.symmetric:
                continue  # one relabelling of pipelines already maps the key's plan onto it
            plan = plan_for_failed(config, failed, options)
            keyed = store.plan_for_key(state.key)
            if keyed is None or plan.meta.predicted_period <= keyed.meta.predicted_period * (1 + 1e-9):
                patterns[pattern.lost] = plan
        return patterns

    @classmethod
    def load(cls, directory: str | Path, config: Config) -> "PlanLibrary":
        return cls(PlanStore.load(directory, config))

    def lookup(self, failed: frozenset[tuple[int, int]]) -> PlanLookup:
        started = time.perf_counter()
        D, S = self.store.config.num_replicas, self.store.config.num_stages
        state = normalize(failed, D, S)
        if not state.symmetric and self.patterns:  # only sets no pipeline relabelling covers have pattern plans
            pattern = pattern_of(failed, D, S)
            if pattern.lost in self.patterns:
                plan = pattern.to_real(self.patterns[pattern.lost], frozenset(failed))
                return PlanLookup(plan, "store", time.perf_counter() - started)
        source = "store" if self.store.plan_for_key(state.key) is not None else "heuristic"
        plan = self.store.lookup(failed)
        return PlanLookup(plan, source, time.perf_counter() - started)

    def provider(self, make: Callable[[Plan, str, float], object]) -> Callable[[frozenset[tuple[int, int]]], object]:
        """The lookup as the runtime's plan-provider callable (`make` builds the runtime's PlanChoice)."""
        def provide(failed: frozenset[tuple[int, int]]) -> object:
            found = self.lookup(failed)
            return make(found.plan, found.source, found.seconds)
        return provide
