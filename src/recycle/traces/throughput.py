"""ReCycle's throughput per failure state: the planner's period per normalized key (cached), or a documented estimate."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable

from recycle.config import Config
from recycle.errors import ConfigError, RecycleError
from recycle.planner.failures import normalize
from recycle.planner.options import PlannerOptions

if TYPE_CHECKING:
    from recycle.traces.plan_cache import PlanCache

__all__ = [
    "PeriodFn",
    "ThroughputModel",
    "seconds_per_unit",
    "estimate_period",
    "planner_period_fn",
    "estimate_period_fn",
    "reference_period",
    "make_period_fn",
]

PeriodFn = Callable[[tuple[int, ...]], float]


MAX_SLOT_SECONDS = 86_400.0  # a slot is about one forward of one micro-batch: a day is far above any


def seconds_per_unit(config: Config, slot_seconds: float = 1.0) -> float:
    """Seconds per config time unit: 1e-6 for "us"; `slot_seconds` for abstract "slot" configs."""
    if config.time_unit == "us":
        return 1e-6
    if not (math.isfinite(slot_seconds) and 0 < slot_seconds <= MAX_SLOT_SECONDS):
        raise ConfigError(f"--slot-seconds {slot_seconds:g} must be a number of seconds in (0, {MAX_SLOT_SECONDS:g}] "
                          "(the length of one slot of a slot-unit config, e.g. 1; it turns periods into seconds)")
    return slot_seconds


def estimate_period(config: Config, key: tuple[int, ...], fault_free_period: float) -> float:
    """A cheap stand-in for the planner at sizes where planning every state is too slow.

    period(k) = max(T_ff, max_s [ceil(M*D/(D-k_s)) * (F_s + B_s + W_s) + opt_s + allreduce_s(D-k_s)])

    The second term is the busiest surviving stage-s worker's own work per iteration (it runs every action of
    every micro-batch it hosts plus its stage's step): no schedule can beat it, and T_ff (the fault-free
    period) is what the planner reaches when bubbles absorb the extra work (§3.4 of the paper digest). It is
    therefore optimistic (a lower bound under the zero-overhead assumption); tests check it against the real
    planner on small sizes.
    """
    D, M = config.num_replicas, config.num_microbatches
    c = config.costs
    worst = fault_free_period
    for s, k in enumerate(key):
        if k >= D:
            return math.inf
        if k == 0:
            continue
        per_worker = math.ceil(M * D / (D - k))
        work = per_worker * (c.forward[s] + c.backward_input[s] + c.backward_weight[s])
        work += c.optimizer[s] + config.communication.allreduce_time(s, D - k)
        worst = max(worst, work)
    return worst


def planner_period_fn(config: Config, options: PlannerOptions = PlannerOptions(),
                      solver: str = "heuristic", cache: PlanCache | None = None) -> PeriodFn:
    """The planner's period per key (`recycle.planner.api.plan_for_key`, cached there, or by `cache`: once per run
    and on disk). Plans without a predicted period are simulated."""
    from recycle.planner.api import plan_for_key  # lazily: OR-Tools loads only when a period is planned

    if cache is not None:
        return lambda key: cache.period(config, key, options, solver)

    def period(key: tuple[int, ...]) -> float:
        plan = plan_for_key(config, key, options=options, solver=solver)
        if plan.meta.predicted_period is not None:
            return float(plan.meta.predicted_period)
        from recycle.sim.simulator import simulate

        return simulate(plan, config).period

    return period


def reference_period(config: Config) -> float:
    """The paper's fault-free reference: the 1F1B period (DeepSpeed's schedule, which ReCycle runs when nothing
    has failed, S29): `recycle.planner.api.baseline_1f1b_period`."""
    cached = _REFERENCE_CACHE.get(config.fingerprint())
    if cached is not None:
        return cached
    from recycle.planner.api import baseline_1f1b_period

    value = float(baseline_1f1b_period(config))
    _REFERENCE_CACHE[config.fingerprint()] = value
    return value


_REFERENCE_CACHE: dict[str, float] = {}  # the 1F1B simulation takes seconds at 16k-GPU sizes: do it once


def estimate_period_fn(config: Config, fault_free_period: float | None = None) -> PeriodFn:
    ff = reference_period(config) if fault_free_period is None else fault_free_period
    return lambda key: estimate_period(config, key, ff)


def make_period_fn(config: Config, model: str = "auto", options: PlannerOptions = PlannerOptions(),
                   solver: str = "heuristic", cache: PlanCache | None = None) -> tuple[PeriodFn, str]:
    """Pick the period source: "planner" (also "auto"), or "estimate". Returns (fn, label)."""
    if model not in ("auto", "planner", "estimate"):
        raise ConfigError(f"period model {model!r} is unknown; use auto, planner or estimate")
    if model in ("auto", "planner"):
        return planner_period_fn(config, options, solver, cache), f"planner ({solver})"
    return estimate_period_fn(config), "closed-form estimate"


@dataclass
class ThroughputModel:
    """Samples per second of ReCycle for a set of failed workers; the period is cached per normalized key."""

    config: Config
    period_fn: PeriodFn
    seconds_per_unit: float = 1.0
    label: str = ""
    floor_period: float | None = None  # never faster than this period (the reference fault-free schedule)
    # A lower bound on period_fn(key) that costs no planning (the planner's analytic bound), or None: rate_bound is
    # then the rate itself.
    period_bound: PeriodFn | None = None
    # An upper bound on period_fn(key) that costs one rule schedule (recycle.planner.upper_bound; inf where none is
    # known), or None: a key it proves at or under floor_period gets the floor without planning (issue 27 item 4).
    period_cap: PeriodFn | None = None

    def __post_init__(self) -> None:
        self._cache: dict[tuple[int, ...], float] = {}
        self.keys_at_floor = 0  # keys period_cap settled at the floor, unplanned

    @property
    def samples_per_iteration(self) -> int:
        return self.config.num_replicas * self.config.num_microbatches * self.config.workload.microbatch_size

    def period(self, key: tuple[int, ...]) -> float:
        key = tuple(key)
        if key not in self._cache:
            if self._at_floor(key):
                assert self.floor_period is not None
                self._cache[key] = self.floor_period  # max(period_fn(key), floor): the floor, whatever the plan
                self.keys_at_floor += 1
                return self.floor_period
            value = float(self.period_fn(key))
            if not value > 0:
                raise RecycleError(f"period {value} for key {key} must be > 0")
            if self.floor_period is not None:
                value = max(value, self.floor_period)
            self._cache[key] = value
        return self._cache[key]

    def _at_floor(self, key: tuple[int, ...]) -> bool:
        """Whether period_cap proves period_fn(key) <= floor_period (the analytic lower bound first rules it out
        where the plan cannot reach the floor, so no rule schedule is made there)."""
        if self.floor_period is None or self.period_cap is None:
            return False
        if self.period_bound is not None and self.period_bound(key) > self.floor_period:
            return False
        return self.period_cap(key) <= self.floor_period

    def key_for(self, failed: Iterable[tuple[int, int]]) -> tuple[int, ...]:
        return normalize(failed, self.config.num_replicas, self.config.num_stages).key

    def throughput_for_key(self, key: tuple[int, ...]) -> float:
        period = self.period(key)
        return 0.0 if math.isinf(period) else self.samples_per_iteration / (period * self.seconds_per_unit)

    def rate_bound(self, key: tuple[int, ...]) -> float:
        """An upper bound on throughput_for_key(key) that plans nothing when the key has not been planned yet."""
        key = tuple(key)
        if key in self._cache or self.period_bound is None:
            return self.throughput_for_key(key)
        period = self.period_bound(key)
        if self.floor_period is not None:
            period = max(period, self.floor_period)
        return math.inf if period <= 0 else self.samples_per_iteration / (period * self.seconds_per_unit)

    def throughput(self, failed: Iterable[tuple[int, int]]) -> float:
        return self.throughput_for_key(self.key_for(failed))

    def fault_free(self) -> float:
        return self.throughput_for_key((0,) * self.config.num_stages)

    @property
    def keys_planned(self) -> int:
        return len(self._cache)
