"""Plan providers for a running job (recycle.ir.provider). `PlanLibrary`: every normalized failure state up to
`max_failures` planned before training starts (or read from a plan store made by `recycle plan --max-failures F --out
DIR`), and the heuristic for any state beyond, so a failure costs a lookup, not a solve. A library built here also
plans the failure patterns that no single relabelling of pipelines maps onto their key's plan, so that every lookup
moves only the failed workers' micro-batches off their pipelines. `RepartitioningProvider`: failure states that may
also move whole layers between stages, when that pays."""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import Callable, TextIO

from recycle.config import Config
from recycle.errors import FailureStateError
from recycle.ir.plan import Plan
from recycle.ir.provider import PlanChoice, PlanProvider, PlanSource
from recycle.planner.api import plan_for_failed, plan_for_key, resolve_options
from recycle.planner.failures import MAX_PLANNED_STATES, check_failure_states, enumerate_keys, normalize
from recycle.planner.options import PlannerOptions
from recycle.planner.partition import (PartitionChoice, configured_partition, layer_costs, make_repartitioned_plan,
                                       migration_bytes, partition_period, plan_with_partition)
from recycle.planner.patterns import enumerate_patterns, pattern_of, row_classes, with_shared_actions
from recycle.planner.policy import DurationEstimate, LayerDecision
from recycle.planner.store import PlanStore

__all__ = ["PlanLibrary", "RepartitioningProvider"]


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
    """A plan store in memory; `lookup(failed)` maps a real failure set to a plan on the real ranks. The library is
    a repeatable PlanProvider itself (ir.provider): the same failed set gives the same plan, and a lookup changes
    nothing."""

    repeatable = True

    def __init__(self, store: PlanStore, patterns: dict[tuple, Plan] | None = None) -> None:
        self.store = store
        # Canonical failed set of a pattern (its `lost` per replica) -> its traffic-aware plan.
        self.patterns = {lost: with_shared_actions(plan) for lost, plan in (patterns or {}).items()}
        # Before the run, so that a lookup costs a renaming of the lists the failure moved (patterns.rename_replicas).
        store.share_actions()
        for plan in self.patterns.values():
            row_classes(plan)

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

    def __call__(self, failed: frozenset[tuple[int, int]]) -> PlanChoice:
        return self.lookup(failed)

    def lookup(self, failed: frozenset[tuple[int, int]]) -> PlanChoice:
        """The plan for `failed` (a PlanProvider: pass `library.lookup` to the launcher)."""
        started = time.perf_counter()
        D, S = self.store.config.num_replicas, self.store.config.num_stages
        state = normalize(failed, D, S)
        if not state.symmetric and self.patterns:  # only sets no pipeline relabelling covers have pattern plans
            pattern = pattern_of(failed, D, S)
            if pattern.lost in self.patterns:
                plan = pattern.to_real(self.patterns[pattern.lost], frozenset(failed))
                return PlanChoice(plan, "store", time.perf_counter() - started)
        source: PlanSource = "store" if self.store.plan_for_key(state.key) is not None else "heuristic"
        plan = self.store.lookup(failed, state)
        return PlanChoice(plan, source, time.perf_counter() - started)


class RepartitioningProvider:
    """A plan provider whose failure states may also re-partition layers (recycle.planner.partition). Per failed
    set it finds the fastest layer partition (planned on demand, cached) and moves to it only when that pays: the
    iterations gained over the state's expected duration (the mean gap between changes of the live set so far,
    `prior_s` counted as one gap) exceed those lost to the migration pause (recycle.planner.policy, the rule the job
    simulator's ReCycle+ uses). Otherwise the layers stay where they are; with every worker back they return to
    the configured split. `seconds_per_unit` turns the config's periods into seconds (None: no clock to weigh
    them by, so the faster plan wins). `base(failed)` gives the configured partition's plan (e.g.
    `PlanLibrary.lookup`)."""

    def __init__(self, config: Config, options: PlannerOptions, base: PlanProvider, *,
                 seconds_per_unit: float | None = None, prior_s: float = 1800.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.options, self.base = config, options, base
        self.seconds_per_unit = seconds_per_unit
        self.clock = clock
        self.configured = configured_partition(config)
        self.costs = layer_costs(config)
        self.best: dict[frozenset[tuple[int, int]], tuple[Plan, PartitionChoice]] = {}  # planned on demand
        self.estimate = DurationEstimate(prior_s)
        self.current = self.configured  # the layers per stage the run has now

    def __call__(self, failed: frozenset[tuple[int, int]]) -> PlanChoice:
        self.estimate.observe(self.clock())
        started = time.perf_counter()
        if failed:
            target, note = self._decide(failed)
        else:  # every worker is back: the configured split, whatever it costs to get there
            target = self.configured
            note = f"layers back: {_split(self.current)} -> {_split(self.configured)}" \
                if self.current != self.configured else ""
        self.current = target
        if target == self.configured:
            chosen = self.base(failed)
            return PlanChoice(chosen.plan, chosen.source, chosen.seconds, note=note)
        best_plan, best = self.best[failed]
        plan = best_plan if target == best.partition else plan_with_partition(
            self.config, failed, target, self.options, note="kept from the previous failure state")
        return PlanChoice(plan, "re-partition planner", time.perf_counter() - started, note=note)

    def _decide(self, failed: frozenset[tuple[int, int]]) -> tuple[tuple[int, ...], str]:
        """The partition to run `failed` on, and why (empty when the fastest is the current one, or no clock)."""
        config = self.config
        if failed not in self.best:
            self.best[failed] = make_repartitioned_plan(config, failed, self.options)
        choice = self.best[failed][1]
        if choice.partition == self.current or self.seconds_per_unit is None:
            return choice.partition, ""
        unit = self.seconds_per_unit
        key = normalize(failed, config.num_replicas, config.num_stages).key
        live = [config.num_replicas - k for k in key]
        period_now = choice.configured_period if self.current == self.configured else partition_period(
            config, key, self.current, self.options, costs=self.costs)
        received, sent = migration_bytes(self.costs, self.current, choice.partition, live)
        pause_s = config.communication.transfer_time(max(received, sent)) * unit
        decision = LayerDecision(key, self.current, choice.partition, 1 / (period_now * unit),
                                 1 / (choice.period * unit), pause_s, self.estimate.expected_s)
        return (choice.partition if decision.move else self.current), decision.describe()


def _split(partition: tuple[int, ...]) -> str:
    return "/".join(map(str, partition))
