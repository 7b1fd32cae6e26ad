"""A launch's options: one frozen sub-config per concern, each checking its own values when it is made."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable, Literal, Mapping, get_args

from recycle.errors import ConfigError
from recycle.ir.provider import PlanProvider
from recycle.runtime.tools.chaos import ChaosSpec
from recycle.runtime.tools.faults import FaultInjection
from recycle.runtime.worker.emulation import Emulation

if TYPE_CHECKING:
    from recycle.runtime.control.reporter import EventSink

__all__ = ["StageLossPolicy", "StartMethod", "Backend", "STAGE_LOSS_POLICIES", "START_METHODS", "BACKENDS",
           "MIN_TIMEOUT_S", "OutputOptions", "CheckpointOptions", "RecoveryOptions", "ClusterOptions", "FaultOptions",
           "DebugOptions", "LaunchOptions", "KEYWORDS", "with_keywords", "log_progress", "CoordinatorPlace",
           "COORDINATOR_PLACES", "hosts_coordinator"]

# When a stage loses every replica (and a checkpoint exists): "reshape" moves a live worker of the stage with the most
# replicas into it (no spare machine needed), falling back to "respawn" (wait for a replacement process for the dead
# slot, i.e. a repaired machine) when no stage has a replica to spare.
StageLossPolicy = Literal["reshape", "respawn"]
RedoPolicy = Literal["lost", "iteration"]
# "spawn": a fresh interpreter per worker. "forkserver": workers fork from one clean server process that has imported
# torch once (per launcher process), so repeated launches (tests, benchmarks) skip ~2 s of imports each. Plain fork
# would copy the launcher's threads and store connection.
StartMethod = Literal["spawn", "forkserver"]
Backend = Literal["nccl", "gloo"]
# Where the job's store and coordinator run: "node0" in node 0's launcher (the default: one command per node);
# "separate" in a `recycle coordinator` process of their own, which every training node connects to (node 0 is then
# an ordinary training node, whose loss the run survives); "self" is that coordinator process (it runs no worker).
CoordinatorPlace = Literal["node0", "separate", "self"]

STAGE_LOSS_POLICIES: tuple[StageLossPolicy, ...] = get_args(StageLossPolicy)
REDO_POLICIES: tuple[RedoPolicy, ...] = get_args(RedoPolicy)
START_METHODS: tuple[StartMethod, ...] = get_args(StartMethod)
BACKENDS: tuple[Backend, ...] = get_args(Backend)
COORDINATOR_PLACES: tuple[CoordinatorPlace, ...] = get_args(CoordinatorPlace)

MIN_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class OutputOptions:
    """The files a run writes besides its checkpoints (checked against the filesystem by runtime.preflight)."""

    save_path: str = ""  # the final parameters, one state dict of the whole model
    metrics_path: str = ""  # per-step metrics and events as JSON lines
    export_hf: str = ""  # a Hugging Face model's final parameters as a from_pretrained folder (models.hf_export)
    # The gradient-norm metric of every step (StepMetrics.grad_norm) when not clipping (clipping computes the norm
    # anyway): True always, False never, None when a report wants it (--metrics or a sink such as --tensorboard).
    # Off, no worker computes its stage's squared norm (about 2 % of a worker's step CPU; README, runtime parity).
    grad_norm: bool | None = None

    def __post_init__(self) -> None:
        if self.grad_norm is not None and type(self.grad_norm) is not bool:  # "no" would otherwise count as on
            raise ConfigError(f"grad_norm {self.grad_norm!r} must be True (always), False (never) or None (when "
                              "--metrics or a sink such as --tensorboard reports it)")

    @property
    def parts_path(self) -> str:
        """What the stages' final parts are written beside (state.checkpoint.part_file): --save, else the export."""
        return self.save_path or self.export_hf


@dataclass(frozen=True)
class CheckpointOptions:
    """Where checkpoints go, how often, how many are kept, and the one the run resumes from."""

    dir: str = ""
    every: int = 0  # steps between checkpoints (>= 1 with a dir)
    keep: int | None = None  # keep the newest N complete checkpoints (older ones deleted); None: all
    resume_dir: str = ""

    def __post_init__(self) -> None:
        if self.every < 0 or (self.every > 0 and not self.dir):
            raise ConfigError(f"--checkpoint-every {self.every} needs --checkpoint-dir DIR and a value >= 1")
        if self.dir and self.every < 1:
            raise ConfigError(f"--checkpoint-dir {self.dir!r} with --checkpoint-every {self.every} would never write "
                              "a checkpoint; pass --checkpoint-every K with K >= 1 (steps between checkpoints)")
        keep = self.keep
        if keep is not None and (type(keep) is not int or keep < 1):
            raise ConfigError(f"--keep-checkpoints {keep} must be an integer >= 1 (the newest N complete checkpoints "
                              "are kept; 'latest' always names one of them); leave it out to keep every checkpoint")
        if keep is not None and not self.dir:
            raise ConfigError(f"--keep-checkpoints {keep} needs --checkpoint-dir DIR (the checkpoints it keeps)")

    @property
    def enabled(self) -> bool:
        return bool(self.dir)  # a dir comes with every >= 1 (checked above)

    def due(self, step: int) -> bool:
        """A checkpoint is written after `step` completed steps."""
        return self.enabled and step % self.every == 0


@dataclass(frozen=True)
class RecoveryOptions:
    """How failures are detected, and what the run does when a stage loses every replica."""

    timeout_s: float = 30.0  # every collective and p2p op; catches peers that are alive but stuck
    heartbeat_s: float = 0.5
    heartbeat_timeout_s: float = 5.0  # a worker (or node launcher) silent this long is frozen: fenced and replaced
    # One action computing this long (while the heartbeat goes on) is a hang: None = automatic (hang_limit_s).
    hang_timeout_s: float | None = None
    stage_loss: StageLossPolicy = "reshape"
    # With a separate coordinator: how long a node's launcher (and its workers, which train on meanwhile) waits for
    # the coordinator to come back (restarted by k8s, systemd, SLURM or by hand) before it stops the node.
    coordinator_grace_s: float = 600.0
    # After a failure: "lost" keeps the survivors' work of the interrupted iteration and redoes only what died with
    # the failed workers (ir.completion; falls back to "iteration" where that cannot be exact); "iteration" redoes the
    # whole iteration on the new plan.
    redo: RedoPolicy = "lost"

    def __post_init__(self) -> None:
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):
            raise ConfigError(f"--timeout {self.timeout_s:g} must be a positive number of seconds (how long a silent "
                              "peer may take before it counts as failed); e.g. --timeout 30")
        if self.timeout_s < MIN_TIMEOUT_S:
            raise ConfigError(f"--timeout {self.timeout_s:g} s is below {MIN_TIMEOUT_S:g} s: forming a generation's "
                              "groups alone takes tens of milliseconds, so every step would count as a failure; use "
                              "e.g. --timeout 30 (frozen peers are caught by --heartbeat-timeout, not by this)")
        hang = self.hang_timeout_s
        if hang is not None and not hang > 0:
            raise ConfigError(f"--hang-timeout {hang:g} s must be > 0 (seconds one action may compute before its "
                              "worker counts as hung); leave it out for the automatic limit")
        if hang is not None and not math.isfinite(hang):
            raise ConfigError(f"--hang-timeout {hang} must be a finite number of seconds, e.g. 60")
        if not self.heartbeat_timeout_s >= 2 * self.heartbeat_s:
            raise ConfigError(f"--heartbeat-timeout {self.heartbeat_timeout_s:g} s must be at least twice the "
                              f"heartbeat interval ({self.heartbeat_s:g} s), or a busy worker counts as hung")
        if not (math.isfinite(self.coordinator_grace_s) and self.coordinator_grace_s >= 0):
            raise ConfigError(f"--coordinator-grace {self.coordinator_grace_s:g} must be a number of seconds >= 0 "
                              "(how long a node waits for a restarted coordinator), e.g. 600")
        if self.redo not in REDO_POLICIES:
            raise ConfigError(f"--redo {self.redo!r} is not a policy; use lost (keep the survivors' work, the "
                              "default) or iteration (redo the whole interrupted iteration)")
        if self.stage_loss not in STAGE_LOSS_POLICIES:
            raise ConfigError(f"--on-stage-loss {self.stage_loss!r} is not a policy; use one of "
                              f"{', '.join(STAGE_LOSS_POLICIES)}")


def hosts_coordinator(place: CoordinatorPlace, node_rank: int) -> bool:
    """Whether the process at `place` (node `node_rank`) serves the job's store and runs the coordinator."""
    return place == "self" or (place == "node0" and node_rank == 0)


@dataclass(frozen=True)
class ClusterOptions:
    """Where the job's store is, this node's place among the nodes, the job secret, and how workers start."""

    master_addr: str = "127.0.0.1"  # node 0's store listens on this address only
    master_port: int = 0  # 0: pick a free port (single node only)
    nnodes: int = 1
    node_rank: int = 0
    token: str = ""  # the job secret; "" = a fresh one (single node); multi-node runs must share one
    backend: Backend | None = None  # None: nccl with CUDA, else gloo
    start_method: StartMethod = "spawn"
    coordinator: CoordinatorPlace = "node0"  # where the store and the coordinator run (CoordinatorPlace)

    @property
    def hosts_coordinator(self) -> bool:
        """This process serves the job's store and runs the coordinator."""
        return hosts_coordinator(self.coordinator, self.node_rank)

    @property
    def runs_workers(self) -> bool:
        return self.coordinator != "self"

    @property
    def watched_nodes(self) -> range:
        """The training nodes whose launchers the coordinator hears from through the store (all but its own)."""
        return range(1 if self.coordinator == "node0" else 0, self.nnodes)

    def __post_init__(self) -> None:
        if self.coordinator not in COORDINATOR_PLACES:
            raise ConfigError(f"coordinator place {self.coordinator!r} is not one of {', '.join(COORDINATOR_PLACES)}")
        if self.coordinator != "node0" and (self.master_port == 0 or not self.token):
            who = "`recycle coordinator`" if self.coordinator == "self" else "--coordinator separate"
            raise ConfigError(f"{who} needs a fixed --master-port (the coordinator's) and a job secret shared with "
                              "every training node (RECYCLE_JOB_TOKEN or --token-file FILE): the nodes connect to it "
                              "over the network")
        if not 0 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port {self.master_port} is not a TCP port; use 1..65535 (or 0 on a single "
                              "node: any free port)")
        if not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--node-rank {self.node_rank} must be in [0, --nnodes {self.nnodes})")
        if self.nnodes > 1 and self.master_port == 0:
            raise ConfigError("--nnodes > 1 needs a fixed --master-port that every node uses")
        if self.nnodes > 1 and not self.token:
            raise ConfigError("--nnodes > 1 needs a job secret shared by every node: set RECYCLE_JOB_TOKEN (48 hex "
                              "digits, e.g. from `python -c 'import secrets; print(secrets.token_hex(24))'`) or "
                              "pass --token-file FILE (mode 600) on every node")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ConfigError(f"backend {self.backend!r} is not supported; use one of {', '.join(BACKENDS)}, or "
                              "leave it out (nccl with CUDA, else gloo)")
        if self.start_method not in START_METHODS:
            raise ConfigError(f"start method {self.start_method!r} is not supported; use 'spawn' or 'forkserver' "
                              "(plain fork would copy the launcher's threads and store connection)")


@dataclass(frozen=True)
class FaultOptions:
    """Failures and repairs made on purpose (tests, demos, soaks): scripted faults and re-joins, timed repairs and
    random chaos."""

    injections: tuple[tuple[int, FaultInjection], ...] = ()  # (topology rank, fault); a rank may have several
    rejoins: tuple[tuple[int, int], ...] = ()  # (topology rank, 0-based step): bring the worker back then (if down)
    respawn_after_s: float | None = None  # bring every dead worker of this node back after this delay
    chaos: ChaosSpec | None = None  # seeded random kills, hangs and stage losses, each repaired (soak runs)

    def __post_init__(self) -> None:
        after = self.respawn_after_s
        if after is not None and not (math.isfinite(after) and after >= 0):
            raise ConfigError(f"--respawn-after {after:g} must be >= 0 seconds, a finite number (leave it out to "
                              "never start a dead worker again)")

    def of(self, rank: int) -> tuple[FaultInjection, ...]:
        """The scripted faults of one worker."""
        return tuple(fault for r, fault in self.injections if r == rank)


@dataclass(frozen=True)
class DebugOptions:
    """Checks and measurements for tests and timing studies."""

    record_timings: bool = False  # every action's start and end in the step records
    verify_replicas: bool = False  # check after every step that all live replicas of a stage are bit-identical
    emulation: Emulation | None = None  # pad every action to the config's cost (--emulate-costs)


def log_progress(line: str) -> None:
    """The default progress sink: an INFO line of the launcher's logger (the CLI prints those on stdout)."""
    import logging  # here: `recycle train --help` imports this module but not logging

    logging.getLogger("recycle.runtime.control.launcher").info(line)


@dataclass(frozen=True)
class LaunchOptions:
    """Everything `launch` takes besides the config and the plan: values grouped by concern, then the callbacks."""

    steps: int | None = None  # total steps to reach (default: [training] steps)
    model_factory: str = ""  # "package.module:function" returning the S stage modules; "" = the built-in GPT
    outputs: OutputOptions = OutputOptions()
    checkpoint: CheckpointOptions = CheckpointOptions()
    recovery: RecoveryOptions = RecoveryOptions()
    cluster: ClusterOptions = ClusterOptions()
    faults: FaultOptions = FaultOptions()
    debug: DebugOptions = DebugOptions()
    plan_provider: PlanProvider | None = None  # None: a worker failure stops the run (nothing to switch to)
    progress: Callable[[str], None] | None = log_progress  # one line per step, recovery and event; None: silent
    # Node 0 hands it each StepMetrics, Recovery and ChaosEvent as it reports them (--tensorboard).
    sink: EventSink | None = None

    def __post_init__(self) -> None:
        if self.steps is not None and self.steps < 0:
            raise ConfigError(f"--steps {self.steps} must be >= 0")

    @property
    def wants_grad_norm(self) -> bool:
        """Whether this launch's reports use the gradient-norm metric (OutputOptions.grad_norm, resolved)."""
        explicit = self.outputs.grad_norm
        return explicit if explicit is not None else bool(self.outputs.metrics_path) or self.sink is not None


# recycle.train(**keywords): each option by its flat name (one per CLI flag) -> (its sub-config or "", its field).
KEYWORDS: dict[str, tuple[str, str]] = {
    "steps": ("", "steps"), "model_factory": ("", "model_factory"),
    "save_path": ("outputs", "save_path"), "metrics_path": ("outputs", "metrics_path"),
    "export_hf": ("outputs", "export_hf"), "grad_norm": ("outputs", "grad_norm"),
    "checkpoint_dir": ("checkpoint", "dir"), "checkpoint_every": ("checkpoint", "every"),
    "keep_checkpoints": ("checkpoint", "keep"), "resume_dir": ("checkpoint", "resume_dir"),
    **{name: ("recovery", name) for name in ("timeout_s", "heartbeat_s", "heartbeat_timeout_s", "hang_timeout_s",
                                             "coordinator_grace_s", "stage_loss", "redo")},
    **{name: ("cluster", name) for name in ("master_addr", "master_port", "nnodes", "node_rank", "token", "backend",
                                            "start_method", "coordinator")},
    "faults": ("faults", "injections"),
    **{name: ("faults", name) for name in ("rejoins", "respawn_after_s", "chaos")},
    **{name: ("debug", name) for name in ("record_timings", "verify_replicas", "emulation")},
    **{name: ("", name) for name in ("plan_provider", "progress", "sink")},
}


def with_keywords(options: LaunchOptions, keywords: Mapping[str, Any]) -> LaunchOptions:
    """`options` with the KEYWORDS given replaced; each sub-config is rebuilt once, so it checks the new values
    together (a checkpoint dir and its interval, say)."""
    top: dict[str, Any] = {}
    groups: dict[str, dict[str, Any]] = {}
    for name, value in keywords.items():
        group, field = KEYWORDS[name]
        (groups.setdefault(group, {}) if group else top)[field] = value
    for group, changes in groups.items():
        top[group] = replace(getattr(options, group), **changes)
    return replace(options, **top)

