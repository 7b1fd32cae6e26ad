"""Whether a simulated plan settled to a one-iteration period, and its mean period over whole cycles when not."""

from __future__ import annotations

from dataclasses import dataclass

from recycle.sim.convergence import MAX_ITERATIONS
from recycle.sim.simulator import SimResult

__all__ = ["Settling", "settling", "MAX_CYCLE"]

# Longest repeat (in iterations) looked for in the gaps between iteration starts; a repeat counts when it shows three
# times in a row at the end of the simulator's MAX_ITERATIONS iterations.
MAX_CYCLE = 8


@dataclass(frozen=True)
class Settling:
    """period: mean time per iteration over the last whole cycle (the simulator's period when settled);
    cycle: iterations per repeat (1: settled to one period; k > 1: the iteration times repeat every k iterations;
    0: no repeat of up to MAX_CYCLE iterations found, period is then the simulator's); gaps: the last cycle's
    iteration times."""

    period: float
    cycle: int
    gaps: tuple[float, ...]

    def note(self, simulated: float) -> str:
        """Why the plan has no one-iteration period, for a plan's notes ("" when it has one)."""
        if self.cycle == 1:
            return ""
        if self.cycle == 0:
            return (f"not periodic after {MAX_ITERATIONS} simulated iterations (no repeat of up to {MAX_CYCLE} "
                    f"iterations); period {simulated:g} is the mean of the last half of the iteration times")
        times = ", ".join(f"{g:g}" for g in self.gaps)
        return (f"settles to a {self.cycle}-iteration cycle, not a one-iteration period: the stages step on "
                f"their own clocks (staggered), and the iteration times repeat every {self.cycle} iterations "
                f"({times}); predicted period {self.period:g} is the mean over whole cycles (the simulator's "
                f"last-half average reads {simulated:g})")


def settling(result: SimResult) -> Settling:
    """The settling of a simulation run to convergence (simulate's default `iterations=None`)."""
    starts = result.iteration_starts
    if result.num_iterations < MAX_ITERATIONS or len(starts) < 2:
        return Settling(result.period, 1, (result.period,))
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    tol = 1e-9 * max(1.0, abs(gaps[-1]))
    for k in range(1, MAX_CYCLE + 1):
        if len(gaps) < 3 * k:
            break
        tail = gaps[-3 * k:]
        if all(abs(tail[i] - tail[i + k]) <= tol for i in range(2 * k)):
            last = gaps[-k:]
            return Settling(sum(last) / k, k, tuple(last))
    return Settling(result.period, 0, ())
