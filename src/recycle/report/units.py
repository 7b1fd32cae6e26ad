"""Human-readable numbers for reports: times in s/ms/µs, durations in s/min/h, percentages, speed words."""

from __future__ import annotations

import math

__all__ = ["human_time", "human_seconds", "percent", "speed_words", "time_axis"]


def human_time(value: float, unit: str) -> str:
    """A duration in a config's time unit: microsecond configs as µs / ms / s, slot configs as plain numbers."""
    if unit != "us":
        return f"{value:g}"
    magnitude = abs(value)
    if magnitude >= 1e6:
        return f"{value / 1e6:,.3g} s" if magnitude < 1e8 else f"{value / 1e6:,.0f} s"
    if magnitude >= 1e3:
        return f"{value / 1e3:,.4g} ms"
    return f"{value:,.4g} µs"


def human_seconds(seconds: float) -> str:
    """Wall-clock seconds as s, min or h."""
    if not math.isfinite(seconds):
        return str(seconds)
    if abs(seconds) < 120:
        return f"{seconds:.3g} s"
    if abs(seconds) < 7200:
        return f"{seconds / 60:.3g} min"
    return f"{seconds / 3600:.3g} h"


def percent(fraction: float) -> str:
    """A fraction as a percentage that never reads 0.00 % when it is not zero."""
    if fraction == 0:
        return "0 %"
    if 0 < abs(fraction) < 1e-4:
        return "< 0.01 %" if fraction > 0 else "> -0.01 %"
    return f"{fraction:.2%}".replace("%", " %")


def speed_words(period: float, reference: float, name: str) -> str:
    """'1.17x faster than NAME' / '1.08x slower than NAME' from two periods (shorter is faster)."""
    if period <= 0 or reference <= 0:
        return f"not comparable with {name}"
    ratio = reference / period
    if math.isclose(ratio, 1.0, rel_tol=5e-4):
        return f"as fast as {name}"
    return f"{ratio:.3f}x faster than {name}" if ratio > 1 else f"{1 / ratio:.3f}x slower than {name}"


def time_axis(unit: str, span: float) -> tuple[float, str]:
    """(divisor, axis label) for a time axis covering `span` in the config's unit: µs configs in ms or s."""
    if unit != "us":
        return 1.0, f"time ({unit})" if unit else "time"
    if span >= 5e6:
        return 1e6, "time (s)"
    if span >= 5e3:
        return 1e3, "time (ms)"
    return 1.0, "time (µs)"
