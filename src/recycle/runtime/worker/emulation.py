"""The --emulate-costs setting: a slot's length or the profiled costs' scale, and the seconds an action is padded to
per cost unit (torch-free: `recycle train` checks it before the runtime is imported; runtime.worker.emulate paces)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from recycle.config import Config
from recycle.errors import ConfigError

__all__ = ["Emulation", "DEFAULT_SLOT_MS", "MAX_SLOT_MS", "MAX_COST_SCALE", "pacing_seconds_per_unit"]

DEFAULT_SLOT_MS = 40.0  # one slot of a slot-unit config; far above a tiny model's real action time on a CPU
MAX_SLOT_MS = 60_000.0
MAX_COST_SCALE = 10_000.0


@dataclass(frozen=True)
class Emulation:
    """How to turn config durations into seconds: `slot_ms` per slot ("slot" configs), or the microseconds as given
    times `scale` ("us" configs; e.g. scale 10 stretches a profiled model so contention noise stays small)."""

    slot_ms: float = DEFAULT_SLOT_MS
    scale: float = 1.0

    def __post_init__(self) -> None:
        if not (self.slot_ms > 0 and math.isfinite(self.slot_ms)):
            raise ConfigError(f"--slot-ms {self.slot_ms} must be a positive number of milliseconds (e.g. 40)")
        if self.slot_ms > MAX_SLOT_MS:
            raise ConfigError(f"--slot-ms {self.slot_ms:g} is above the limit of {MAX_SLOT_MS:g} ms (a minute per "
                              "slot: every action would sleep for minutes); use e.g. 40")
        if not (self.scale > 0 and math.isfinite(self.scale)):
            raise ConfigError(f"--cost-scale {self.scale} must be a positive factor (e.g. 1 or 10)")
        if self.scale > MAX_COST_SCALE:
            raise ConfigError(f"--cost-scale {self.scale:g} is above the limit of {MAX_COST_SCALE:g} (profiled "
                              "microseconds stretched that far make every action sleep for minutes); use e.g. 10")


def pacing_seconds_per_unit(config: Config, emulation: Emulation) -> float:
    """Wall-clock seconds an action is padded to per unit of the config's durations (not the trace replay's
    recycle.traces.throughput.seconds_per_unit, which turns a slot into modelled seconds)."""
    if config.time_unit == "slot":
        return emulation.slot_ms / 1e3
    return 1e-6 * emulation.scale
