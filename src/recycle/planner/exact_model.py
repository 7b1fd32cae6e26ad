"""The exact planner's CP-SAT model of one failure key: intervals, precedences, the period objective, hints."""

from __future__ import annotations

from ortools.sat.python import cp_model

from recycle.ir.actions import Kind
from recycle.ir.dependencies import boundary, input_stage, local_input, producer_kind
from recycle.planner.exact_instance import Instance

__all__ = ["PeriodModel"]


class PeriodModel:
    """Interval variables per action, optional intervals for re-routed hosts, period objective (paper §3.5)."""

    def __init__(self, inst: Instance, staggered: bool) -> None:
        self.inst = inst
        self.staggered = staggered
        self.model = cp_model.CpModel()
        self.start: dict[tuple[Kind, int, int], cp_model.IntVar] = {}
        self.present: dict[tuple[int, int], dict[int, cp_model.IntVar]] = {}  # re-routed (stage, mb) only
        self.first: dict[tuple[int, int], cp_model.IntVar] = {}  # staggered: worker -> first start
        self.stage_end: dict[int, cp_model.IntVar] = {}
        self.horizon = self._horizon()
        self.period = self.model.new_int_var(0, self.horizon, "period")
        self._build()

    def _horizon(self) -> int:
        """A period every instance can reach: all work in one global sequence, then the longest step."""
        inst = self.inst
        per_mb = sum(inst.duration[(k, s)] for s in range(inst.S) for k in inst.kinds)
        return inst.D * inst.M * (per_mb + 2 * sum(inst.p2p)) + max(inst.opt)

    def end(self, kind: Kind, stage: int, mb: int) -> cp_model.LinearExprT:
        return self.start[(kind, stage, mb)] + self.inst.duration[(kind, stage)]

    def literal(self, stage: int, mb: int, replica: int) -> cp_model.IntVar | None:
        """The presence literal of (stage, mb) on `replica`; None when the host is fixed."""
        return self.present.get((stage, mb), {}).get(replica)

    def _build(self) -> None:
        inst, m = self.inst, self.model
        D, S, M = inst.D, inst.S, inst.M
        total = D * M
        compute: dict[tuple[int, int], list] = {}  # worker -> intervals for AddNoOverlap
        memory: dict[tuple[int, int], list] = {}  # worker -> F-start..last-end intervals for AddCumulative
        load: dict[tuple[int, int], list] = {}  # worker -> busy-time terms (redundant bound on the period)
        for s in range(S):
            work = sum(inst.duration[(k, s)] for k in inst.kinds)
            for mb in range(total):
                for kind in inst.kinds:
                    self.start[(kind, s, mb)] = m.new_int_var(0, self.horizon, f"{s}{kind.value}{mb}")
                hosts = inst.hosts(s, mb)
                if len(hosts) > 1:
                    lits = {h: m.new_bool_var(f"host_{s}_{mb}_{h}") for h in hosts}
                    m.add_exactly_one(lits.values())
                    self.present[(s, mb)] = lits
                first, last = inst.kinds[0], inst.last_kind
                for h in hosts:
                    lit = self.literal(s, mb, h)
                    for kind in inst.kinds:
                        d = inst.duration[(kind, s)]
                        name = f"{s}{kind.value}{mb}@{h}"
                        if lit is None:
                            iv = m.new_fixed_size_interval_var(self.start[(kind, s, mb)], d, name)
                        else:
                            iv = m.new_optional_fixed_size_interval_var(self.start[(kind, s, mb)], d, lit, name)
                        compute.setdefault((h, s), []).append(iv)
                    load.setdefault((h, s), []).append(work if lit is None else work * lit)
                    if inst.cap is not None:
                        size = m.new_int_var(0, self.horizon, f"held_{s}_{mb}_{h}")
                        begin, finish = self.start[(first, s, mb)], self.end(last, s, mb)
                        if lit is None:
                            iv = m.new_interval_var(begin, size, finish, f"mem_{s}_{mb}@{h}")
                        else:
                            iv = m.new_optional_interval_var(begin, size, finish, lit, f"mem_{s}_{mb}@{h}")
                        memory.setdefault((h, s), []).append(iv)
        for ivs in compute.values():
            m.add_no_overlap(ivs)
        if inst.cap is not None:
            for (h, s), ivs in memory.items():
                if inst.cap[s] < len(ivs):
                    m.add_cumulative(ivs, [1] * len(ivs), inst.cap[s])
        self._precedences()
        self._symmetry_breaking()
        self._objective(load)

    def _precedences(self) -> None:
        inst, m = self.inst, self.model
        S, total = inst.S, inst.D * inst.M
        decoupled = Kind.W in inst.kinds  # every (stage, mb) alike in the model
        for mb in range(total):
            for s in range(S):
                for kind in inst.kinds:
                    source = input_stage(kind, s, S)
                    if source is not None:
                        # A message from the neighbouring stage, always another worker: pay the p2p time.
                        needed = self.end(producer_kind(kind, decoupled), source, mb)
                        m.add(self.start[(kind, s, mb)] >= needed + inst.p2p[boundary(s, source)])
                        continue
                    local = local_input(kind, s, S)  # the loss turn-around; W after its B
                    if local is not None:
                        m.add(self.start[(kind, s, mb)] >= self.end(local, s, mb))

    def _symmetry_breaking(self) -> None:
        """The micro-batches of one owner are interchangeable (same candidate hosts at every stage, same costs),
        so any schedule can be relabelled so that their stage-0 forwards start in index order. Only one stage is
        ordered: orders at later stages may legitimately differ, so fixing more would cut off optima."""
        inst, m = self.inst, self.model
        d = inst.duration[(Kind.F, 0)]
        for owner in range(inst.D):
            fixed_host = len(inst.hosts(0, owner * inst.M)) == 1
            for j in range(owner * inst.M, (owner + 1) * inst.M - 1):
                # Same worker: strictly one after the other; several candidate hosts: ties are allowed.
                gap = d if fixed_host else 0
                m.add(self.start[(Kind.F, 0, j)] + gap <= self.start[(Kind.F, 0, j + 1)])

    def _objective(self, load: dict[tuple[int, int], list]) -> None:
        inst, m = self.inst, self.model
        S, total = inst.S, inst.D * inst.M
        last = inst.last_kind
        if not self.staggered:
            # Coupled optimizer: every worker restarts after the slowest stage's step; iteration starts at 0.
            step = max(inst.opt)
            for s in range(S):
                for mb in range(total):
                    m.add(self.period >= self.end(last, s, mb) + step)
            for terms in load.values():
                m.add(self.period >= sum(terms) + step)
        else:
            # Staggered: stage s steps after its last replica's last action (the all-reduce), then each of its
            # workers starts the next iteration T after it started this one (paper §3.5, item 8).
            for s in range(S):
                end_s = m.new_int_var(0, self.horizon, f"stage_end_{s}")
                self.stage_end[s] = end_s
                for mb in range(total):
                    m.add(end_s >= self.end(last, s, mb))
                for h in range(inst.key[s], inst.D):
                    first = m.new_int_var(0, self.horizon, f"first_{h}_{s}")
                    self.first[(h, s)] = first
                    for mb in range(total):
                        if h not in inst.hosts(s, mb):
                            continue
                        lit = self.literal(s, mb, h)
                        c = m.add(first <= self.start[(Kind.F, s, mb)])
                        if lit is not None:
                            c.only_enforce_if(lit)
                    m.add(self.period + first >= end_s + inst.opt[s])
                    m.add(self.period >= sum(load[(h, s)]) + inst.opt[s])
        m.minimize(self.period)

    # -- hints ------------------------------------------------------------------------------------------------
    def add_hint(self, times: dict[tuple[Kind, int, int], int], hosts: dict[tuple[int, int], int]) -> None:
        """Hint every start, host literal and derived variable from one schedule (in this model's kinds)."""
        m = self.model
        for k, var in self.start.items():
            m.add_hint(var, times[k])
        for (s, mb), lits in self.present.items():
            for h, lit in lits.items():
                m.add_hint(lit, 1 if hosts[(s, mb)] == h else 0)
        period = self.periodic_ticks(times, hosts)
        if self.staggered:
            for var, value in self._derived_hints(times, hosts):
                m.add_hint(var, value)
        m.add_hint(self.period, min(period, self.horizon))

    def _stage_end_and_first(self, times: dict[tuple[Kind, int, int], int], hosts: dict[tuple[int, int], int]
                             ) -> tuple[list[int], dict[tuple[int, int], int]]:
        inst, total = self.inst, self.inst.D * self.inst.M
        last = inst.last_kind
        stage_end = [max(times[(last, s, mb)] + inst.duration[(last, s)] for mb in range(total))
                     for s in range(inst.S)]
        first = {(h, s): min(times[(Kind.F, s, mb)] for mb in range(total) if hosts[(s, mb)] == h)
                 for s in range(inst.S) for h in range(inst.key[s], inst.D)}
        return stage_end, first

    def _derived_hints(self, times: dict[tuple[Kind, int, int], int], hosts: dict[tuple[int, int], int]):
        stage_end, first = self._stage_end_and_first(times, hosts)
        yield from ((self.stage_end[s], v) for s, v in enumerate(stage_end))
        yield from ((self.first[w], v) for w, v in first.items())

    def periodic_ticks(self, times: dict[tuple[Kind, int, int], int], hosts: dict[tuple[int, int], int]) -> int:
        """The model's period T of one schedule: the smallest T its constraints allow for these start times."""
        inst = self.inst
        stage_end, first = self._stage_end_and_first(times, hosts)
        if not self.staggered:
            return max(stage_end) + max(inst.opt)
        return max(stage_end[s] + inst.opt[s] - f for (_, s), f in first.items())

    # -- extraction -------------------------------------------------------------------------------------------
    def extract(self, solver: cp_model.CpSolver) -> tuple[dict[tuple[Kind, int, int], int], dict[tuple[int, int], int]]:
        """Start ticks and hosts of a solution."""
        inst = self.inst
        hosts: dict[tuple[int, int], int] = {}
        for s in range(inst.S):
            for mb in range(inst.D * inst.M):
                candidates = inst.hosts(s, mb)
                if len(candidates) == 1:
                    hosts[(s, mb)] = candidates[0]
                else:
                    hosts[(s, mb)] = next(h for h in candidates if solver.boolean_value(self.present[(s, mb)][h]))
        return {k: solver.value(v) for k, v in self.start.items()}, hosts
