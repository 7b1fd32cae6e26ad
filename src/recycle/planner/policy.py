"""Whether a failure state is worth a layer re-partition: expected duration against the migration pause, one rule
for the runtime's plan provider and the job simulator's ReCycle+."""

from __future__ import annotations

from dataclasses import dataclass


class DurationEstimate:
    """Expected time until the next change of the live set: the mean gap seen so far, with `prior_s` counted as
    one observation (a memoryless trace's expected remaining time is its mean gap; no look-ahead)."""

    def __init__(self, prior_s: float) -> None:
        self.prior_s = prior_s
        self.total_s = 0.0
        self.count = 0
        self.last_s: float | None = None

    def observe(self, now: float) -> None:
        if self.last_s is not None and now > self.last_s:
            self.total_s += now - self.last_s
            self.count += 1
        self.last_s = now

    @property
    def expected_s(self) -> float:
        return (self.prior_s + self.total_s) / (1 + self.count)


@dataclass(frozen=True)
class LayerDecision:
    """Moving from partition `current` to `target` in failure state `key`: the work done over the expected
    duration with the move (which first pauses for the migration) against without it. Rates are in any work unit
    per second (iterations or samples), the same for both."""

    key: tuple[int, ...]
    current: tuple[int, ...]
    target: tuple[int, ...]
    rate_current: float
    rate_target: float
    pause_s: float
    expected_s: float

    @property
    def gain(self) -> float:
        """Work gained by moving, over the expected duration of the state (negative: re-routing alone is better)."""
        return self.rate_target * max(0.0, self.expected_s - self.pause_s) - self.rate_current * self.expected_s

    @property
    def back(self) -> bool:
        """Every worker is back: the layers return to the configured split whatever the gain."""
        return not any(self.key)

    @property
    def move(self) -> bool:
        return self.target != self.current and (self.back or self.gain > 0)

    def describe(self, unit: str = "iterations") -> str:
        split = "/".join
        verdict = "layers back" if self.back else "re-partition" if self.move else "no layer move"
        return (f"{verdict}: layers {split(map(str, self.current))} -> {split(map(str, self.target))} would run "
                f"{self.rate_current:.3g} -> {self.rate_target:.3g} {unit}/s after a {self.pause_s:.2g} s "
                f"migration; expected state {self.expected_s:.3g} s, predicted gain {self.gain:+.3g} {unit}")
