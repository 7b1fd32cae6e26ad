"""Set up and run trace experiments: build the systems for a job, size the job to a trace, the paper's comparison."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from recycle.collector import collector_paused
from recycle.config import Config
from recycle.errors import ConfigError
from recycle.planner.options import PlannerOptions
from recycle.traces.baselines import BambooLike, CheckpointRestart, FaultFree, FaultScaled, OobleckLike
from recycle.traces.jobsim import JobResult, replay_all
from recycle.traces.mapping import UnitTimeline, map_trace_to_units
from recycle.traces.model import JobContext, JobCosts, SystemModel
from recycle.traces.recycle_system import ReCycleSystem
from recycle.traces.throughput import (MAX_SLOT_SECONDS, PeriodFn, ThroughputModel, make_period_fn, reference_period,
                                       seconds_per_unit)
from recycle.traces.torchft_like import TorchftLike
from recycle.traces.trace import ADD, EventTrace, WorkerGrid, check_replay_size

if TYPE_CHECKING:
    from recycle.traces.plan_cache import PlanCache
    from recycle.traces.repartition import PartitionModel

__all__ = [
    "SYSTEM_NAMES",
    "check_systems",
    "JobSetup",
    "size_to_trace",
    "job_grid",
    "run_job",
    "TRACES_DIR",
    "find_traces_dir",
    "PAPER",
    "GPT3_350M_LIKE",
    "LLAMA3_405B_LIKE",
    "named_config",
]

SYSTEM_NAMES = ("recycle", "recycle-plus", "fault-free", "fault-scaled", "checkpoint-restart", "oobleck", "bamboo",
                "torchft-like")

# The paper's numbers this experiment is compared with (recycle-paper.md §5.2, abstract).
PAPER = {
    "recycle_vs_fault_free": 10.8 / 11.34,  # GCP trace, larger model, real hardware
    "recycle_vs_oobleck_trace": 1.2,  # 10.8 / 9.01 on that trace
    "recycle_vs_oobleck_max": 1.46,  # headline, experiment not identified
    "recycle_vs_bamboo_max": 1.64,  # headline (= the 350M GCP-trace average, 19.5 / 11.85)
}

TRACES_DIR = Path("..") / "shared" / "data" / "traces"


def find_traces_dir(repo_root: str | Path | None = None) -> Path | None:
    """The shared traces folder beside the checkout (`<repo>/../shared/data/traces`), or None if absent."""
    root = Path(repo_root) if repo_root is not None else Path(__file__).resolve().parents[3]
    path = (root / TRACES_DIR).resolve()
    return path if path.is_dir() else None


@dataclass(frozen=True)
class JobSetup:
    """How a trace is laid onto a job."""

    gpus_per_node: int = 1  # GPUs per trace node; a worker is config.topology.gpus_per_worker GPUs
    replicas: str = "keep"  # "keep" the config's D, or "auto": D = live units at the start // S (spares: rest)
    slot_seconds: float = 1.0  # seconds per slot for slot-unit configs
    period_model: str = "auto"  # "planner", "estimate" or "auto"
    solver: str = "heuristic"
    # "1f1b": fault-free = the 1F1B period (the paper's reference: DeepSpeed, which ReCycle matches fault-free,
    # S29); ReCycle's rate in a failure state is capped at it. "planner": fault-free = ReCycle's own plan for
    # the fault-free key (decoupled, staggered), which can be faster than 1F1B; nothing is capped.
    reference: str = "1f1b"

    def __post_init__(self) -> None:
        if not 1 <= self.gpus_per_node <= MAX_GPUS_PER_NODE:
            raise ConfigError(f"--gpus-per-node {self.gpus_per_node} must be in [1, {MAX_GPUS_PER_NODE}] (GPUs of one "
                              "trace node: 8 in a DGX node, 72 in an NVL72 rack)")
        if not (math.isfinite(self.slot_seconds) and 0 < self.slot_seconds <= MAX_SLOT_SECONDS):
            raise ConfigError(f"--slot-seconds {self.slot_seconds:g} must be a number of seconds in (0, "
                              f"{MAX_SLOT_SECONDS:g}] (the length of one slot of a slot-unit config, e.g. 1)")


MAX_GPUS_PER_NODE = 1_024
# Each checkpoint a system writes is one step of its replay (~ microseconds): the trace's duration over the shortest
# checkpoint interval is bounded.
MAX_REPLAY_CHECKPOINTS = 1_000_000


def check_replay(trace: EventTrace, gpus_per_node: int, gpus_per_worker: int, costs: JobCosts) -> None:
    """Before the unit timeline is built: its change points x most live units within MAX_REPLAY_SIZE, and the
    checkpoints the systems would write over the trace within MAX_REPLAY_CHECKPOINTS."""
    live = most = len(trace.initial)
    changes, last = 1, None
    for e in trace.events:
        live += 1 if e.action == ADD else -1
        most = max(most, live)
        if e.time_ms != last:
            changes, last = changes + 1, e.time_ms
    units = most * max(1, gpus_per_node // max(gpus_per_worker, 1))
    check_replay_size(changes, units, trace.source, "cut the trace into shorter windows")
    duration_s = trace.end_ms / 1000.0
    for flag, interval in (("--checkpoint-interval-s", costs.checkpoint_interval_s),
                           ("--fallback-checkpoint-interval-s", costs.fallback_checkpoint_interval_s)):
        if duration_s / interval > MAX_REPLAY_CHECKPOINTS:
            raise ConfigError(f"{flag} {interval:g} over the trace's {duration_s:,.0f} s is "
                              f"{duration_s / interval:,.0f} checkpoints, above the limit of "
                              f"{MAX_REPLAY_CHECKPOINTS:,} for one replay (each is a step of it); raise {flag} or "
                              "replay a shorter trace")


def size_to_trace(config: Config, timeline: UnitTimeline, replicas: str) -> Config:
    """`keep`: the config as is. `auto`: D = (most units ever live in the trace) // S: the job is sized for the
    largest cluster the trace offers and runs degraded while it has fewer; units beyond D x S are spares for every
    system (the Oobleck traces: 30 nodes, S = 4 -> D = 7 and 2 spares; the p3 trace: at most 32 -> D = 8, which
    starts with 18 live and averages about 24)."""
    if replicas == "keep":
        return config
    if replicas != "auto":
        raise ConfigError(f"replicas mode {replicas!r} is unknown; use keep or auto")
    most = timeline.max_live
    d = most // config.num_stages
    if d < 1:
        raise ConfigError(f"the trace never has more than {most} worker unit(s) live, fewer than num_stages = "
                          f"{config.num_stages}; use a trace with more nodes or fewer stages")
    return config.with_topology(num_replicas=d)


def job_grid(config: Config, gpus_per_node: int = 1, replicas: str = "keep") -> WorkerGrid:
    """The worker grid a grid-aware placement of an availability trace must act on for this job (`replicas`
    "auto": D is sized to the trace, as `size_to_trace` does)."""
    if replicas not in ("keep", "auto"):
        raise ConfigError(f"replicas mode {replicas!r} is unknown; use keep or auto")
    return WorkerGrid(num_stages=config.num_stages,
                      num_replicas=config.num_replicas if replicas == "keep" else None,
                      gpus_per_node=gpus_per_node, gpus_per_worker=config.topology.gpus_per_worker)


def _check_placement_grid(trace: EventTrace, config: Config, gpus_per_node: int,
                          timeline: UnitTimeline) -> None:
    """A grid-aware placement chose its nodes for one grid; replaying it on another would hit other stages."""
    grid = trace.placement_grid
    if grid is None:
        return
    placed_d = grid.num_replicas if grid.num_replicas is not None else timeline.max_live // max(grid.num_stages, 1)
    if placed_d != config.num_replicas or grid.num_stages != config.num_stages or grid.gpus_per_node != gpus_per_node or \
            grid.gpus_per_worker != config.topology.gpus_per_worker:
        raise ConfigError(
            f"{trace.source or 'trace'}: its failures were placed ({trace.placement}) for the grid "
            f"{grid.describe()}, but the job is D={config.num_replicas} x S={config.num_stages}, {gpus_per_node} "
            f"GPU(s) per node, {config.topology.gpus_per_worker} per worker; place them for the job's grid "
            "(job_grid(config, ...); `recycle simulate` does this)")


def check_systems(systems: Sequence[str]) -> None:
    """Every name must be one of SYSTEM_NAMES (the error names the unknown ones and the choices)."""
    unknown = [s for s in systems if s not in SYSTEM_NAMES]
    if unknown:
        raise ConfigError(f"unknown system(s) {', '.join(map(repr, unknown))}: a system is one of "
                          f"{', '.join(SYSTEM_NAMES)}; e.g. --systems recycle torchft-like")


def run_job(config: Config, trace: EventTrace, systems: Sequence[str] = SYSTEM_NAMES,
            costs: JobCosts = JobCosts(), setup: JobSetup = JobSetup(), period_fn: PeriodFn | None = None,
            period_label: str = "", options: PlannerOptions = PlannerOptions(),
            progress: Callable[[str], None] | None = None, plan_cache: PlanCache | None = None,
            split_microbatches: bool = False, exact_screens: bool = False) -> JobResult:
    """Map the trace onto the job, build every requested system and replay them all. With `plan_cache` every plan
    and partition choice is made once per run and kept (validated on reading) across runs, and a reshape that
    cannot pay is ruled out by a bound before its key is planned; without it the planner's own in-process caches
    serve and every weighed key is planned (the path before the plan cache existed: benchmarks compare the two).
    `split_microbatches`: ReCycle+ plans with `PlannerOptions.split_microbatches` (a failed worker's micro-batches
    cut into pieces where that is strictly faster; issue 26's "beyond ReCycle"); ReCycle's line stays the paper's
    whole micro-batches. `exact_screens`: ReCycle+'s partition screens try every priority rule instead of the
    first QUICK_SCREEN_RULES (slower; the partition polished may differ: docs/traces.md, "Quick partition
    screens")."""
    check_systems(systems)
    check_replay(trace, setup.gpus_per_node, config.topology.gpus_per_worker, costs)
    # The runtime's layout rules need a returning machine to be the same unit (it restarts a worker in its slot).
    timeline = map_trace_to_units(trace, setup.gpus_per_node, config.topology.gpus_per_worker,
                                  keep_positions=costs.runtime_layout)
    config = size_to_trace(config, timeline, setup.replicas)
    _check_placement_grid(trace, config, setup.gpus_per_node, timeline)
    if setup.reference not in ("1f1b", "planner"):
        raise ConfigError(f"reference {setup.reference!r} is unknown; use 1f1b (the paper's) or planner")
    given_period_fn = period_fn
    if period_fn is None:
        period_fn, period_label = make_period_fn(config, setup.period_model, options, setup.solver, plan_cache)
    floor = reference_period(config) if setup.reference == "1f1b" else None

    def bound_for(opts: PlannerOptions) -> Callable[[tuple[int, ...]], float] | None:
        if plan_cache is None or not period_label.startswith("planner"):
            return None
        from recycle.planner.bounds import period_lower_bound

        # Reshapes that cannot pay are ruled out by this bound without planning their key (a hair under it: the
        # planner clamps float noise of its own bound to the period).
        return lambda key: period_lower_bound(config, key, opts) * (1 - 1e-9)

    def cap_for(opts: PlannerOptions) -> Callable[[tuple[int, ...]], float] | None:
        if plan_cache is None or not period_label.startswith("planner") or setup.solver != "heuristic":
            return None
        from recycle.planner.upper_bound import period_upper_bound

        # A key whose first rule schedule proves its plan at or under the 1F1B floor gets the floor unplanned: the
        # same rate as planned (docs/planner.md, "An upper bound from the first rule schedule").
        return lambda key: _or_inf(period_upper_bound(config, key, opts))

    throughput = ThroughputModel(config, period_fn, seconds_per_unit(config, setup.slot_seconds), period_label,
                                 floor_period=floor, period_bound=bound_for(options), period_cap=cap_for(options))
    plus_options, plus_throughput = options, throughput
    if split_microbatches and (given_period_fn is not None or not period_label.startswith("planner")):
        raise ConfigError(f"--split-microbatches needs the planner's periods, but the period source is "
                          f"{period_label!r}; use --period-model planner (or auto), or drop --split-microbatches")
    if split_microbatches:
        # ReCycle+ alone gets its own rates (the configured layout's periods included) from split plans.
        plus_options = replace(options, split_microbatches=True)
        plus_fn, _ = make_period_fn(config, setup.period_model, plus_options, setup.solver, plan_cache)
        plus_throughput = ThroughputModel(config, plus_fn, throughput.seconds_per_unit, f"{period_label}, split",
                                          floor_period=floor, period_bound=bound_for(plus_options),
                                          period_cap=cap_for(plus_options))
    if progress:
        progress(f"planning the fault-free state of {config.name} (D={config.num_replicas}, S={config.num_stages})")
    ctx = JobContext(config, throughput.fault_free(), throughput.seconds_per_unit, costs)
    partitions: PartitionModel | None = None
    skipped: dict[str, str] = {}
    if "recycle-plus" in systems:
        partitions, why = _partition_model(config, plus_throughput, plus_options, period_label, plan_cache,
                                           exact_screens)
        if why:
            skipped["recycle-plus"] = f"cannot re-partition: {why}"
            systems = [s for s in systems if s != "recycle-plus"]
    built = _build_systems(systems, ctx, throughput, partitions, plus_throughput)
    # A cold replay keeps every plan and rule schedule it makes (millions of tuples, no cyclic garbage); the
    # collector's passes over them took ~6 % of its CPU (1.6 of 26 CPU s of oobleck-scaled-p3, gc.callbacks).
    with collector_paused():
        result = replay_all(built, timeline, ctx, progress)
    policy = next((list(b.policy_log) for b in built if type(b) is ReCycleSystem), [])
    plus = next((list(b.policy_log) for b in built if b.name == "recycle-plus"), [])
    torchft = next((b for b in built if isinstance(b, TorchftLike)), None)
    extra = {
        "config": config.name,
        "num_replicas": config.num_replicas,
        "num_stages": config.num_stages,
        "trace": trace.source,
        "trace_notes": trace.notes.messages(),
        "placement": trace.placement or "events given by the trace",
        "period_model": period_label,
        "reference": setup.reference,
        "keys_planned": throughput.keys_planned,
        # Of them, the keys whose first rule schedule proved them at the 1F1B floor: their rate without a plan.
        "keys_at_floor_unplanned": throughput.keys_at_floor,
        # Whether ReCycle+ planned with micro-batches split into pieces (run_job's split_microbatches).
        "split_microbatches": plus_throughput is not throughput,
        "costs": costs.__dict__,
        "recycle_policy": [{"time_s": t, "policy": name, "detail": detail} for t, name, detail in policy],
        "recycle_plus_policy": [{"time_s": t, "policy": name, "detail": detail} for t, name, detail in plus],
        # Per failure state ReCycle+ planned: re-routing alone vs re-partitioned vs the ideal live-proportional
        # period (config time units) and the partition chosen.
        "partitions": [c.to_dict() for c in partitions.choices().values()] if partitions is not None else [],
        # Seconds ReCycle+ spent per (failure key, layer partition), running and in all.
        "recycle_plus_states": next((b.time_by_state(timeline.end_s) for b in built if b.name == "recycle-plus"), []),
        "skipped": skipped,
        # What the plan cache did in this run (hits from disk, misses planned, entries rejected and rebuilt).
        "plan_cache": ({"folder": str(plan_cache.root) if plan_cache.root else None, **plan_cache.stats.to_dict()}
                       if plan_cache is not None else None),
        # torchft-like's active replica groups over time: its global batch is that many x M micro-batches.
        "torchft_groups": [{"time_s": t, "active_groups": n} for t, n in torchft.group_log] if torchft else [],
    }
    return replace(result, extra=extra)


def _or_inf(value: float | None) -> float:
    return math.inf if value is None else value


def _partition_model(config: Config, throughput: ThroughputModel, options: PlannerOptions,
                     period_label: str, cache: PlanCache | None = None,
                     exact_screens: bool = False) -> tuple[PartitionModel | None, str]:
    """(ReCycle+'s PartitionModel, "") or (None, why this job cannot re-partition)."""
    from recycle.traces.repartition import QUICK_SCREEN_RULES, PartitionModel, partition_support

    why = partition_support(config)
    if not why and not period_label.startswith(("planner", "closed-form")):
        why = f"the period source {period_label!r} knows the configured layout only"
    if why:
        return None, why
    return PartitionModel(throughput, options, planner=not period_label.startswith("closed-form"), cache=cache,
                          screen_rules=None if exact_screens else QUICK_SCREEN_RULES), ""


def _build_systems(systems: Sequence[str], ctx: JobContext, throughput: ThroughputModel,
                   partitions: PartitionModel | None,
                   plus_throughput: ThroughputModel | None = None) -> list[SystemModel]:
    """One system model per name, in order (`partitions`: ReCycle+'s PartitionModel, when it is asked for;
    `plus_throughput`: ReCycle+'s own rates, when they differ from ReCycle's)."""

    def recycle_plus() -> SystemModel:
        from recycle.traces.repartition import ReCyclePlusSystem

        return ReCyclePlusSystem(ctx, plus_throughput or throughput, partitions)

    builders: dict[str, Callable[[], SystemModel]] = {
        "recycle": lambda: ReCycleSystem(ctx, throughput),
        "recycle-plus": recycle_plus,
        "fault-free": lambda: FaultFree(ctx),
        "fault-scaled": lambda: FaultScaled(ctx),
        "checkpoint-restart": lambda: CheckpointRestart(ctx),
        "oobleck": lambda: OobleckLike(ctx),
        "bamboo": lambda: BambooLike(ctx),
        "torchft-like": lambda: TorchftLike(ctx),
    }
    return [builders[name]() for name in systems]


# GPT-3 350M (24 layers, h = 1024, 16 heads, s = 2048, V = 50257) on the same A100 / 80 Gbps cluster, D=6, S=4,
# derived with the formulas of configs/gpt3-6.7b-a100.toml (150 TFLOP/s achieved, micro-batch 2 x 2048 tokens,
# 16 B of weights + grads + Adam state per parameter, 34 s b h activation bytes per layer, LM head on stage 3).
# Used to give the Bamboo-like model a model that fits with its redundant copy (the paper's 350M panel).
#   stage params = [129,137,664, 75,577,344, 75,577,344, 127,042,560]
GPT3_350M_LIKE = {
    "name": "gpt3-350m-like",
    "time_unit": "us",
    "topology": {"num_replicas": 6, "num_stages": 4},
    "workload": {"num_microbatches": 8, "microbatch_size": 2, "seq_len": 2048},
    "costs": {"forward": [5497.0, 5497.0, 5497.0, 8308.0], "backward_input": [6872.0, 6872.0, 6872.0, 9683.0],
              "backward_weight": [4123.0, 4123.0, 4123.0, 6934.0], "optimizer": [2260.0, 1323.0, 1323.0, 2223.0]},
    "memory": {"activation_bytes": [855638016, 855638016, 855638016, 2090754048], "capacity_bytes": 0,
               "parameter_bytes": [258275328, 151154688, 151154688, 254085120],
               "optimizer_state_bytes": [1549651968, 906928128, 906928128, 1524510720]},
    "communication": {"p2p_latency": 10.0, "p2p_bandwidth": 10000.0,
                      "activation_message_bytes": [8388608, 8388608, 8388608, 0], "allreduce_latency": 10.0,
                      "allreduce_bandwidth": 10000.0,
                      "gradient_bytes": [258275328, 151154688, 151154688, 254085120]},
}

# Llama 3 405B's layout (Llama 3 report: 16,384 H100s as TP 8 x PP 16 x DP 128), one worker = one 8-GPU TP group.
# ~25.3e9 parameters per stage; 1 sequence of 8,192 tokens per micro-batch, M = 16 (16M-token global batch);
# 2 FLOP per parameter per token for each of F, B and W at 400 TFLOP/s achieved per GPU (~40% MFU, as reported)
# -> 8 GPUs: 50.6e9 * 8192 / 3.2e15 s = 0.1296 s each. Optimizer: 28 B per parameter streamed per GPU at 2.6 TB/s
# -> 25.3e9 * 28 / 8 / 2.6e12 = 34 ms. State: bf16 weights 2 B + fp32 master and Adam 12 B per parameter, replicated
# per DP replica (ReCycle's assumption). Links: 8 x 400 Gb/s NICs per worker = 4e5 B/us. Attention FLOPs, TP
# communication and the embedding/head imbalance are ignored (uniform stages): a shape for failure accounting,
# not a performance model of Llama 3.
LLAMA3_405B_LIKE = {
    "name": "llama3-405b-like-16k",
    "time_unit": "us",
    "topology": {"num_replicas": 128, "num_stages": 16, "gpus_per_worker": 8},
    "workload": {"num_microbatches": 16, "microbatch_size": 1, "seq_len": 8192},
    "costs": {"forward": 129600.0, "backward_input": 129600.0, "backward_weight": 129600.0, "optimizer": 34000.0},
    "memory": {"activation_bytes": 0, "capacity_bytes": 0, "parameter_bytes": 50_600_000_000,
               "optimizer_state_bytes": 303_600_000_000},
    "communication": {"p2p_latency": 10.0, "p2p_bandwidth": 400000.0, "activation_message_bytes": 268435456,
                      "allreduce_latency": 10.0, "allreduce_bandwidth": 400000.0,
                      "gradient_bytes": 50_600_000_000},
}


def named_config(name: str) -> Config:
    """The in-code configs above, parsed and validated like a TOML file."""
    from recycle.config import parse_config

    table = {"gpt3-350m-like": GPT3_350M_LIKE, "llama3-405b-like-16k": LLAMA3_405B_LIKE}
    if name not in table:
        raise ConfigError(f"no built-in config {name!r}; choose one of {sorted(table)}")
    raw = {k: (dict(v) if isinstance(v, dict) else v) for k, v in table[name].items()}
    return parse_config(raw, name=name, source=f"built-in:{name}")
