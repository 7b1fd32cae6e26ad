"""Shared vocabulary of the job simulator: cost knobs, the job context, a system's decision, the system protocol,
and the D x S layout of units a system keeps."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Protocol

from recycle.config import Config
from recycle.errors import ConfigError

__all__ = ["JobCosts", "JobContext", "CheckpointTiming", "Decision", "SystemModel", "StageLayout", "CAUSES"]

# Causes of lost time, in report order. Each is in seconds of fault-free-equivalent training time.
CAUSES = (
    "degraded",  # running slower than fault-free because workers are missing
    "redundant computation",  # Bamboo's fault-free overhead
    "detection",  # noticing a failure (heartbeat timeout)
    "plan switch",  # ReCycle: plan lookup + communicator rebuild
    "redone iteration",  # ReCycle: the iteration a failure interrupted is redone; torchft-like: the step is discarded
    "reconfiguration",  # Oobleck / Bamboo: re-instantiate pipelines, copy layers; torchft-like: a new quorum
    "heal",  # torchft-like: a re-joining replica group receives the model state from a live peer; the others wait
    "restart",  # restart from a checkpoint (relaunch + load)
    "checkpoint",  # writing periodic checkpoints
    "lost work",  # progress since the last checkpoint, rolled back
    "down",  # no progress possible (too few workers, or the model does not fit)
)


@dataclass(frozen=True)
class JobCosts:
    """Per-event costs and policies, in seconds. Defaults and their sources are listed in docs/traces.md."""

    detect_s: float = 10.0  # failure detection (heartbeat timeout); assumption
    plan_switch_s: float = 2.0  # ReCycle: look the plan up, rebuild communicators; assumption
    # ReCycle: a failure interrupts the running iteration, and the runtime rolls the survivors back to its start and
    # redoes it on the new plan (docs/recovery.md), so the work done in it is lost: on average half an iteration of the
    # state before the failure for a failure at a uniformly random moment. 0 = the paper's model (no redo).
    redo_fraction: float = 0.5
    restart_s: float = 701.0  # checkpoint restart: Oobleck artifact, Varuna GPT-3 6.7B rendezvous (701,000 ms)
    checkpoint_interval_s: float = 1800.0  # checkpoint-restart baseline: one checkpoint every 30 min; assumption
    checkpoint_cost_s: float = 120.0  # Oobleck artifact, Varuna GPT-3 6.7B checkpointing overhead (120,000 ms)
    fallback_checkpoint_interval_s: float = 3600.0  # adaptive systems checkpoint too, as a fallback; assumption
    fallback_checkpoint_cost_s: float = 0.0  # ... asynchronously (CheckFreq-style): no pause; assumption
    # ReCycle's fallback checkpoint as the runtime takes it (`recycle train --checkpoint-every K`): every K iterations
    # of progress instead of every fallback_checkpoint_interval_s of running (0: by time). A checkpoint is restorable
    # only `checkpoint_latency_s` after its iteration ends (the asynchronous write of the slowest stage's shard, then
    # the coordinator's merge): a restore goes back to the newest checkpoint complete at the failure.
    checkpoint_every_steps: float = 0.0
    checkpoint_latency_s: float = 0.0
    # Iterations the job had done when the trace starts: its checkpoints fall at multiples of checkpoint_every_steps
    # counted from the job's first iteration (a trace cut from a run that was already going).
    steps_done_at_start: float = 0.0
    # Charge a restore the *expected* progress since the newest complete checkpoint (half an interval plus the
    # latency's worth at the running rate) instead of what the replay's own checkpoint phase gives: over a run the
    # replay's progress drifts from the real job's by more than an interval, so its phase is a fresh draw, and an
    # expectation predicts a run with few restores with less error. Needs checkpoint_every_steps.
    restore_expected_loss: bool = False
    # ReCycle keeps the runtime's layout rules (recycle.runtime.control.coordinator) instead of the planner's: a
    # returning unit takes back its own slot (or the one its reshape donor left), and a stage that lost every
    # replica is refilled by moving workers within their pipelines until the stages' counts differ by at most one.
    runtime_layout: bool = False
    oobleck_reconfig_s: float = 10.0  # Oobleck artifact, GPT-3 6.7B reconfiguration (10,000 ms)
    bamboo_reconfig_s: float = 450.0  # Oobleck artifact, Bamboo GPT-3 6.7B local rendezvous (450,000 ms)
    bamboo_rc_overhead: float = 0.2785  # Oobleck artifact bamboo_simulator redundant_ratio (6 h trace)
    device_memory_bytes: int = 80 * 10**9  # A100 80 GB (the paper's testbed GPU)
    # ReCycle's reshape policy (docs/traces.md): on a change, re-lay the live workers out as D' = live // S full
    # pipelines plus re-routed leftovers when that is faster and the gain over `reshape_horizon_s` repays the pause
    # (`oobleck_reconfig_s` + the slowest state copy of a worker that changes stage); assumption.
    reshape: bool = True
    reshape_horizon_s: float = 1800.0
    # ReCycle+ (traces/repartition.py): the expected time until the next change before any change is seen (then
    # the running mean gap, this prior counted once); it weighs a layer migration's pause against its gain.
    repartition_prior_s: float = 1800.0
    # torchft-like (traces/torchft_like.py; sources in docs/traces.md): the lighthouse's heartbeat timeout
    # (heartbeat_timeout_ms default 5000), a new quorum and its process-group rebuild (quorum_tick_ms 100 + the
    # 2 s communicator rebuild ReCycle's plan_switch_s assumes), the share of the step in flight that every group
    # discards on a failure (Manager.report_error: the step is skipped), the live-recovery bandwidth per GPU
    # (torchft PR #119: 12 GB in ~5 s with PGTransport in place), the relaunch of a repaired group (assumption), and
    # whether idle survivors of broken groups may be pooled into new groups (off: a group waits for its own repair).
    torchft_detect_s: float = 5.0
    torchft_quorum_s: float = 2.1
    torchft_lost_step_fraction: float = 1.0
    torchft_heal_bytes_per_s: float = 2.4e9
    torchft_restart_s: float = 60.0
    torchft_regroup: bool = False

    def __post_init__(self) -> None:
        for name, value in self.__dict__.items():
            if not math.isfinite(value) or value < 0:
                raise ConfigError(f"job cost {name} = {value} must be a finite number >= 0 (--{name.replace('_', '-')})")
        if self.checkpoint_interval_s <= 0 or self.fallback_checkpoint_interval_s <= 0:
            raise ConfigError(f"checkpoint intervals must be > 0 seconds, got checkpoint_interval_s = "
                              f"{self.checkpoint_interval_s}, fallback_checkpoint_interval_s = "
                              f"{self.fallback_checkpoint_interval_s} (--checkpoint-interval-s, "
                              "--fallback-checkpoint-interval-s)")
        if self.restore_expected_loss and not self.checkpoint_every_steps:
            raise ConfigError("restore_expected_loss needs checkpoint_every_steps > 0 (the interval whose half a "
                              "restore is expected to lose; --checkpoint-every-steps K, or --calibrate-checkpoints)")
        if self.checkpoint_every_steps != int(self.checkpoint_every_steps):
            raise ConfigError(f"checkpoint_every_steps = {self.checkpoint_every_steps} must be a whole number of "
                              "iterations (0: checkpoint by time; --checkpoint-every-steps)")
        if self.redo_fraction > 1:
            raise ConfigError(f"redo_fraction = {self.redo_fraction} must be in [0, 1] (a fraction of one iteration; --redo-fraction)")
        if self.torchft_lost_step_fraction > 1:
            raise ConfigError(f"torchft_lost_step_fraction = {self.torchft_lost_step_fraction} must be in [0, 1] (a "
                              "fraction of one step; --torchft-lost-step-fraction)")
        if self.torchft_heal_bytes_per_s <= 0:
            raise ConfigError(f"torchft_heal_bytes_per_s = {self.torchft_heal_bytes_per_s} must be > 0 (bytes per "
                              "second of live recovery per GPU, e.g. 2.4e9; --torchft-heal-bytes-per-s)")
        if not 0 <= self.bamboo_rc_overhead < 1:
            raise ConfigError(f"bamboo_rc_overhead = {self.bamboo_rc_overhead} must be in [0, 1)")


@dataclass(frozen=True)
class JobContext:
    """Everything a system model needs: the job config, its fault-free rate and the cost knobs."""

    config: Config
    fault_free_rate: float  # samples per second with every worker live (ReCycle's fault-free plan)
    seconds_per_unit: float  # seconds per config time unit
    costs: JobCosts = field(default_factory=JobCosts)

    @property
    def num_workers(self) -> int:
        return self.config.num_replicas * self.config.num_stages

    @property
    def worker_memory_bytes(self) -> int:
        """Device memory of one worker: a worker is a TP group of gpus_per_worker devices."""
        return self.costs.device_memory_bytes * self.config.topology.gpus_per_worker

    def stage_state_bytes(self, stage: int) -> int:
        m = self.config.memory
        return m.parameter_bytes[stage] + m.optimizer_state_bytes[stage]

    def transfer_s(self, nbytes: float) -> float:
        """Seconds to move `nbytes` over one p2p link (the config's communication section); 0 if infinite."""
        return self.config.communication.transfer_time(nbytes) * self.seconds_per_unit

    def stage_transfer_s(self, stage: int) -> float:
        """A re-joining worker copies its stage's parameters and optimizer state from a live peer."""
        return self.transfer_s(self.stage_state_bytes(stage))


@dataclass(frozen=True)
class CheckpointTiming:
    """When a system's periodic checkpoints are taken, and when each can be restored (both: the runtime's rules)."""

    every_samples: float = 0.0  # > 0: one every this many samples of progress, instead of by running time
    latency_s: float = 0.0  # a checkpoint is restorable this long after it is taken (asynchronous write + merge)
    done_at_start: float = 0.0  # samples of progress before the replay starts (where the multiples count from)
    expected_loss: bool = False  # a rollback loses every_samples / 2 + latency_s x rate, not the replay's phase


@dataclass(frozen=True)
class Decision:
    """What a system does after a change: its running rate, pauses to serve first, and bookkeeping."""

    rate: float  # samples/s while running in this state (0 = cannot run)
    pauses: tuple[tuple[str, float], ...] = ()  # (cause, seconds), served in order after any ongoing pause
    rollback: bool = False  # lose the progress since the last checkpoint
    checkpoint_now: bool = False  # a checkpoint is written now (its pause is in `pauses`): nothing to lose after
    wake_at: float | None = None  # call on_wake at this time (e.g. a state transfer ends)
    down_cause: str = "down"  # cause for time with rate 0 outside pauses
    overhead: tuple[tuple[str, float], ...] = ()  # (cause, samples/s) explaining part of fault_free - rate
    note: str = ""  # for the event log (e.g. "fatal: stage 2 lost every replica")


class SystemModel(Protocol):
    """A training system replayed over a trace. Implementations keep their own state between calls."""

    name: str
    label: str  # e.g. "ReCycle (planner)", "Oobleck-like (model)"
    checkpoint: tuple[float, float] | None  # (interval_s, cost_s) of periodic checkpoints, or None
    # Optional `checkpoint_timing: CheckpointTiming`: checkpoints by progress and their restore latency (default: by
    # running time, restorable at once).

    def start(self, now: float, live: frozenset[int]) -> Decision: ...

    def on_change(self, now: float, live: frozenset[int], lost: frozenset[int], joined: frozenset[int]) -> Decision:
        ...

    def on_wake(self, now: float) -> Decision: ...


class StageLayout:
    """Which unit holds worker (replica, stage); spare units wait; a unit may still be receiving its state.

    Mutable on purpose: a system model owns one and updates it as units fail and join.
    """

    def __init__(self, num_replicas: int, num_stages: int) -> None:
        self.num_replicas = num_replicas
        self.num_stages = num_stages
        self.slot: dict[tuple[int, int], int] = {}  # (replica, stage) -> unit
        self.where: dict[int, tuple[int, int]] = {}
        self.ready_at: dict[int, float] = {}  # unit -> time its state transfer ends (absent: ready)
        self.spares: list[int] = []

    # -- queries --------------------------------------------------------------------------------------------
    def ready_workers(self, now: float) -> set[tuple[int, int]]:
        return {w for w, u in self.slot.items() if self.ready_at.get(u, -1.0) <= now}

    def failed_workers(self, now: float) -> set[tuple[int, int]]:
        """Grid positions without a ready unit (empty, or still receiving state)."""
        ready = self.ready_workers(now)
        return {(p, s) for p in range(self.num_replicas) for s in range(self.num_stages) if (p, s) not in ready}

    def live_per_stage(self, now: float) -> list[int]:
        """Ready workers per stage."""
        counts = [0] * self.num_stages
        for (_, s), u in self.slot.items():
            if self.ready_at.get(u, -1.0) <= now:
                counts[s] += 1
        return counts

    def next_ready(self, now: float) -> float | None:
        pending = [t for t in self.ready_at.values() if t > now]
        return min(pending) if pending else None

    # -- updates --------------------------------------------------------------------------------------------
    def place_all(self, units: Iterable[int], replicas: int | None = None) -> None:
        """Fresh layout (job start or restore): fill stage by stage so stages stay balanced, rest are spares."""
        self.slot.clear()
        self.where.clear()
        self.ready_at.clear()
        ordered = sorted(units)
        use = self.num_replicas if replicas is None else replicas
        it = iter(ordered)
        placed: set[int] = set()
        for p in range(use):
            for s in range(self.num_stages):
                u = next(it, None)
                if u is None:
                    break
                self.slot[(p, s)] = u
                self.where[u] = (p, s)
                placed.add(u)
        self.spares = [u for u in ordered if u not in placed]

    def remove(self, unit: int) -> tuple[int, int] | None:
        """A unit died: free its slot (returned) or drop it from the spares."""
        self.ready_at.pop(unit, None)
        if unit in self.where:
            w = self.where.pop(unit)
            del self.slot[w]
            return w
        if unit in self.spares:
            self.spares.remove(unit)
        return None

    def add_spare(self, unit: int) -> None:
        if unit not in self.where and unit not in self.spares:
            self.spares.append(unit)

    def fill_from_spares(self, now: float, transfer_s, replicas: Iterable[int] | None = None) -> list[tuple[int, int]]:
        """Put spares into empty slots, most-depleted stage first; each needs `transfer_s(stage)` seconds of state
        transfer from a live peer before it counts as a worker. Returns the slots filled."""
        filled = []
        rows = list(range(self.num_replicas)) if replicas is None else list(replicas)
        while self.spares:
            empty = [(p, s) for p in rows for s in range(self.num_stages) if (p, s) not in self.slot]
            if not empty:
                break
            live_per_stage = {s: sum(1 for (p, st) in self.slot if st == s) for s in range(self.num_stages)}
            p, s = min(empty, key=lambda w: (live_per_stage[w[1]], w[1], w[0]))
            u = self.spares.pop(0)
            self.slot[(p, s)] = u
            self.where[u] = (p, s)
            delay = transfer_s(s)
            if delay > 0:
                self.ready_at[u] = now + delay
            filled.append((p, s))
        return filled
