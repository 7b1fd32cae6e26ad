"""Lower bound on the simulated period of any plan for a failure key: per-worker load and critical-path chains."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from recycle.config import Config
from recycle.ir.actions import Kind
from recycle.ir.costs import action_duration
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import check_key

__all__ = ["BoundParts", "bound_parts", "period_lower_bound", "split_unit"]


def split_unit(config: Config, options: PlannerOptions) -> int:
    """The pieces a micro-batch may be cut into under `options`: its samples with split_microbatches, else 1."""
    return max(1, config.workload.microbatch_size) if options.split_microbatches else 1


@dataclass(frozen=True)
class BoundParts:
    """The terms of the bound, for reports: the simulated period is at least the largest of the first three.

    chain: the slowest chain from an iteration's start to stage 0's last input-gradient, plus the step that must
      follow before the next iteration starts.
    span: coupled optimizer only: the busiest worker's earliest start plus its work, plus the slowest step.
    cycle: staggered only: what the busiest worker forces on the simulator's period, measured (as `simulate`
      does) over iterations 1..3: stage 0 runs all of its work and step between two iteration starts; any other
      stage's busiest worker fits one whole iteration (work and step) plus its forwards and input-gradients of
      the next, and the chains around them, in two periods.
    steady_state: every worker's work plus its step, and every term above. `simulate` measures the period once the
      schedule has settled (equal gaps between iteration starts), so this is the bound reported with every plan.
    """

    chain: float
    span: float
    cycle: float
    steady_state: float

    @property
    def value(self) -> float:
        return self.steady_state


def bound_parts(config: Config, key: Sequence[int], options: PlannerOptions = PlannerOptions()) -> BoundParts:
    """Compute each term of `period_lower_bound` (see there and BoundParts for the argument)."""
    key = check_key(config, key)
    D, S, M = config.num_replicas, config.num_stages, config.num_microbatches
    c = config.costs
    comm = config.communication
    live = [D - k for k in key]
    # Some live worker of stage s hosts at least q_s micro-batches: every micro-batch runs wholly on one worker. With
    # split micro-batches the unit is one sample of a micro-batch's m: q_s = ceil(D*M*m / live) / m micro-batches'
    # worth, and a chain through the stages may be a piece of one sample, 1/m of a micro-batch's F and B (its
    # messages are priced whole). unit = 1 gives the whole-micro-batch bound bit for bit (x * 1.0 is x).
    unit = split_unit(config, options)
    q = [math.ceil(D * M * unit / n) / unit for n in live]
    piece = 1.0 / unit
    fwd_t = list(c.forward)
    if options.decoupled:  # each backward may be split (B then W) or fused (BW), whichever the plan picks
        back_t = [min(c.backward_input[s] + c.backward_weight[s], c.backward_fused[s]) for s in range(S)]
        chain_t = [min(c.backward_input[s], c.backward_fused[s]) for s in range(S)]  # the part that sends upstream
    else:
        back_t = list(c.backward_fused)
        chain_t = list(c.backward_fused)
    opt = [action_duration(config, Kind.OPT, s, live[s]) for s in range(S)]
    p2p = [comm.p2p_time(s) for s in range(S)]

    one_f = [f * piece for f in fwd_t]  # the F and the sending backward of the smallest unit (a whole micro-batch
    one_b = [b * piece for b in chain_t]  # unless split)
    reach = [sum(one_f[j] + p2p[j] for j in range(s)) for s in range(S)]  # earliest first forward at stage s
    tail = [sum(one_b[j] + p2p[j] for j in range(s)) for s in range(S)]  # input-gradient from s back to stage 0
    # From the end of a forward at stage s to the arrival of its input-gradient back at stage s.
    round_trip = [sum(one_f[j] + one_b[j] for j in range(s + 1, S)) + 2 * sum(p2p[j] for j in range(s, S - 1))
                  for s in range(S)]

    chain = span = cycle = steady = 0.0
    for s in range(S):
        # Stage 0's last input-gradient of an iteration comes after the busiest stage-s worker's last B: before that
        # B it ran all its forwards and backwards, started no earlier than `reach`, and its last forward / first
        # backward each wait for a full round trip downstream.
        forward_and_b = q[s] * (fwd_t[s] + chain_t[s])
        to_stage0 = max(
            reach[s] + forward_and_b + tail[s],
            reach[s] + q[s] * fwd_t[s] + round_trip[s] + one_b[s] + tail[s],
            reach[s] + one_f[s] + round_trip[s] + q[s] * chain_t[s] + tail[s],
        )
        work = q[s] * (fwd_t[s] + back_t[s])
        steady = max(steady, work + opt[s])
        if options.staggered:
            chain = max(chain, to_stage0 + opt[0])  # stage 0 steps, then starts the next iteration
            if s == 0:
                cycle = max(cycle, work + opt[0])
            else:
                # starts[3] >= (iteration 2's last B on w) + tail + step 0 >= (w's step of iteration 1) + its F and B
                # work + tail + step 0 >= starts[1] + reach + (work + step) + F and B work + tail + step 0.
                cycle = max(cycle, (reach[s] + work + opt[s] + forward_and_b + tail[s] + opt[0]) / 2)
        else:
            chain = max(chain, to_stage0 + max(opt))
            span = max(span, reach[s] + work + max(opt))  # everyone waits for the slowest worker and step
    # Every term that holds for the 4-iteration measurement also holds in the steady state.
    return BoundParts(chain=chain, span=span, cycle=cycle, steady_state=max(steady, chain, span, cycle))


def period_lower_bound(config: Config, key: Sequence[int], options: PlannerOptions = PlannerOptions()) -> float:
    """A lower bound on `simulate(plan, config).period` (the settled period) for every plan of `key` under `options`.

    Coupled optimizer: iterations do not overlap, so the period is one iteration's compute span plus the slowest
    step; the span is at least the busiest worker's earliest start plus its work, and at least any chain that ends
    at stage 0's last input-gradient. Staggered: the next iteration starts when stage 0 has stepped, which needs
    stage 0's last input-gradient (the same chains), and the busiest workers' work bounds the period as explained
    in BoundParts.cycle; in the settled regime every worker also repeats its whole work and step once per period.
    Memory caps only make plans slower, so the bound ignores them. With options.split_microbatches it bounds split
    plans too (pieces down to one sample; see bound_parts), and is then no higher than the whole-micro-batch bound.
    """
    return bound_parts(config, key, options).value
