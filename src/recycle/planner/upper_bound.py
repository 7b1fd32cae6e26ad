"""Upper bound on the heuristic planner's simulated period for a key, proved by the first rule schedule it ranks."""

from __future__ import annotations

from typing import Sequence

from recycle.config import Config
from recycle.errors import RecycleError
from recycle.planner.heuristic import SIMULATE_ALL_LIMIT, VARIANTS, list_schedule
from recycle.planner.memory_cap import memory_cap
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import balanced_routing, check_key

__all__ = ["period_upper_bound", "UPPER_MARGIN"]

# Relative room for float rounding: the proof below is in exact arithmetic, and the simulator's times are sums of at
# most ~10^5 rounded additions (relative error < 10^-11 at MAX_ITERATIONS x 20,000 actions); observed: 2e-15.
UPPER_MARGIN = 1e-8


def period_upper_bound(config: Config, key: Sequence[int], options: PlannerOptions = PlannerOptions()
                       ) -> float | None:
    """A value the simulated period of `plan_for_key(config, key, options)` (and of `period_plan_for_key`, the same
    period) cannot exceed, from one list schedule; None where the argument below does not apply.

    Why it holds (docs/planner.md, "An upper bound from the first rule schedule"). The heuristic's period is the
    best simulated period among its two lowest-estimate candidates, each simulated without B/W fusion too (or not
    fused at all when coupled B/W), so it is at most the unfused simulation of the lowest-estimate one, c. The
    first candidate ranked (the first rule on the first routing, computed here) is among those c beats, so
    estimate(c) <= the estimate returned here. And a candidate's unfused simulated period is at most its estimate:
    its list schedule L is a feasible first iteration of its orders, so the simulator's first iteration x0 (each
    action as early as its worker and input allow) is no later than L, and every stage's first start is the same
    in both (the forward chain's: no rule delays a worker's first forward, and the order-move and deadline
    candidates are timed as early as possible, so x0 = L there); hence estimate(x0) <= estimate(L). Repeating x0
    every estimate(x0) is feasible (each stage steps after its last action and before its next first one), so the
    second iteration's free times are at most the first's plus estimate(x0); one iteration of the simulator is
    monotone and shift-invariant in the free times it starts from, so by induction every gap between iteration
    starts is at most estimate(x0), and the simulator's period is a mean of such gaps.

    Applies to one-chunk configs without micro-batch splitting, where a message takes the same time between any two
    workers (no slower inter-node link) and the planner simulates its best candidates (SIMULATE_ALL_LIMIT).
    """
    D, S, M = config.num_replicas, config.num_stages, config.num_microbatches
    if config.topology.chunks_per_worker != 1 or options.split_microbatches:
        return None
    comm = config.communication
    if config.topology.workers_per_node > 0 and any(comm.inter_node_time(s) != comm.p2p_time(s) for s in range(S)):
        return None
    if (3 if options.decoupled else 2) * D * M * S > SIMULATE_ALL_LIMIT:
        return None
    try:
        key = check_key(config, key)
        caps = memory_cap(config, options)
        first = list_schedule(config, key, balanced_routing(config, key), options.decoupled, options.staggered,
                              caps, VARIANTS[0])
    except RecycleError:
        return None  # the planner raises the same there
    return first.estimate * (1 + UPPER_MARGIN)
