"""Turn a runtime run's failures and re-joins into an event trace whose replay hits the same workers' stages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from recycle.traces.model import StageLayout

__all__ = ["SoakChange", "SoakTrace", "soak_trace", "machine_trace", "replayed_keys", "changes_from_records"]

Worker = tuple[int, int]  # (replica, stage)


@dataclass(frozen=True)
class SoakChange:
    """One recovery of the runtime: at `time_s` (seconds from the trace's start) these workers died and these came
    back; `failed_after` is every worker down once it was over (the runtime's failure state)."""

    time_s: float
    lost: tuple[Worker, ...]
    joined: tuple[Worker, ...]
    failed_after: tuple[Worker, ...]
    moved: tuple[tuple[Worker, Worker], ...] = ()  # (donor, slot): a live worker moved into a lost stage (reshape)


@dataclass(frozen=True)
class SoakTrace:
    """The trace lines and, per change, the runtime's key against the key the job simulator will be in."""

    lines: tuple[str, ...]  # time_ms,add|remove,node (with a header)
    times_s: tuple[float, ...]  # when each runtime state starts (0 = the fault-free start)
    runtime_keys: tuple[tuple[int, ...], ...]  # failed replicas per stage, per state
    sim_keys: tuple[tuple[int, ...] | None, ...]  # the same for the simulator's layout (None: down)
    restores: int  # changes where the simulator restores from the checkpoint (a stage lost every replica)
    notes: tuple[str, ...]  # every place the trace cannot make the simulator follow the runtime

    @property
    def mismatched(self) -> int:
        return sum(a != b for a, b in zip(self.runtime_keys, self.sim_keys))


def _key(failed: set[Worker] | tuple[Worker, ...], num_replicas: int, num_stages: int) -> tuple[int, ...]:
    return tuple(sum(1 for _, s in failed if s == st) for st in range(num_stages))


class _Mirror:
    """The job simulator's view, step by step: node positions as `map_trace_to_units` gives them (the lowest free
    position, never one freed at the same instant; one GPU per node and per worker, so position = unit) and the
    layout as `ReCycleSystem.on_change` keeps it with no state-copy delay and no reshape."""

    def __init__(self, num_replicas: int, num_stages: int) -> None:
        self.D, self.S = num_replicas, num_stages
        self.node_at: dict[int, str] = {}
        self.layout = StageLayout(num_replicas, num_stages)
        self.down = False

    def start(self, nodes: list[str]) -> None:
        for p, node in enumerate(nodes):
            self.node_at[p] = node
        self.layout.place_all(self.node_at)

    def pick(self, worker: Worker) -> int | None:
        """The unit the simulator holds at this worker's slot, else one of the same stage (the key only counts
        failed replicas per stage), else None."""
        unit = self.layout.slot.get(worker)
        if unit is not None:
            return unit
        same = sorted((p, u) for (p, s), u in self.layout.slot.items() if s == worker[1])
        return same[0][1] if same else None

    def stage_emptied(self, units: list[int]) -> bool:
        counts = self.layout.live_per_stage(0.0)
        for u in units:
            if u in self.layout.where:
                counts[self.layout.where[u][1]] -= 1
        return 0 in counts

    def change(self, lost: list[int], joined: list[str]) -> bool:
        """Apply one trace timestamp; True when the simulator restores from the checkpoint at it."""
        freed = set(lost)
        for u in lost:
            del self.node_at[u]
            self.layout.remove(u)
        new_units = []
        for node in sorted(joined):  # the reader lists a timestamp's adds by name; positions go in that order
            p = 0
            while p in self.node_at or p in freed:
                p += 1
            self.node_at[p] = node
            new_units.append(p)
        for u in sorted(new_units):
            self.layout.add_spare(u)
        live = set(self.node_at)
        if self.down:
            return self._restore(live)
        self.layout.fill_from_spares(0.0, lambda stage: 0.0)
        if 0 in self.layout.live_per_stage(0.0):
            return self._restore(live)
        return False

    def _restore(self, live: set[int]) -> bool:
        if len(live) < self.S:
            self.down = True
            return True
        self.down = False
        self.layout.place_all(live)
        return True

    def key(self) -> tuple[int, ...] | None:
        return None if self.down else tuple(self.D - n for n in self.layout.live_per_stage(0.0))


def soak_trace(changes: list[SoakChange], num_replicas: int, num_stages: int, end_s: float) -> SoakTrace:
    """An event trace (`time_ms,add|remove,node`) of the runtime's changes for `recycle simulate --replicas keep`.

    Node `n<rank>` starts as worker (rank // S, rank % S) (initial nodes are placed stage by stage in rank order),
    and each incarnation of a returning worker is a new node `n<rank>.<k>`. A lost worker is removed as the node the
    simulator holds at its slot (or at another slot of its stage). Deaths and joins of one recovery share its
    timestamp, except when the deaths empty a stage in the simulator: then the joins follow 1 ms later, so the
    simulator restores from the checkpoint (as the runtime did) instead of filling the stage first. Where the
    simulator's re-join rule (most depleted stage first) or restore layout (all live units, stage by stage) puts a
    worker elsewhere than the runtime did, the keys differ; `notes` and `sim_keys` show where.
    """
    D, S = num_replicas, num_stages
    if end_s <= 0:
        raise ValueError(f"end_s = {end_s} must be > 0: the trace needs a duration")
    mirror = _Mirror(D, S)
    initial = [f"n{rank}" for rank in range(D * S)]
    mirror.start(initial)
    lines = ["time_ms,action,node"] + [f"0,add,{node}" for node in initial]
    incarnation = {rank: 0 for rank in range(D * S)}
    times, runtime_keys, sim_keys, notes = [0.0], [(0,) * S], [(0,) * S], []
    restores = 0
    last_ms = 0
    for change in sorted(changes, key=lambda c: c.time_s):
        t_ms = max(1, int(round(change.time_s * 1000)), last_ms)  # t = 0 would make them the initial cluster
        units = []
        for worker in change.lost:
            unit = mirror.pick(worker)
            if unit is None or unit in units:
                notes.append(f"{change.time_s:.3f} s: the runtime lost {worker[0]}:{worker[1]} but the simulator "
                             f"holds no other worker of stage {worker[1]}; not removed")
                continue
            if mirror.layout.where.get(unit) != worker:
                notes.append(f"{change.time_s:.3f} s: the runtime lost {worker[0]}:{worker[1]}; the simulator loses "
                             f"its worker at {mirror.layout.where.get(unit)} instead (same stage)")
            units.append(unit)
        joined = []
        for r, s in change.joined:
            rank = r * S + s
            incarnation[rank] += 1
            joined.append(f"n{rank}.{incarnation[rank]}")
        lines += [f"{t_ms},remove,{mirror.node_at[u]}" for u in units]
        if units and joined and mirror.stage_emptied(units):
            restores += mirror.change(units, [])
            t_ms += 1
            units = []
        restores += mirror.change(units, joined)
        lines += [f"{t_ms},add,{node}" for node in joined]
        last_ms = t_ms
        times.append(change.time_s)
        runtime_keys.append(_key(change.failed_after, D, S))
        sim_keys.append(mirror.key())
        if sim_keys[-1] != runtime_keys[-1]:
            notes.append(f"{change.time_s:.3f} s: runtime key {runtime_keys[-1]}, simulator key {sim_keys[-1]} "
                         "(the simulator places re-joins in the most depleted stage, restores onto all live units)")
    end_ms = max(int(round(end_s * 1000)), last_ms + 1)
    lines.append(f"{end_ms},add,end-marker")  # the trace ends at its last event; this spare arrives at the end
    return SoakTrace(tuple(lines), tuple(times), tuple(runtime_keys), tuple(sim_keys), restores, tuple(notes))


def machine_trace(changes: list[SoakChange], num_replicas: int, num_stages: int, end_s: float) -> SoakTrace:
    """An event trace of the runtime's changes in which a node is a machine, for the job simulator's runtime layout
    (`JobCosts.runtime_layout`, `map_trace_to_units(keep_positions=True)`).

    Machine `n<rank>` starts as worker (rank // S, rank % S). A lost worker removes the machine that runs it; a
    reshape's move keeps its machine (the donor's machine now runs the lost stage's slot: no event); a re-joined
    worker is the repaired machine that died there, or, for the slot a donor left, the machine that died in the
    slot the donor took (the coordinator's Repairs rule). So the simulator, which sends a returning machine back to
    its slot (or its donor's), is in the runtime's state; `sim_keys` are read back from a replay (`replayed_keys`).
    """
    D, S = num_replicas, num_stages
    if end_s <= 0:
        raise ValueError(f"end_s = {end_s} must be > 0: the trace needs a duration")
    machine_at: dict[Worker, str] = {(r // S, r % S): f"n{r}" for r in range(D * S)}
    died_at: dict[Worker, str] = {}  # slot -> the machine that last died there
    moved_into: dict[Worker, Worker] = {}  # a donor's old slot -> the slot it moved to
    lines = ["time_ms,action,node"] + [f"0,add,n{r}" for r in range(D * S)]
    times, runtime_keys, notes = [0.0], [(0,) * S], []
    last_ms = 0
    for change in sorted(changes, key=lambda c: c.time_s):
        t_ms = max(1, int(round(change.time_s * 1000)), last_ms)
        removed, added = [], []
        for worker in change.lost:
            node = machine_at.pop(worker, None)
            if node is None:
                notes.append(f"{change.time_s:.3f} s: the runtime lost {worker[0]}:{worker[1]}, which no machine "
                             "ran in the trace; not removed")
                continue
            died_at[worker] = node
            removed.append(node)
        targets = set()
        for donor, slot in change.moved:
            node = machine_at.pop(donor, None)
            if node is not None:
                machine_at[slot] = node
                moved_into[donor] = slot
                targets.add(slot)
        for worker in sorted(change.joined):
            if worker in targets:
                continue  # the donor's own process, started in its new slot
            node = died_at.pop(moved_into.pop(worker), None) if worker in moved_into else died_at.pop(worker, None)
            if node is None:
                notes.append(f"{change.time_s:.3f} s: {worker[0]}:{worker[1]} re-joined, but no machine died there; "
                             "not added")
                continue
            machine_at[worker] = node
            added.append(node)
        lines += [f"{t_ms},remove,{node}" for node in removed]
        if removed and added:
            t_ms += 1  # the deaths first (the runtime restores or re-routes), then the repaired machines
        lines += [f"{t_ms},add,{node}" for node in sorted(added)]
        last_ms = t_ms
        times.append(change.time_s)
        runtime_keys.append(_key(change.failed_after, D, S))
    end_ms = max(int(round(end_s * 1000)), last_ms + 1)
    lines.append(f"{end_ms},add,end-marker")
    sim_keys, restores = replayed_keys(tuple(lines), tuple(times), D, S)
    for t, a, b in zip(times, runtime_keys, sim_keys):
        if a != b:
            notes.append(f"{t:.3f} s: runtime key {a}, simulator key {b}")
    return SoakTrace(tuple(lines), tuple(times), tuple(runtime_keys), tuple(sim_keys), restores, tuple(notes))


def replayed_keys(lines: tuple[str, ...], times_s: tuple[float, ...], num_replicas: int, num_stages: int,
                  runtime_layout: bool = True) -> tuple[list[tuple[int, ...] | None], int]:
    """The failure key ReCycle runs in just after each of `times_s` when the job simulator replays `lines`, read
    back from its rate (each key gets a distinct period; None where it cannot run), and how many times it restored
    from the checkpoint."""
    from recycle.config import uniform_config
    from recycle.traces.jobsim import rate_at, replay
    from recycle.traces.mapping import map_trace_to_units
    from recycle.traces.model import JobContext, JobCosts
    from recycle.traces.reader import parse_event_lines
    from recycle.traces.recycle_system import ReCycleSystem
    from recycle.traces.throughput import ThroughputModel

    config = uniform_config(num_replicas, num_stages, 2)
    period: dict[tuple[int, ...], float] = {}

    def period_fn(key: tuple[int, ...]) -> float:
        return period.setdefault(tuple(key), 10.0 + len(period))

    model = ThroughputModel(config, period_fn, 1.0)
    costs = JobCosts(detect_s=0, plan_switch_s=0, restart_s=0, redo_fraction=0, reshape=False,
                     runtime_layout=runtime_layout)
    ctx = JobContext(config, model.fault_free(), 1.0, costs)
    timeline = map_trace_to_units(parse_event_lines(list(lines)), keep_positions=runtime_layout)
    system = ReCycleSystem(ctx, model)
    run = replay(system, timeline, ctx.fault_free_rate)
    by_rate = {model.throughput_for_key(k): k for k in period}
    keys: list[tuple[int, ...] | None] = []
    for t in times_s:
        rate = rate_at(run.steady, t + 0.0015)  # past a change's 1 ms join
        keys.append(by_rate.get(rate) if rate > 0 else None)
    return keys, sum(1 for _, policy, _ in system.policy_log if policy == "restore")


def _worker(name: str) -> Worker:
    replica, stage = name.split(":")
    return int(replica), int(stage)


def event_time(recovery: dict[str, Any], steps: list[dict[str, Any]]) -> float:
    """When a recovery's change happened (wall clock): a failure at its fault time; a join alone at the iteration
    boundary where the survivors stopped to admit it (its own failure_time is when the joiner came up; training went
    on until that boundary): the end of step `step - 1` as the generation before it ran it."""
    if recovery["workers"]:
        return float(recovery["failure_time"])
    before = [s["end_time"] for s in steps
              if s["step"] == recovery["step"] - 1 and s.get("generation", 0) < recovery["generation"]]
    return max([float(recovery["failure_time"])] + before[-1:])


def changes_from_records(records: list[dict[str, Any]], start_time: float) -> list[SoakChange]:
    """The recoveries of a runtime's --metrics records as changes, timed from `start_time` (wall clock)."""
    steps = [r for r in records if "event" not in r and isinstance(r.get("step"), int)]
    changes = []
    for r in records:
        if r.get("event") != "recovery":
            continue
        moved = tuple((_worker(a), _worker(b)) for a, b in (m.split(" -> ") for m in r.get("moved", ())))
        changes.append(SoakChange(event_time(r, steps) - start_time, tuple(map(_worker, r["workers"])),
                                  tuple(map(_worker, r["joined"])), tuple(tuple(w) for w in r["failed"]), moved))
    return changes
