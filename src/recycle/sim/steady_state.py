"""Steady-state period of fixed per-worker orders: the best periodic timing, an LP over difference constraints."""

from __future__ import annotations

import math
from typing import Callable, Sequence

from ortools.linear_solver import pywraplp

from recycle.config import Config
from recycle.ir.actions import Action, Kind
from recycle.ir.costs import action_duration
from recycle.ir.dependencies import boundary, input_stage, local_input
from recycle.ir.plan import Plan

__all__ = ["min_period", "steady_state_period"]


def min_period(rows: Sequence[Sequence[Action]], duration: Callable[[Action], float], p2p: Sequence[float],
               opt: Sequence[float], staggered: bool) -> float:
    """Smallest period T of the periodic schedules that keep each worker's order in `rows` (compute actions only,
    one row per live worker): with routing and orders fixed only difference constraints remain, a small LP that
    GLOP solves in milliseconds (CP-SAT's bound propagation crawls on its cycles when durations are large).
    Returns inf if the LP fails."""
    lp = pywraplp.Solver.CreateSolver("GLOP")
    start = {a: lp.NumVar(0.0, lp.infinity(), "") for row in rows for a in row}
    backward = {(a.stage, a.mb): a for a in start if a.kind in (Kind.B, Kind.BW)}  # B or BW: whichever sends
    num_stages = len(opt)

    def end(a: Action):
        return start[a] + duration(a)

    for a in start:
        s, mb = a.stage, a.mb
        source = input_stage(a.kind, s, num_stages)
        if source is not None:
            needed = Action(Kind.F, source, mb) if a.kind is Kind.F else backward[(source, mb)]
            lp.Add(start[a] >= end(needed) + p2p[boundary(s, source)])
            continue
        local = local_input(a.kind, s, num_stages)
        if local is not None:
            lp.Add(start[a] >= end(Action(local, s, mb)))
    period = lp.NumVar(0.0, lp.infinity(), "period")
    for row in rows:
        for a, b in zip(row, row[1:]):
            lp.Add(start[b] >= end(a))
    for row in rows:
        stage = row[0].stage
        if not staggered:  # every worker restarts after the slowest stage's step
            lp.Add(period >= end(row[-1]) + max(opt))
            continue
        # Staggered: each worker of the stage restarts T after its own first action, once the stage has stepped.
        for other in rows:
            if other[0].stage == stage:
                lp.Add(period + start[row[0]] >= end(other[-1]) + opt[stage])
    lp.Minimize(period)
    return period.solution_value() if lp.Solve() == pywraplp.Solver.OPTIMAL else math.inf


def steady_state_period(plan: Plan, config: Config) -> float:
    """The period `plan` settles to when iterations repeat forever: the best periodic timing of its orders.

    The simulator's period averages iterations 1-3, which a staggered plan's start-up can make slightly shorter;
    this is the long-run figure the CP-SAT model (and its bound) are about.
    """
    S = plan.num_stages
    live = [len(plan.live_replicas(s)) for s in range(S)]
    rows = [[a for a in acts if a.kind is not Kind.OPT] for acts in plan.actions if acts]
    comm = config.communication
    return min_period(rows, lambda a: action_duration(config, a.kind, a.stage, live[a.stage]),
                      [comm.p2p_time(s) for s in range(S)],
                      [action_duration(config, Kind.OPT, s, live[s]) for s in range(S)], plan.staggered)
