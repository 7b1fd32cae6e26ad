"""When the simulator stops iterating and what period it reports: the iteration bounds, the periodicity test, the
repeat of iteration times and its mean, and the size from which the level-vectorized timer runs (shared by
sim.simulator, sim.levels and planner.settling; the two sim modules may not import each other)."""

from __future__ import annotations

__all__ = ["MIN_ITERATIONS", "MAX_ITERATIONS", "MAX_CYCLE", "LEVEL_TIMER_MIN_ACTIONS", "converged", "repeat",
           "settled_period"]

MIN_ITERATIONS = 4
MAX_ITERATIONS = 32
# From this many actions per iteration the iterations are timed by the level-vectorized timer (recycle.sim.levels):
# the same floats, faster on large plans and slower on small ones (measurements: docs/planner.md, "Simulator").
LEVEL_TIMER_MIN_ACTIONS = 4_000
# Longest repeat (in iterations) looked for in the gaps between iteration starts; a repeat counts when it shows three
# times in a row at the end of the iterations run.
MAX_CYCLE = 8


def converged(starts: list[float]) -> bool:
    """True once the last three gaps between iteration starts are equal (the schedule has become periodic)."""
    if len(starts) < MIN_ITERATIONS:
        return False
    gaps = [b - a for a, b in zip(starts[-4:], starts[-3:])]
    tol = 1e-9 * max(1.0, abs(gaps[-1]))
    return max(gaps) - min(gaps) <= tol


def repeat(starts: list[float]) -> tuple[int, tuple[float, ...]]:
    """The shortest k <= MAX_CYCLE such that the last 3k gaps between iteration starts repeat every k, and the last
    k gaps; (0, ()) when there is none. A staggered plan's stages step on their own clocks and may settle to a
    cycle of k > 1 iteration times rather than to one period."""
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    if not gaps:
        return 0, ()
    tol = 1e-9 * max(1.0, abs(gaps[-1]))
    for k in range(1, MAX_CYCLE + 1):
        if len(gaps) < 3 * k:
            break
        tail = gaps[-3 * k:]
        if all(abs(tail[i] - tail[i + k]) <= tol for i in range(2 * k)):
            return k, tuple(gaps[-k:])
    return 0, ()


def settled_period(starts: list[float]) -> float:
    """The period of a run stopped by `converged` or at MAX_ITERATIONS: the last gap when converged, else the mean
    over the last whole cycle of iteration times (a plan alternating 63, 60 runs one iteration per 61.5, which an
    average over an odd number of gaps misses), else (no repeat found) the mean of the last half of the gaps."""
    if converged(starts):
        return starts[-1] - starts[-2]
    cycle, gaps = repeat(starts)
    if cycle:
        return sum(gaps) / cycle
    half = len(starts) // 2
    return (starts[-1] - starts[half]) / (len(starts) - 1 - half)
