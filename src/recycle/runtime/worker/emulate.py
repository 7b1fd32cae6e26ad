"""Emulated costs: pad every action a worker runs to the config's duration, so wall-clock timing follows the plan's
cost model instead of the host's CPU contention (timing studies of 12 workers on a 2-core machine)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from recycle.config import Config
from recycle.ir import Action, Kind, Plan
from recycle.ir.costs import action_duration, opt_duration
from recycle.runtime.protocol.messages import Message
from recycle.runtime.worker.emulation import DEFAULT_SLOT_MS, Emulation, pacing_seconds_per_unit
from recycle.runtime.worker.executor import Comm

__all__ = ["Emulation", "DEFAULT_SLOT_MS", "pacing_seconds_per_unit", "action_cost", "PacedComm", "CostPacer",
           "cost_pacer", "PacingStats"]

def action_cost(config: Config, plan: Plan, action: Action) -> float:
    """Duration of `action` in config units (recycle.ir.costs, the simulator's model). With a coupled optimizer every
    worker leaves the joint step when the slowest stage's OPT ends, so a coupled OPT lasts as long as the longest.
    A chunked plan's F, B and W take 1/C of their worker's stage costs (the simulator's rule); OPT is the worker's.
    A split plan's piece of n of a micro-batch's m samples takes n/m of its F, B and W (the simulator's rule)."""
    if action.kind is not Kind.OPT:
        fraction = plan.work_fraction(action.mb)  # 1.0 for whole micro-batches: x * 1.0 is x
        stage = plan.chunk_stage(action.stage)
        whole = action_duration(config, action.kind, stage, len(plan.live_replicas(stage)))
        return (whole / plan.chunks if plan.chunks > 1 else whole) * fraction
    if plan.staggered:
        return action_duration(config, action.kind, action.stage, len(plan.live_replicas(action.stage)))
    return max(opt_duration(config, s, len(plan.live_replicas(s)))
               for s in range(plan.num_stages) if plan.live_replicas(s))


class PacedComm:
    """A transport wrapper for pacing: sends are held back until the action's padded end (a message must not
    reach its consumer before the emulated producer is done), and the moment each blocking receive or collective
    returns is noted (that is when the action's inputs were there)."""

    def __init__(self, inner: Comm | None, clock: Callable[[], float] = time.perf_counter) -> None:
        self.inner = inner  # None until CostPacer.wrap hands it the executor's transport
        self.clock = clock
        self.held: list[tuple[Message, torch.Tensor]] = []
        # When this action's inputs were there: the return of its last receive (the message it waited for comes
        # last) or of its first collective (the group's meeting point; later collectives are the action's work).
        self.last_arrival: float | None = None
        self.met_group = False

    def _transport(self) -> Comm:
        if self.inner is None:
            raise RuntimeError("a PacedComm was used before CostPacer.wrap gave it a transport")
        return self.inner

    def send(self, message: Message, tensor: torch.Tensor) -> None:
        # Detached: holding the message must not keep the micro-batch's autograd graph alive.
        self.held.append((message, tensor.detach()))

    def release(self) -> None:
        held, self.held = self.held, []  # cleared even when a send raises (a dead peer): never sent later
        for message, tensor in held:
            self._transport().send(message, tensor)

    def recv(self, message: Message, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        tensor = self._transport().recv(message, shape, dtype)
        self.last_arrival = self.clock()
        return tensor

    def start_action(self) -> None:
        self.last_arrival = None
        self.met_group = False

    def _met(self) -> None:
        if not self.met_group:
            self.met_group = True
            self.last_arrival = self.clock()

    def flush(self) -> None:
        self.release()
        self._transport().flush()

    def stage_allreduce_sum(self, stage: int, tensor: torch.Tensor) -> None:
        self._transport().stage_allreduce_sum(stage, tensor)
        self._met()

    def tied_allreduce_sum(self, tensor: torch.Tensor) -> None:
        self._transport().tied_allreduce_sum(tensor)
        self._met()

    def world_allreduce_sum(self, tensor: torch.Tensor) -> None:
        self._transport().world_allreduce_sum(tensor)
        self._met()

    def barrier(self) -> None:
        self._transport().barrier()
        self._met()


@dataclass
class PacingStats:
    """What pacing saw on one worker: how often the real work outlasted the emulated cost, and by how much."""

    actions: int = 0
    overruns: int = 0  # actions whose real work took longer than their emulated cost
    worst_overrun_s: float = 0.0


class CostPacer:
    """Runs each action, then sleeps until its emulated end = start + cost, then releases its messages. A
    StageExecutor takes it as its `pacing` hook (runtime.executor.Pacing).

    start = max(the worker's previous emulated end, the arrival of the action's inputs): a virtual clock per worker,
    so sleep overshoot does not add up along a worker's list; only cross-worker hand-offs see real wake-up and
    transport latency. An action whose real work outlasts its cost ends when the work ends (counted as an overrun).
    """

    def __init__(self, config: Config, plan: Plan, rank: int, emulation: Emulation, comm: PacedComm,
                 clock: Callable[[], float] = time.perf_counter,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.config, self.rank = config, rank
        self.unit_s = pacing_seconds_per_unit(config, emulation)
        self.set_plan(plan)
        self.comm = comm
        self.clock = clock
        self.sleep = sleep
        self.emulated_end: float | None = None  # previous action's emulated end on this worker
        self.stats = PacingStats()

    def wrap(self, comm: Comm) -> PacedComm:
        """The transport the executor talks through: this pacer's PacedComm, now in front of `comm` (a recovery
        hands the executor a new transport)."""
        self.comm.inner = comm
        return self.comm

    def set_plan(self, plan: Plan) -> None:
        """Use `plan`'s costs from now on (a coordinator may switch plans after a failure)."""
        self.plan = plan
        self.cost_s = {a: action_cost(self.config, plan, a) * self.unit_s for a in plan.actions[self.rank]}

    def run_untimed(self, work: Callable[[], None]) -> None:
        """Run work that has no emulated cost (a completion's re-send of a logged tensor): its messages go out as
        soon as it ends. Held until the next paced action instead, a re-send would reach its consumer only after
        this worker's next receive, which may wait on that very consumer."""
        self._held_unless_raised(work)
        self.comm.release()

    def _held_unless_raised(self, work: Callable[[], None]) -> None:
        """Run `work`; if it raises, drop the messages it held: a failed action's messages must never reach a later
        (recovered) transport."""
        try:
            work()
        except BaseException:
            self.comm.held.clear()
            raise

    def run(self, action: Action, work: Callable[[Action], None]) -> None:
        begin = self.clock()
        self.comm.start_action()
        self._held_unless_raised(lambda: work(action))
        done = self.clock()
        start = begin if self.emulated_end is None else min(begin, self.emulated_end)
        if self.comm.last_arrival is not None:
            start = max(start, self.comm.last_arrival)
        cost = self.cost_s.get(action)
        if cost is None:  # a completion's step (ir.completion) that the plan's list does not hold, e.g. a B of a BW
            cost = self.cost_s[action] = action_cost(self.config, self.plan, action) * self.unit_s
        target = start + cost
        if done > target:
            self.stats.overruns += 1
            self.stats.worst_overrun_s = max(self.stats.worst_overrun_s, done - target)
            target = done
        while True:  # sleep() may wake early on a signal; loop until the target has passed
            left = target - self.clock()
            if left <= 0:
                break
            self.sleep(left)
        self.emulated_end = target
        self.stats.actions += 1
        self.comm.release()


def cost_pacer(config: Config, plan: Plan, rank: int, emulation: Emulation) -> CostPacer:
    """The pacing hook for the StageExecutor of `rank` (pass it as `pacing=`): pads each action to `config`'s cost."""
    return CostPacer(config, plan, rank, emulation, PacedComm(None))
