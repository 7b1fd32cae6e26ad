"""ReCycle+ in the job simulator: per failure state, re-route alone, re-partition layers or reshape, chosen with one
performance model (planner periods, migration time, expected state duration), and back when workers return."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable

from recycle.config import Config
from recycle.errors import PlanError
from recycle.planner.bounds import period_lower_bound
from recycle.planner.options import PlannerOptions
from recycle.planner.partition import (PARTITION_SEARCH_WORK, PartitionChoice, balanced_partition, best_partition,
                                       configured_partition, ideal_period, layer_costs, migration_bytes,
                                       partition_bound, partition_caps, partition_config, partition_period)
from recycle.planner.policy import DurationEstimate, LayerDecision
from recycle.planner.upper_bound import period_upper_bound
from recycle.traces.model import Decision, JobContext
from recycle.traces.recycle_system import ReCycleSystem
from recycle.traces.throughput import ThroughputModel, estimate_period

if TYPE_CHECKING:
    from recycle.traces.plan_cache import PlanCache

__all__ = ["PartitionModel", "ReCyclePlusSystem", "partition_support", "QUICK_SCREEN_RULES"]


def partition_support(config: Config) -> str:
    """"" when the config's layers can be re-partitioned, else why not (ReCycle+ is then skipped). The job
    simulator needs `[model] layers_per_stage`: without it the per-stage costs say nothing about layers (and
    guessing from the runtime's preset would import torch into every replay)."""
    if not config.model.layers_per_stage:
        return ("the config has no [model] layers_per_stage (the layers behind its per-stage costs, e.g. [8, 8, 8, 8] "
                "in configs/gpt3-6.7b-a100.toml)")
    layers = configured_partition(config)
    if sum(layers) <= config.num_stages:
        return (f"{sum(layers)} layers on {config.num_stages} stages: every stage already holds one layer, so no "
                "layer can move")
    return ""


_CHOICES: dict[tuple, PartitionChoice] = {}  # in-process cache of planner partition searches

# The priority rules a trace replay's partition screen list-schedules by default (`recycle simulate`; the first two
# of heuristic.VARIANTS: the first alone moved ReCycle+'s goodput by up to -0.097 % on the shipped traces, two by
# -0.053 % at most): a screen only ranks the partitions, and the one polished is then planned in full, so its period
# and every rate the replay uses are the full planner's. A change of plan: the partition polished may differ from
# the exact screen's (every rule), measured by benchmarks/bench_replay.py --screens (docs/traces.md, "Quick
# partition screens"); --exact-screens turns it off.
QUICK_SCREEN_RULES = 2


class PartitionModel:
    """ReCycle's rate for (failure key, layer partition), the partition chosen per key, and migration times.

    Periods come from the same source as ReCycle's line: the planner (`planner.partition.partition_period` on the
    per-stage config of the partition, memory caps re-derived, planned with the same options as ReCycle's own
    layouts: the heuristic's local search and CP-SAT polish included) or, with the closed-form period model,
    `estimate_period` on that config (the balanced partition is then taken without a planner screen). The
    partition per key comes from `best_partition`'s branch and bound (candidates screened with the priority rules
    only, the first `screen_rules` of them when set, the `polish` best planned in full), shared across runs in this
    process. The configured partition's
    periods are the base model's own, so ReCycle and ReCycle+ agree exactly where ReCycle+ keeps the layers where
    they are. With a `cache` (recycle.traces.plan_cache) every plan and every partition choice is made once per
    run and kept on disk across runs."""

    def __init__(self, base: ThroughputModel, options: PlannerOptions = PlannerOptions(), planner: bool = True,
                 max_evaluations: int = 8, polish: int = 1, cache: PlanCache | None = None,
                 screen_rules: int | None = None) -> None:
        self.base = base
        self.cache = cache
        self.config = base.config
        self.options = options
        self.planner = planner
        self.max_evaluations = max_evaluations
        self.polish = polish
        self.screen_rules = screen_rules
        self.costs = layer_costs(self.config)
        self.configured = self.costs.layers
        self._period: dict[tuple[tuple[int, ...], tuple[int, ...]], float] = {}
        self._choice: dict[tuple[int, ...], PartitionChoice] = {}

    def period(self, key: tuple[int, ...], partition: tuple[int, ...]) -> float:
        if partition == self.configured:
            return self.base.period(key)
        cache_key = (tuple(key), tuple(partition))
        if cache_key not in self._period:
            if self.planner:
                value = partition_period(self.config, key, partition, self.options, "heuristic", self.costs,
                                         source=self._floor_source if self.cache else None)
            else:
                derived = partition_config(self.config, partition, self.costs)
                value = estimate_period(derived, tuple(key), self.base.period((0,) * self.config.num_stages))
            if self.base.floor_period is not None:
                value = max(value, self.base.floor_period)
            # Never faster than the fault-free reference: a failure state beating it would say the configured
            # layout itself should change, a configuration choice rather than failure handling (docs/traces.md).
            value = max(value, self.base.period((0,) * self.config.num_stages))
            self._period[cache_key] = value
        return self._period[cache_key]

    def _at_floor_bound(self, config: Config, key: tuple[int, ...], options: PlannerOptions,
                        solver: str) -> float | None:
        """An upper bound on a moved layout's full plan period (`config`: the partition's, `options`: this model's
        with its caps) when it proves that period at or under `moved_floor()`, else None: `period` floors a moved
        layout there, so its planned period decides nothing (recycle.planner.upper_bound: one rule schedule)."""
        if solver != "heuristic" or config.fingerprint() == self.config.fingerprint() or \
                replace(options, memory_cap=self.options.memory_cap) != self.options:
            return None
        floor = self.moved_floor()
        if period_lower_bound(config, key, options) > floor:
            return None
        bound = period_upper_bound(config, key, options)
        return bound if bound is not None and bound <= floor else None

    def _floor_source(self, config: Config, key: tuple[int, ...], options: PlannerOptions, solver: str,
                      time_limit_s: float) -> float:
        """The plan cache's period, or a bound at or under the moved layouts' floor (_at_floor_bound): `period`
        floors either to the same value."""
        assert self.cache is not None
        bound = self._at_floor_bound(config, key, options, solver)
        return bound if bound is not None else self.cache.period(config, key, options, solver, time_limit_s)

    def _search_source(self, config: Config, key: tuple[int, ...], options: PlannerOptions, solver: str,
                       time_limit_s: float) -> float:
        """The partition search's periods: the plan cache's, except the polish of a moved layout proved at or
        under the floor (_at_floor_bound), which gets that bound. Exact for one polished partition with the
        search on (a screen's options differ from the polish's, so a screen is never bounded): the configured
        layout's period is then above the floor (else `settled_at_floor`), so the polished partition beats it with
        its planned period and with the bound alike, and `choice` floors the winner's period either way."""
        assert self.cache is not None
        if self.polish == 1 and self.options.search and not self.settled_at_floor(key):
            return self._floor_source(config, key, options, solver, time_limit_s)
        return self.cache.period(config, key, options, solver, time_limit_s)

    def known(self, key: tuple[int, ...], partition: tuple[int, ...]) -> bool:
        """Whether period(key, partition) is known in this run without planning (the configured layout: the base
        model's, planned for ReCycle)."""
        return partition == self.configured or (tuple(key), tuple(partition)) in self._period

    def fits(self, partition: tuple[int, ...]) -> bool:
        """Whether `partition` fits in memory (else its period is inf and its rate 0, whatever the key)."""
        try:
            partition_caps(self.config, partition, self.costs, self.options.memory_cap)
        except PlanError:
            return False
        return True

    def rate(self, key: tuple[int, ...], partition: tuple[int, ...]) -> float:
        period = self.period(key, partition)
        return 0.0 if math.isinf(period) else self.base.samples_per_iteration / (period * self.base.seconds_per_unit)

    def choice(self, key: tuple[int, ...]) -> tuple[int, ...]:
        """The partition for `key`: the configured one with nothing failed (the fault-free plan and reference),
        else the planner's best (or, with the estimate, the balanced one) when it beats re-routing alone."""
        key = tuple(key)
        if not any(key):
            return self.configured
        if key not in self._choice:
            if self.settled_at_floor(key):
                # No re-partition can be faster once floored (see settled_at_floor): no search, the same choice.
                base = self.period(key, self.configured)
                self._choice[key] = PartitionChoice(key, self.configured, base, self.configured, base,
                                                    balanced_partition(self.config, key, self.costs),
                                                    ideal_period(self.config, key), 0, True)
                return self.configured
            if self.planner:
                found = self._cached_choice(key, self.cache) if self.cache is not None else self._shared_choice(key)
                partition, ideal, balanced, evaluated, complete = found.partition, found.ideal_period, \
                    found.balanced, found.evaluated, found.complete
            else:
                partition = balanced = balanced_partition(self.config, key, self.costs)
                ideal, evaluated, complete = ideal_period(self.config, key), 1, True
            base = self.period(key, self.configured)
            if self.period(key, partition) >= base:
                partition = self.configured
            self._choice[key] = PartitionChoice(key, partition, self.period(key, partition), self.configured, base,
                                                balanced, ideal, evaluated, complete)
        return self._choice[key].partition

    def moved_floor(self) -> float:
        """The lowest period `period(key, p)` gives any partition p other than the configured one, whatever the key:
        a moved layout is floored at the fault-free period (and at the reference, `base.floor_period`)."""
        floor = self.base.period((0,) * self.config.num_stages)
        return floor if self.base.floor_period is None else max(floor, self.base.floor_period)

    def settled_at_floor(self, key: tuple[int, ...]) -> bool:
        """Whether the configured layout's period for `key` is already at or below every moved layout's floor
        (`moved_floor`): `choice` keeps a re-partition only where its floored period is strictly below the
        configured one's, so no search can change the choice. Under the paper's 1F1B reference this holds for every
        key whose re-routed plan is no slower than fault-free 1F1B (all 60 keys ReCycle+ ran in on the
        400-change-point trace at D=20; 18 of 89 on bamboo-ec2-p3 at D=8). The configured layout's period is
        ReCycle's own, planned for it anyway."""
        return bool(any(key)) and self.period(key, self.configured) <= self.moved_floor()

    def _shared_choice(self, key: tuple[int, ...]) -> PartitionChoice:
        """The search without a plan cache, shared in this process (it does not depend on the reference)."""
        shared = (self.config.fingerprint(), self.configured, key, self.options, self.max_evaluations, self.polish,
                  self.screen_rules)
        if shared not in _CHOICES:
            _CHOICES[shared] = best_partition(self.config, key, self.options, "heuristic", self.max_evaluations,
                                              polish=self.polish, screen_rules=self.screen_rules)
        return _CHOICES[shared]

    def _search(self) -> dict[str, float]:
        """The search's settings, part of a cached choice's inputs."""
        # screen_rules only when set: choices made with exact screens keep their entries' names.
        # floor: a polished partition proved at or under it is kept with that bound as its period (_search_source).
        return {"max_evaluations": self.max_evaluations, "polish": self.polish, "work": PARTITION_SEARCH_WORK,
                **({"screen_rules": self.screen_rules} if self.screen_rules is not None else {}),
                "floor": self.moved_floor()}

    def _cached_choice(self, key: tuple[int, ...], cache: PlanCache) -> PartitionChoice:
        search = self._search()

        def make() -> PartitionChoice:
            return best_partition(self.config, key, self.options, "heuristic", self.max_evaluations,
                                  polish=self.polish, source=self._search_source, screen_rules=self.screen_rules)

        return cache.choice(self.config, key, self.configured, self.options, "heuristic", search, make,
                            lambda stored: self._stored_choice(key, stored, cache))

    def _stored_choice(self, key: tuple[int, ...], stored: dict[str, Any], cache: PlanCache) -> PartitionChoice:
        """A choice read from the cache, rebuilt from what can be re-derived: its partition must fit, its periods
        come from (validated) plans and must be the stored ones, a re-partition must beat the configured layout,
        and the water-filling start is recomputed. Raises ValueError when anything does not hold."""
        partition = tuple(int(n) for n in stored["partition"])
        evaluated, complete = stored["evaluated"], stored["complete"]
        if type(evaluated) is not int or not 1 <= evaluated <= max(self.max_evaluations, 2) or \
                type(complete) is not bool:
            raise ValueError(f"evaluated {evaluated!r} / complete {complete!r} are not a search's counts")
        period = partition_period(self.config, key, partition, self.options, "heuristic", self.costs,
                                  source=self._search_source)
        base = partition_period(self.config, key, self.configured, self.options, "heuristic", self.costs,
                                source=cache.period)
        if partition != self.configured and not period < base:
            raise ValueError(f"partition {list(partition)} (period {period}) does not beat the configured layout "
                             f"({base})")
        balanced = balanced_partition(self.config, key, self.costs)
        if (stored["period"], stored["configured_period"], stored["balanced"]) != (period, base, list(balanced)):
            raise ValueError("its periods or its balanced partition are not the ones re-derived")
        return PartitionChoice(key, partition, period, self.configured, base, balanced,
                               ideal_period(self.config, key), evaluated, complete)

    def rate_bound(self, key: tuple[int, ...], partition: tuple[int, ...] | None = None) -> float:
        """An upper bound on rate(key, partition) (partition None: on rate(key, choice(key)), the best partition's)
        that plans nothing: the planner's analytic lower bound on the period (over every partition that fits, by
        `partition_bound`, for None), floored like `period`. The rate itself where it is known or cheap (a choice
        already in the plan cache is read from it, without entering this run's choices: what the report lists
        never depends on what an earlier run left in the cache)."""
        key = tuple(key)
        if self.cache is None:  # the path before the plan cache: every weighed key planned (benchmarks)
            return self.rate(key, partition if partition is not None else self.choice(key))
        if partition is None and (key in self._choice or not any(key)):
            partition = self.choice(key)
        if partition is None and self.planner and self.cache.has_choice(
                self.config, key, self.configured, self.options, "heuristic", self._search()):
            return self._best_rate(self._cached_choice(key, self.cache))
        if partition == self.configured:
            return self.base.rate_bound(key)
        if not self.planner or (partition is not None and (key, partition) in self._period):
            return self.rate(key, partition if partition is not None else self.choice(key))
        if partition is None:
            found = partition_bound(self.config, key, self.options)
            if not found.exact:  # the walk stopped early: its value bounds only the partitions it saw
                return self.rate(key, self.choice(key))
            # The best partition may be the configured one, whose period is not floored at the fault-free one.
            return self._floored_rate(found.bound * (1 - 1e-9), moved=False)
        try:
            period = period_lower_bound(partition_config(self.config, partition, self.costs), key, self.options)
        except PlanError:
            return self.rate(key, partition)
        return self._floored_rate(period * (1 - 1e-9), moved=True)

    def _floored_rate(self, period: float, moved: bool) -> float:
        """The rate of a planned `period` floored as `period()` floors it (a moved layout also at the fault-free
        period; the configured one at the reference only)."""
        if moved:
            period = max(period, self.base.period((0,) * self.config.num_stages))
        if self.base.floor_period is not None:
            period = max(period, self.base.floor_period)
        return 0.0 if math.isinf(period) else self.base.samples_per_iteration / (period * self.base.seconds_per_unit)

    def _best_rate(self, found: PartitionChoice) -> float:
        """At least rate(key, choice(key)), from a search's result, without recording the choice: choice() keeps the
        found partition only where it is faster than the configured one, so the rate is the larger of the two (the
        configured layout's bounded by the base model, which plans its key under the base options)."""
        configured = self.base.rate_bound(found.key)
        if found.partition == self.configured:
            return configured
        return max(configured, self._floored_rate(found.period, moved=True))

    def choices(self) -> dict[tuple[int, ...], PartitionChoice]:
        return dict(self._choice)

    def migration_bytes(self, old: tuple[int, ...], new: tuple[int, ...], key: Iterable[int]) -> float:
        live = [self.config.num_replicas - k for k in key]
        received, sent = migration_bytes(self.costs, old, new, live)
        return max(received, sent)


class _CurrentPartition:
    """ReCycle's rate source with the layers laid out as `partition` (ReCycleSystem asks it for rates by key)."""

    def __init__(self, model: PartitionModel) -> None:
        self.model = model
        self.partition = model.configured
        self.label = model.base.label
        self.best = False  # True while a reshape is weighed: each layout at the better of its two partitions
        # True while ReCycle+ settles a re-joined worker (on_wake): the moved layout's rate for a key it has not
        # planned is left to ReCyclePlusSystem._decide (`deferred` names the key), which plans it only when the
        # layer move is not certain without it.
        self.defer = False
        self.deferred: tuple[int, ...] | None = None

    def key_for(self, failed: Iterable[tuple[int, int]]) -> tuple[int, ...]:
        return self.model.base.key_for(failed)

    def _unplanned(self, key: tuple[int, ...]) -> bool:
        """Whether the current (moved) layout's rate for `key` would need a plan of its own (never on the path
        without a plan cache, which keeps planning every weighed key: benchmarks/bench_replay.py's old column)."""
        model = self.model
        return model.cache is not None and self.partition != model.configured \
            and not model.known(key, self.partition) and model.fits(self.partition)

    def throughput_for_key(self, key: tuple[int, ...]) -> float:
        if self.best and any(key):
            chosen = self.model.rate(key, self.model.choice(key))
            # max(current, chosen) is `chosen` when the current layout's rate bound is no higher: the layout
            # chosen for an earlier key is then not planned for this one (the same value, one plan fewer).
            if self._unplanned(key) and self.model.rate_bound(key, self.partition) <= chosen:
                return chosen
            return max(self.model.rate(key, self.partition), chosen)
        if self.defer and self._unplanned(key):
            self.deferred = key
            return math.nan  # never used: _decide replaces it (by the move's rate, or the planned one)
        return self.model.rate(key, self.partition)

    def rate_bound(self, key: tuple[int, ...]) -> float:
        """An upper bound on throughput_for_key(key) that plans as little as it can (PartitionModel.rate_bound)."""
        bound = self.model.rate_bound(key, self.partition)
        if self.best and any(key):
            bound = max(bound, self.model.rate_bound(key))
        return bound

    def fault_free(self) -> float:
        return self.model.base.fault_free()


class ReCyclePlusSystem(ReCycleSystem):
    """ReCycle+ = ReCycle (re-routing, re-joins, restore, the reshape policy) plus layer re-partitioning.

    After every change, once ReCycle has settled its layout and key (including a reshape, whose horizon is the
    same expected duration), the policy compares, with one performance model:
    * re-routing alone on the current layer partition: rate r0, no pause;
    * moving to the partition the planner chose for this key (the configured one once nothing has failed:
      "switch back"): rate r1 after a pause for the migration of the moved layers' parameters and optimizer state
      between stages (`PartitionModel.migration_bytes` over one p2p link per worker), plus `plan_switch_s` unless
      the change already switches plan (a new key: the re-partitioned plan is the one switched to).
    It re-partitions when r1 * (E - pause) > r0 * E, E = the expected time until the next change
    (`DurationEstimate`, prior `JobCosts.repartition_prior_s`), and always returns to the configured partition
    when no worker is missing. Each decision with a choice, and its predicted gain in samples over E, is logged
    in `policy_log` (policy "repartition", "re-route" or "layers back").
    """

    name = "recycle-plus"

    def __init__(self, ctx: JobContext, throughput: ThroughputModel, partitions: PartitionModel) -> None:
        self.partitions = partitions
        self.current = _CurrentPartition(partitions)
        super().__init__(ctx, throughput)
        self.model = self.current  # ReCycle's rates now follow the current partition
        label = throughput.label
        self.label = f"ReCycle+ ({label})" if label else "ReCycle+"
        self.expected = DurationEstimate(ctx.costs.repartition_prior_s)
        self.base_costs = ctx.costs
        self._kept: tuple | None = None  # (key, partition) last kept with re-routing alone
        # (time, (key, partition) or None when down, running rate, pauses decided then): for time_by_state
        self._segments: list[tuple[float, tuple | None, float, float]] = []

    def _with_horizon(self) -> None:
        """Reshape decisions use the same expected duration as the partition decisions."""
        horizon = self.expected.expected_s
        self.ctx = replace(self.ctx, costs=replace(self.base_costs, reshape_horizon_s=horizon))

    def _log(self, now: float, policy: str, detail: str) -> None:
        if policy == "adapt" and self.current.partition != self.partitions.configured:
            policy = "re-route (layers moved)"  # re-routing on a re-partitioned layout
        super()._log(now, policy, detail)

    def _maybe_reshape(self, now: float, live: frozenset[int]):
        """Reshape and re-partition together: the grid as it is and the reshaped one are each weighed at the better
        of the current layers and the partition chosen for its key (the migration is then priced by _decide, as
        after any change)."""
        self.current.best = True
        try:
            return super()._maybe_reshape(now, live)
        finally:
            self.current.best = False

    def _restore(self, now, live, first_loss, lost_stage) -> Decision:
        self.current.partition = self.partitions.configured  # the checkpoint is read into the configured layout
        return super()._restore(now, live, first_loss, lost_stage)

    def start(self, now: float, live: frozenset[int]) -> Decision:
        self.expected.observe(now)
        self._with_horizon()
        return self._consider(now, super().start(now, live))

    def on_change(self, now, live, lost, joined) -> Decision:
        self.expected.observe(now)
        self._with_horizon()
        return self._consider(now, super().on_change(now, live, lost, joined))

    def on_wake(self, now: float) -> Decision:
        # A re-joined worker changes no redo and no reshape: the moved layout's rate for the new key is planned
        # only if the layer decision needs it (_decide).
        self.current.defer = True
        try:
            decision = super().on_wake(now)
        finally:
            self.current.defer = False
        return self._consider(now, decision)

    def _consider(self, now: float, decision: Decision) -> Decision:
        decision = self._decide(now, decision)
        state = None if self.down or self.key is None else (self.key, self.current.partition)
        self._segments.append((now, state, decision.rate, sum(s for _, s in decision.pauses)))
        return decision

    def time_by_state(self, end_s: float) -> list[dict]:
        """Seconds spent in each (failure key, layer partition) up to `end_s`, and of them the seconds running
        (the pauses decided on entering the state taken off), with the running rate: where the goodput goes."""
        spent: dict[tuple, list[float]] = {}
        for i, (t, state, rate, paused) in enumerate(self._segments):
            until = self._segments[i + 1][0] if i + 1 < len(self._segments) else end_s
            if state is None or until <= t:
                continue
            entry = spent.setdefault(state, [0.0, 0.0, rate])
            entry[0] += until - t
            entry[1] += max(0.0, until - t - paused)
            entry[2] = rate
        return [{"key": list(k), "partition": list(p), "seconds": v[0], "running_s": v[1], "rate": v[2]}
                for (k, p), v in sorted(spent.items(), key=lambda kv: -kv[1][0])]

    def _decide(self, now: float, decision: Decision) -> Decision:
        deferred, self.current.deferred = self.current.deferred, None
        if deferred is not None and deferred != self.key:  # cannot happen: on_wake's key is the one deferred
            raise AssertionError(f"deferred rate of key {deferred} decided for key {self.key}")

        def planned(decision: Decision) -> Decision:
            """The decision with the current layout's rate planned when on_wake left it open."""
            if deferred is None:
                return decision
            return replace(decision, rate=self.partitions.rate(deferred, self.current.partition))

        if self.down or self.key is None or (deferred is None and decision.rate <= 0):
            return planned(decision)
        key = self.key
        current = self.current.partition
        target = self.partitions.choice(key)
        if target == current:
            return planned(decision)
        r1 = self.partitions.rate(key, target)
        moved = self.partitions.migration_bytes(current, target, key)
        # One plan switch per event: when this change already switches plan (a new key), the re-partitioned plan
        # is the one switched to, so only the migration is added; otherwise the move is a switch of its own.
        switching = any(cause in ("plan switch", "restart") for cause, _ in decision.pauses)
        pause = (0.0 if switching else self.ctx.costs.plan_switch_s) + self.ctx.transfer_s(moved)
        # A deferred rate is first bounded (never below the planned rate): a move that pays against the bound pays
        # against the rate, and the current layout is then not planned for this key (the log says "at most").
        r0 = self.partitions.rate_bound(key, current) if deferred is not None else self.partitions.rate(key, current)
        layer_move = LayerDecision(key, current, target, r0, r1, pause, self.expected.expected_s)
        bounded = deferred is not None and layer_move.move
        if deferred is not None and not bounded:
            decision = planned(decision)
            r0 = decision.rate
            layer_move = LayerDecision(key, current, target, r0, r1, pause, self.expected.expected_s)
        back = layer_move.back
        words = (f"key {key}: layers {'/'.join(map(str, current))} -> {'/'.join(map(str, target))}, rate "
                 f"{'at most ' if bounded else ''}{r0:.2f} -> {r1:.2f} samples/s, pause {pause:.1f} s "
                 f"({moved / 1e9:.1f} GB per worker at most), expected state {layer_move.expected_s:.0f} s, "
                 f"predicted gain {'at least ' if bounded else ''}{layer_move.gain:+.0f} samples")
        if not layer_move.move:
            if self._kept != (key, current):  # logged once per state, not again on every re-check
                self._log(now, "re-route", f"{words}: re-routing alone")
                self._kept = (key, current)
            return replace(decision, rate=r0)  # a reshape weighed at the chosen partition runs on the current one
        self._kept = None
        self._log(now, "layers back" if back else "repartition", words)
        self.current.partition = target
        return Decision(r1, pauses=decision.pauses + (("reconfiguration", pause),), wake_at=decision.wake_at,
                        note=f"{decision.note}; {'layers back' if back else 'repartition'}: {words}")
