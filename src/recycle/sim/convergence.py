"""When the simulator stops iterating: the iteration bounds, the periodicity test, and the size from which the
level-vectorized timer runs (shared by sim.simulator and sim.levels, which may not import each other)."""

from __future__ import annotations

__all__ = ["MIN_ITERATIONS", "MAX_ITERATIONS", "LEVEL_TIMER_MIN_ACTIONS", "converged"]

MIN_ITERATIONS = 4
MAX_ITERATIONS = 32
# From this many actions per iteration the iterations are timed by the level-vectorized timer (recycle.sim.levels):
# the same floats, faster on large plans and slower on small ones (measurements: docs/planner.md, "Simulator").
LEVEL_TIMER_MIN_ACTIONS = 4_000


def converged(starts: list[float]) -> bool:
    """True once the last three gaps between iteration starts are equal (the schedule has become periodic)."""
    if len(starts) < MIN_ITERATIONS:
        return False
    gaps = [b - a for a, b in zip(starts[-4:], starts[-3:])]
    tol = 1e-9 * max(1.0, abs(gaps[-1]))
    return max(gaps) - min(gaps) <= tol
