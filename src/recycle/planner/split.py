"""Finer than a micro-batch: where a stage's survivors carry unequal numbers of whole micro-batches after a failure,
cut the busiest survivors' extra micro-batch into pieces so that every survivor carries an equal share of the
stage's samples, and keep the split plan only when the simulator says its period is strictly better."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from recycle.config import Config
from recycle.errors import PlanError
from recycle.ir.actions import Action, Kind
from recycle.ir.pieces import make_pieces
from recycle.ir.plan import Plan
from recycle.ir.validate import validate_plan
from recycle.sim.simulator import simulate

__all__ = ["Cut", "plan_cuts", "split_plan", "choose_split", "held_samples_peaks", "within_cap", "SPLIT_ACTION_LIMIT",
           "PICKS"]

# Actions per iteration up to which a split is tried (the transform and its simulations are Python per action).
SPLIT_ACTION_LIMIT = 20_000
# Which of a donor's hosted micro-batches is cut: its last or its first in the donor's own order. Both are built
# and simulated; the faster is kept.
PICKS = ("last", "first")

PeriodOf = Callable[[Plan], tuple[float, float, str]]  # plan -> (period, makespan, settling note)


@dataclass(frozen=True)
class Cut:
    """Micro-batch `source` is cut into pieces of `shares` (replica, samples) in sample order at `stage`; the first
    share is the donor's, which hosted it whole. At every other stage all its pieces stay on its old host."""

    stage: int
    source: int
    shares: tuple[tuple[int, int], ...]


def _targets(loads: dict[int, int], samples: int) -> dict[int, int]:
    """Each survivor's equal share of the stage's `samples` in whole samples: the busiest get the remainder."""
    base, extra = divmod(samples, len(loads))
    busiest = sorted(loads, key=lambda p: (-loads[p], p))
    return {p: base + (1 if i < extra else 0) for i, p in enumerate(busiest)}


def plan_cuts(plan: Plan, microbatch_size: int, pick: str = "last") -> tuple[Cut, ...]:
    """The cuts that level every stage with failures: each survivor over its equal share (in samples) gives the
    surplus, at most all but one sample of one micro-batch it hosts (a re-routed one where it has one), to the
    survivors under theirs. Stages already level, and micro-batches already cut at another stage, are left."""
    if pick not in PICKS:
        raise PlanError(f"split pick {pick!r} is unknown; choose one of {list(PICKS)}")
    m, total = microbatch_size, plan.total_microbatches
    cuts: list[Cut] = []
    taken: set[int] = set()
    for stage in sorted({s for _, s in plan.failed}):
        live = plan.live_replicas(stage)
        row = plan.host[stage]
        loads = {p: 0 for p in live}
        for mb in range(total):
            loads[row[mb]] += 1
        targets = _targets(loads, total * m)
        deficit = {p: targets[p] - loads[p] * m for p in live}  # > 0: under its share, < 0: over it
        receivers = [p for p in live if deficit[p] > 0]
        for donor in sorted(live, key=lambda p: (deficit[p], p)):
            give = min(-deficit[donor], m - 1)
            if give <= 0 or not receivers:
                continue
            order = [a.mb for a in plan.worker_actions(donor, stage) if a.kind is Kind.F and a.mb not in taken]
            moved = [mb for mb in order if (plan.owner(mb), stage) in plan.failed]
            choices = moved or order
            if not choices:
                continue
            source = choices[-1] if pick == "last" else choices[0]
            shares = [(donor, m - give)]
            while give > 0 and receivers:
                receiver = receivers[0]
                n = min(give, deficit[receiver])
                shares.append((receiver, n))
                deficit[receiver] -= n
                give -= n
                if deficit[receiver] == 0:
                    receivers.pop(0)
            shares[0] = (donor, shares[0][1] + give)  # what no receiver needed stays with the donor
            taken.add(source)
            cuts.append(Cut(stage, source, tuple(shares)))
    return tuple(cuts)


def split_plan(plan: Plan, config: Config, cuts: Sequence[Cut]) -> Plan:
    """`plan` (whole micro-batches) with `cuts` applied. Each worker's list keeps its order; a cut micro-batch's
    actions become its pieces' actions at the same place, and a piece that moves to another survivor is placed in
    that survivor's list by the start time its micro-batch had in the simulated plan. Every list then follows one
    timeline in which each action starts after its inputs, so the split plan cannot deadlock."""
    m, total = config.workload.microbatch_size, plan.total_microbatches
    pieces = make_pieces(total, m, {c.source: [n for _, n in c.shares] for c in cuts})
    ids: dict[int, list[int]] = {}
    for mb, piece in enumerate(pieces):
        ids.setdefault(piece.source, []).append(mb)
    cut = {c.source for c in cuts}
    host = [[row[p.source] for p in pieces] for row in plan.host]
    for c in cuts:
        for mb, (replica, _) in zip(ids[c.source], c.shares):
            host[c.stage][mb] = replica
    start = {(rank, token): t for rank, _, token, t, _ in simulate(plan, config, iterations=1, record=True).timeline}
    timed: list[list[tuple[float, int, int, int, Action]]] = [[] for _ in plan.actions]
    for rank, acts in enumerate(plan.actions):
        replica, _ = plan.worker(rank)
        for seq, a in enumerate(acts):
            if a.kind is Kind.OPT:
                continue
            t = start[(rank, str(a))]
            if a.mb not in cut:
                timed[rank].append((t, 0, seq, 0, a))
                continue
            for i, mb in enumerate(ids[a.mb]):
                dest = host[a.stage][mb]
                piece_action = Action(a.kind, a.stage, mb)
                timed[plan.rank(dest, a.stage)].append((t, 0 if dest == replica else 1, seq, i, piece_action))
    # By start time; the worker's own actions before moved-in pieces at equal times, then list order (a stable sort:
    # the actions themselves are never compared).
    ordered = [[e[-1] for e in sorted(row, key=lambda e: e[:4])] for row in timed]
    actions = tuple(tuple(row) + tuple(a for a in plan.actions[rank] if a.kind is Kind.OPT)
                    for rank, row in enumerate(ordered))
    split = Plan(plan.num_replicas, plan.num_stages, plan.num_microbatches, tuple(tuple(r) for r in host), actions,
                 plan.failed, plan.staggered, plan.meta, plan.partition, pieces=pieces, microbatch_size=m)
    return validate_plan(split)


def _note(cuts: Sequence[Cut]) -> str:
    parts = [f"mb {c.source} at stage {c.stage} as {'+'.join(str(n) for _, n in c.shares)} samples on replicas "
             f"{[p for p, _ in c.shares]}" for c in cuts]
    return ", ".join(parts)


def held_samples_peaks(plan: Plan) -> tuple[int, ...]:
    """Per worker, the most samples whose activations it holds at once, in its list's order as the simulator counts
    slots (taken at F, freed at W or BW), each micro-batch id counting its piece's samples: activation memory grows
    with the samples a micro-batch carries, so a piece of n of m samples holds n/m of a slot (the simulator's
    `peak_activations` counts it whole). For a plan without pieces, microbatch_size x the simulator's peak."""
    m = plan.microbatch_size or 1
    peaks = []
    for acts in plan.actions:
        held = peak = 0
        for a in acts:
            if a.kind in (Kind.F, Kind.W, Kind.BW):
                samples = plan.pieces[a.mb].samples if plan.pieces else m
                held += samples if a.kind is Kind.F else -samples
                peak = max(peak, held)
        peaks.append(peak)
    return tuple(peaks)


def within_cap(plan: Plan, caps: Sequence[int]) -> bool:
    """Whether every live worker holds at most caps[stage] micro-batches' worth of activations (`held_samples_peaks`:
    a piece counts its share of a slot; exact integers)."""
    if not caps:
        return True
    m = plan.microbatch_size or 1
    peaks = held_samples_peaks(plan)
    return all(peaks[r] <= caps[plan.worker(r)[1]] * m for r in plan.live_ranks())


def _within_cap(plan: Plan, config: Config) -> bool:
    """The plan keeps the activation cap it was made under, a piece holding its share of a slot."""
    return within_cap(plan, plan.meta.memory_cap)


def choose_split(plan: Plan, config: Config, period_of: PeriodOf, split_bound: float | None = None) -> Plan:
    """`plan`, or the split plan when its simulated period is strictly lower; either way meta.notes says what the
    split would have done. The split plan's lower bound is `split_bound` (the bound for pieces: the whole plan's is
    for whole micro-batches and need not hold), or none."""
    whole = plan.meta.predicted_period
    if whole is None:
        whole = period_of(plan)[0]

    def keep(why: str) -> Plan:
        return plan.with_meta(notes=f"{plan.meta.notes}; split micro-batches: {why}")

    m = config.workload.microbatch_size
    if not plan.failed:
        return plan
    if plan.chunks > 1 or plan.pieces:
        return keep("not tried on chunked or already split plans")
    if m < 2:
        return keep(f"not possible, a micro-batch holds {m} sample")
    if plan.num_actions > SPLIT_ACTION_LIMIT:
        return keep(f"not tried above {SPLIT_ACTION_LIMIT:,} actions")
    best: tuple[float, float, Plan, tuple[Cut, ...]] | None = None
    tried: set[tuple[Cut, ...]] = set()
    for pick in PICKS:
        cuts = plan_cuts(plan, m, pick)
        if not cuts or cuts in tried:
            continue
        tried.add(cuts)
        try:
            candidate = split_plan(plan, config, cuts)
        except PlanError:  # a tie of start times made an order that deadlocks: not this candidate
            continue
        if not _within_cap(candidate, config):
            continue
        period, makespan, _ = period_of(candidate)
        if best is None or period < best[0]:
            best = (period, makespan, candidate, cuts)
    if not tried:
        return keep("every stage's survivors already carry equal shares")
    if best is None:
        return keep("no split plan kept the memory cap and the plan's order")
    period, makespan, candidate, cuts = best
    if period >= whole * (1 - 1e-9):
        return keep(f"not faster (period {period:g} against {whole:g} whole)")
    note = (f"split micro-batches: period {period:g} against {whole:g} with whole micro-batches "
            f"({100 * (whole - period) / whole:.1f} % faster); {_note(cuts)}")
    if split_bound is not None and period < split_bound <= period * (1 + 1e-9):
        split_bound = period  # the same sum added in another order: float noise, not a broken bound
    return candidate.with_meta(predicted_period=period, predicted_makespan=makespan, lower_bound=split_bound,
                               notes=f"{plan.meta.notes}; {note}")
