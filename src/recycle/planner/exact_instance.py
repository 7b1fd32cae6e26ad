"""The exact planner's instance: one failure key's durations, message times and steps on an integer tick grid."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from recycle.config import Config
from recycle.ir.actions import Kind
from recycle.ir.costs import action_duration
from recycle.planner.memory_cap import memory_cap
from recycle.planner.options import PlannerOptions

__all__ = ["TimeScale", "time_scale", "Instance", "build_instance", "scale_for"]

# Largest integer duration the model works with; coarser units only when exact ones would exceed it.
_MAX_TICKS = 10**6


@dataclass(frozen=True)
class TimeScale:
    """Config time units -> the model's integer ticks: ticks = round(value * ticks_per_unit)."""

    ticks_per_unit: float
    exact: bool  # False when durations had to be rounded to fit _MAX_TICKS

    def ticks(self, value: float) -> int:
        return int(round(value * self.ticks_per_unit))

    def units(self, ticks: float) -> float:
        return ticks / self.ticks_per_unit


def time_scale(values: Iterable[float], max_decimals: int = 6) -> TimeScale:
    """The coarsest integer grid on which every value is a whole number of ticks (gcd of the decimal forms)."""
    positive = [v for v in values if v > 0]
    if not positive:
        return TimeScale(1.0, True)
    for decimals in range(max_decimals + 1):
        factor = 10**decimals
        scaled = [v * factor for v in positive]
        if all(abs(x - round(x)) <= 1e-9 * max(1.0, x) for x in scaled):
            g = 0
            for x in scaled:
                g = math.gcd(g, int(round(x)))
            ticks_per_unit = factor / g
            if max(positive) * ticks_per_unit <= _MAX_TICKS:
                return TimeScale(ticks_per_unit, True)
            break
    # No exact grid small enough: round every duration to 1/_MAX_TICKS of the longest one.
    return TimeScale(_MAX_TICKS / max(positive), False)


@dataclass(frozen=True)
class Instance:
    """The numbers the model is built from, all in ticks."""

    D: int
    S: int
    M: int
    key: tuple[int, ...]
    kinds: tuple[Kind, ...]  # phases of one micro-batch at one stage, in dependency order
    duration: dict[tuple[Kind, int], int]  # (kind, stage) -> ticks
    p2p: tuple[int, ...]  # per stage boundary s (s -> s+1 and back)
    opt: tuple[int, ...]  # per stage: all-reduce over the live replicas + optimizer step
    cap: tuple[int, ...] | None

    def hosts(self, stage: int, mb: int) -> tuple[int, ...]:
        """Candidate replicas: the owner if it is alive at this stage, else every live replica (re-routing)."""
        owner = mb // self.M
        if owner >= self.key[stage]:
            return (owner,)
        return tuple(range(self.key[stage], self.D))

    @property
    def last_kind(self) -> Kind:
        return self.kinds[-1]


def build_instance(config: Config, key: tuple[int, ...], options: PlannerOptions, scale: TimeScale) -> Instance:
    D, S, M = config.num_replicas, config.num_stages, config.num_microbatches
    c = config.costs
    duration: dict[tuple[Kind, int], int] = {}
    for s in range(S):
        for kind in (Kind.F, Kind.B, Kind.W, Kind.BW):
            duration[(kind, s)] = scale.ticks(action_duration(config, kind, s, D - key[s]))
        if math.isclose(c.backward_fused[s], c.backward_input[s] + c.backward_weight[s]):
            # Keep BW = B + W on the tick grid too, so a hint's fused backward splits without overlap.
            duration[(Kind.BW, s)] = duration[(Kind.B, s)] + duration[(Kind.W, s)]
    comm = config.communication
    return Instance(
        D, S, M, key,
        (Kind.F, Kind.B, Kind.W) if options.decoupled else (Kind.F, Kind.BW),
        duration,
        tuple(scale.ticks(comm.p2p_time(s)) for s in range(S)),
        tuple(scale.ticks(action_duration(config, Kind.OPT, s, D - key[s])) for s in range(S)),
        memory_cap(config, options),
    )


def scale_for(config: Config, key: tuple[int, ...]) -> TimeScale:
    """The tick grid of every duration, message time and step of failure key `key`."""
    D, S = config.num_replicas, config.num_stages
    values = [action_duration(config, kind, s, D - key[s]) for kind in Kind for s in range(S)]
    values += [config.communication.p2p_time(s) for s in range(S)]
    return time_scale(values)
