"""Whether a simulated plan settled to a one-iteration period, and its mean period over whole cycles when not."""

from __future__ import annotations

from dataclasses import dataclass

from recycle.sim.convergence import MAX_CYCLE, MAX_ITERATIONS, repeat
from recycle.sim.simulator import SimResult

__all__ = ["Settling", "settling", "MAX_CYCLE"]


@dataclass(frozen=True)
class Settling:
    """period: mean time per iteration over the last whole cycle (the simulator's period, which is that mean);
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
                f"({times}); predicted period {self.period:g} is the mean over a whole cycle")


def settling(result: SimResult) -> Settling:
    """The settling of a simulation run to convergence (simulate's default `iterations=None`)."""
    starts = result.iteration_starts
    if result.num_iterations < MAX_ITERATIONS or len(starts) < 2:
        return Settling(result.period, 1, (result.period,))
    cycle, gaps = repeat(list(starts))
    if cycle:
        return Settling(result.period, cycle, gaps)  # the simulator's period is that cycle's mean
    return Settling(result.period, 0, ())
