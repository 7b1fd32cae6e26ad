"""The public Python API: configs, plans, plan stores, simulation of a plan or a failure trace, and training."""

from __future__ import annotations

import math
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Callable, Iterable, Sequence

from recycle.config import Config, apply_overrides, config_from_dict, load_config
from recycle.errors import ConfigError, PlanError, RecycleError
from recycle.ir.plan import Plan

# Everything heavy (the planner, the simulator, torch through the runtime) is imported inside the function that
# needs it, so `import recycle` stays cheap.
if TYPE_CHECKING:
    from recycle.ir.provider import PlanProvider
    from recycle.planner.options import PlannerOptions
    from recycle.planner.provider import PlanLibrary
    from recycle.planner.store import PlanStore
    from recycle.runtime.control.launcher import TrainResult
    from recycle.runtime.options import LaunchOptions
    from recycle.runtime.worker.emulation import Emulation
    from recycle.sim.simulator import SimResult
    from recycle.traces.jobsim import JobResult
    from recycle.traces.model import JobCosts
    from recycle.traces.trace import EventTrace

__all__ = ["load_config", "config_from_dict", "apply_overrides", "Config", "Plan", "planner_options", "plan",
           "schedule", "plan_store", "load_plan_store", "read_plan", "pipelining_csv", "simulate", "load_trace",
           "simulate_trace", "select_plan", "train", "factory_name", "RecycleError"]

Worker = tuple[int, int]


def _workers(config: Config, failed: Iterable[Worker | str]) -> list[Worker]:
    from recycle.planner.failures import parse_worker

    out = []
    for w in failed:
        if isinstance(w, str):
            out.append(parse_worker(w, config.num_replicas, config.num_stages))
        else:
            out.append(parse_worker(f"{w[0]}:{w[1]}", config.num_replicas, config.num_stages))
    return out


def planner_options(config: Config, *, decoupled: bool = True, staggered: bool = True,
                    memory_cap: str | int | None = None, search: bool = True,
                    split_microbatches: bool = False) -> PlannerOptions:
    """Planner options; `memory_cap` is N live micro-batches per worker, '1f1b' or None (the config's budget);
    `split_microbatches`: also try plans that cut micro-batches into pieces (recycle.planner.split)."""
    from recycle.planner.api import resolve_memory_cap
    from recycle.planner.options import PlannerOptions

    return PlannerOptions(decoupled=decoupled, staggered=staggered, memory_cap=resolve_memory_cap(config, memory_cap),
                          search=search, split_microbatches=split_microbatches)


def plan(config: Config, failed: Iterable[Worker | str] = (), *, options: PlannerOptions | None = None,
         solver: str = "heuristic", time_limit: float = 10.0, routing: str = "traffic") -> Plan:
    """The adaptive plan for `failed` workers, given as (replica, stage) pairs or "R:S" strings: the failed workers'
    micro-batches re-routed to the surviving replicas of their stage, every worker scheduled. `solver` is
    "heuristic" (milliseconds) or "exact" (CP-SAT, up to `time_limit` seconds). With no failures it is the
    planner's own fault-free plan."""
    from recycle.planner.api import make_plan
    from recycle.planner.failures import normalize

    workers = _workers(config, failed)
    normalize(workers, config.num_replicas, config.num_stages)  # a stage without survivors fails here, clearly
    return make_plan(config, workers, options if options is not None else planner_options(config), solver,
                     time_limit, routing)


def schedule(config: Config, name: str = "1f1b", *, staggered: bool = False) -> Plan:
    """A fault-free schedule as a plan: gpipe, 1f1b, 1f1b-decoupled or zb-h1."""
    from recycle.schedules.fault_free import build_schedule

    return build_schedule(config, name, staggered=staggered)


def plan_store(config: Config, max_failures: int, out: str | Path, *, options: PlannerOptions | None = None,
               solver: str = "heuristic", time_limit: float = 10.0, jobs: int = 1,
               progress: IO[str] | None = None) -> Path:
    """Precompute the plan of every normalized failure state with at most `max_failures` failures into the folder
    `out`; returns the path of its index."""
    from recycle.planner.store import build_store

    return Path(build_store(config, max_failures, out, options if options is not None else planner_options(config),
                            solver, time_limit, jobs, progress=progress))


def load_plan_store(directory: str | Path, config: Config) -> PlanStore:
    """Open a plan store made for `config`; `.lookup(failed_workers)` gives the plan on the real ranks."""
    from recycle.planner.store import PlanStore

    return PlanStore.load(directory, config)


def read_plan(path: str | Path) -> Plan:
    """A plan JSON file written by `plan.to_json()` (`recycle plan --save`)."""
    from recycle.ir import read_plan as read

    return read(str(path), "plan file")


def pipelining_csv(plan: Plan, replica: int = 0) -> str:
    """Replica `replica`'s pipeline of `plan` as torch.distributed.pipelining's compute-only schedule CSV (what
    `_PipelineScheduleRuntime._load_csv` reads). Raises PlanError for what the format cannot express: a replica with
    a failed worker or in cross-pipeline re-routing. The optimizer step is left out (recycle.ir.pipelining)."""
    from recycle.ir.pipelining import pipelining_csv as export

    return export(plan, replica)


def simulate(plan: Plan, config: Config, *, iterations: int | None = None, record: bool = False) -> SimResult:
    """Time `plan` on `config`'s costs: period (steady-state time per iteration), makespan, bubbles, peak memory
    (`record=True` keeps the per-action timeline for Gantt charts)."""
    from recycle.sim.simulator import simulate as run

    return run(plan, config, iterations=iterations, record=record)


def load_trace(config: Config, path: str | Path | None = None, *, generate: str = "", seed: int = 0,
               placement: str = "random", gpus_per_node: int = 1, replicas: str = "keep",
               strict: bool = False) -> EventTrace:
    """A failure trace for the job: read from a CSV `path`, or generated from a spec such as 'paper-gcp'.
    Availability traces (live counts) are placed onto the job's workers by `placement` with `seed`."""
    from recycle.traces.experiments import JobSetup, job_grid
    from recycle.traces.generate import parse_generate_spec
    from recycle.traces.reader import read_trace

    if (path is None) == (not generate):
        raise ConfigError("a trace needs exactly one of a CSV path (--trace) and a generator spec (--generate, e.g. "
                          "'paper-gcp'); pass one")
    JobSetup(gpus_per_node=gpus_per_node)  # checks its range
    grid = job_grid(config, gpus_per_node, replicas)
    if generate:
        return parse_generate_spec(generate, grid=grid, placement=placement, seed=seed)
    return read_trace(str(path), strict=strict, seed=seed, placement=placement, grid=grid)


def simulate_trace(config: Config, trace: str | Path | EventTrace, *, systems: Sequence[str] | None = None,
                   gpus_per_node: int = 1, replicas: str = "keep", slot_seconds: float = 1.0,
                   period_model: str = "auto", reference: str = "1f1b", costs: JobCosts | None = None,
                   progress: Callable[[str], None] | None = None,
                   plan_cache: str | Path | None = None, split_microbatches: bool = False,
                   exact_screens: bool = False) -> JobResult:
    """Replay a failure trace (a CSV path, or one from load_trace) over the job for ReCycle and the baseline models
    (fault-free, fault-scaled, checkpoint-restart, Oobleck-like, Bamboo-like, torchft-like); `costs` holds detection,
    restart and checkpoint times. The result's `.runs` hold each system's goodput and throughput timeline. Each plan
    is made once per call; `plan_cache` (a folder, e.g. `recycle.traces.plan_cache.default_cache_dir()`) also keeps
    them across calls, validated when read. `split_microbatches`: ReCycle+ may cut a failed worker's micro-batches
    into pieces (where strictly faster); ReCycle keeps whole ones. `exact_screens`: ReCycle+ screens partitions
    with every priority rule (slower; by default the first two rules: docs/traces.md, "Quick partition screens")."""
    from recycle.traces.experiments import SYSTEM_NAMES, JobSetup, run_job
    from recycle.traces.model import JobCosts
    from recycle.traces.plan_cache import PlanCache

    events = trace if not isinstance(trace, (str, Path)) else load_trace(
        config, trace, gpus_per_node=gpus_per_node, replicas=replicas)
    setup = JobSetup(gpus_per_node=gpus_per_node, replicas=replicas, slot_seconds=slot_seconds,
                     period_model=period_model, reference=reference)
    return run_job(config, events, systems=tuple(systems) if systems else SYSTEM_NAMES,
                   costs=costs if costs is not None else JobCosts(), setup=setup, progress=progress,
                   plan_cache=PlanCache(plan_cache, progress=progress), split_microbatches=split_microbatches,
                   exact_screens=exact_screens)


def select_plan(config: Config, schedule: str | None = None, plan_file: str | None = None,
                down: Iterable[Worker | str] = (), decoupled: bool = True, staggered: bool = True,
                split_microbatches: bool = False) -> Plan:
    """The plan a training run starts on: a plan file, the adaptive plan for workers `down` from the start, or a
    fault-free schedule (default zb-h1, or 1f1b when not decoupled; with several chunks per worker the chunked
    planner's fault-free plan, e.g. the V-shape zero bubble)."""
    failed = frozenset(_workers(config, down))
    if plan_file:
        from recycle.ir import read_plan as read

        loaded = read(plan_file, "--plan")
        if failed and loaded.failed != failed:
            raise PlanError(f"--plan {plan_file!r} is for failed workers {sorted(loaded.failed)} but --down names "
                            f"{sorted(failed)}; drop --down or pass the plan for that failure state")
        return loaded
    if failed or (config.topology.chunks_per_worker > 1 and not schedule):
        if schedule:
            raise ConfigError("--schedule names a fault-free schedule; with --down the planner makes the plan, so "
                              "drop --schedule")
        from recycle.planner.api import make_plan
        from recycle.planner.options import PlannerOptions

        return make_plan(config, failed, options=PlannerOptions(decoupled=decoupled, staggered=staggered,
                                                                split_microbatches=split_microbatches),
                         solver="heuristic")
    from recycle.schedules.fault_free import build_schedule

    return build_schedule(config, schedule or ("zb-h1" if decoupled else "1f1b"), staggered=staggered)


def check_runtime_split(config: Config, plan: Plan | None = None, *, split_microbatches: bool = False,
                        model_factory: str = "", repartition: bool = False) -> None:
    """What `recycle train` cannot run with micro-batches split into pieces (a split plan, or
    --split-microbatches for the plans it switches to), refused before anything starts: dropout (a piece draws its
    own mask), models other than the built-in GPT, tensor parallelism, several chunks per worker and layer
    re-partitioning. (A `--redo lost`
    recovery of a split plan redoes the whole iteration: completions track whole micro-batches.)"""
    if not (split_microbatches or (plan is not None and plan.pieces)):
        return
    what = "--split-microbatches" if split_microbatches else "a plan that splits micro-batches into pieces"
    if config.model.dropout > 0:
        # Dropout is seeded per (iteration, micro-batch id, stage): a piece's mask is drawn for its own id, so the
        # pieces together would not apply the whole micro-batch's mask (not the reference's maths).
        raise ConfigError(f"{what} cannot run with [model] dropout = {config.model.dropout:g}: a piece draws its own "
                          "dropout mask, so a split micro-batch would not train as the whole one does; set [model] "
                          "dropout = 0 or drop --split-microbatches")
    unsupported = [
        (bool(model_factory), f"--model-factory {model_factory!r}: pieces are cut for the built-in GPT only"),
        (bool(config.model.hf_config), f"[model] hf_config = {config.model.hf_config!r}: pieces are cut for the "
                                       "built-in GPT only"),
        (config.topology.gpus_per_worker > 1, f"[topology] gpus_per_worker = {config.topology.gpus_per_worker}: "
                                              "tensor-parallel workers run whole micro-batches"),
        (config.topology.chunks_per_worker > 1, f"[topology] chunks_per_worker = "
                                                f"{config.topology.chunks_per_worker}: chunked plans run whole "
                                                "micro-batches"),
        (repartition, "--repartition: re-partitioned plans run whole micro-batches"),
    ]
    _refuse_unsupported(what, unsupported, "drop that option, or plan without --split-microbatches")


def _refuse_unsupported(what: str, unsupported: Sequence[tuple[bool, str]], fix: str) -> None:
    """ConfigError for the first (refused, why) that is refused: "`what` cannot run with `why`; `fix`"."""
    for refused, why in unsupported:
        if refused:
            raise ConfigError(f"{what} cannot run with {why}; {fix}")


def check_runtime_chunks(config: Config, plan: Plan | None = None, *, model_factory: str = "",
                         repartition: bool = False, chaos: bool = False) -> None:
    """What `recycle train` cannot run with several chunks per worker ([topology] chunks_per_worker > 1), refused
    before anything starts: a plan for another number of chunks, models other than the built-in GPT, tensor
    parallelism, layer re-partitioning and --chaos soaks."""
    chunks, layout = config.topology.chunks_per_worker, config.topology.chunk_layout
    if plan is not None and (plan.chunks, plan.chunk_layout if plan.chunks > 1 else "") != \
            (chunks, layout if chunks > 1 else ""):
        has = f"{plan.chunks} chunks per worker ({plan.chunk_layout} layout)" if plan.chunks > 1 else \
            "1 chunk per worker"
        raise ConfigError(f"the plan has {has} but the config has [topology] chunks_per_worker = {chunks}"
                          + (f", chunk_layout = {layout!r}" if chunks > 1 else "") + "; make the plan from this "
                          "config, or train with the config the plan was made from (--set "
                          f"topology.chunks_per_worker={plan.chunks})")
    if chunks == 1:
        return
    what = f"[topology] chunks_per_worker = {chunks} (several model chunks per worker)"
    unsupported = [
        (bool(model_factory), f"--model-factory {model_factory!r}: chunks are cut from the built-in GPT only"),
        (bool(config.model.hf_config), f"[model] hf_config = {config.model.hf_config!r}: chunks are cut from the "
                                       "built-in GPT only"),
        (config.topology.gpus_per_worker > 1, f"[topology] gpus_per_worker = {config.topology.gpus_per_worker}: "
                                              "tensor parallelism runs one stage per worker"),
        (repartition, "--repartition: layer migration moves whole stages"),
        (chaos, "--chaos: random hangs, kills and repairs are not tested with chunks"),
    ]
    _refuse_unsupported(what, unsupported, "drop that option, or set chunks_per_worker = 1 to train with it")
    from recycle.models.chunk_set import chunk_layers

    chunk_layers(config.model, config.workload.seq_len, config.num_stages, chunks)  # every chunk has a layer


def train(config: Config, plan: Plan | None = None, *, schedule: str | None = None, down: Iterable[Worker | str] = (),
          decoupled: bool = True, staggered: bool = True, recover: bool = True, max_failures: int = 2,
          plan_store: str | Path = "", store_progress: IO[str] | None = None, repartition: bool = False,
          repartition_prior_s: float = 1800.0, launch_options: LaunchOptions | None = None,
          data_source: str | Callable[..., Any] | None = None, split_microbatches: bool = False,
          **options: Any) -> TrainResult:
    """Train `config`'s model on D x S worker processes and return the TrainResult (per-step metrics, recoveries).

    The run starts on `plan`, or on `select_plan(config, schedule, down=down, ...)`. With `recover` (the default) a
    worker failure switches to the plan for the new failure state: from `plan_store` (a folder from plan_store()) or
    from a store built now for up to `max_failures` failures (heuristic beyond). `options` are the launch options by
    their flat names, runtime.options.KEYWORDS (steps, save_path, metrics_path, model_factory, checkpoint_dir,
    timeout_s, ...), set on top of `launch_options` (a whole runtime.options.LaunchOptions). The steps' grad_norm is
    computed when clipping, with metrics_path or a sink, or with grad_norm=True (else it is None). `repartition`:
    failure states may also move whole layers between stages when the planner finds a faster layer partition that
    repays its migration over the state's expected duration (`repartition_prior_s` before any change has been seen;
    built-in GPT only; see planner.provider.RepartitioningProvider). `model_factory` may be a function (config,
    num_stages) -> stages (see recycle.models.split) defined at the top level of an importable module or of the
    script being run: every worker process imports it by name. `data_source` (the same as [training] data_source)
    may be such a function (config) -> source, or its 'module:function' name: source(iteration, mb) returns (inputs,
    targets) (see recycle.data.DataSource). `split_microbatches`: the planner may cut a failed worker's
    micro-batches into pieces where that is faster (recycle.planner.split), for the start plan and the plans the run
    switches to.
    """
    from dataclasses import replace

    from recycle.runtime.control.launcher import launch
    from recycle.runtime.options import KEYWORDS, LaunchOptions, with_keywords

    unknown = sorted(set(options) - set(KEYWORDS))
    if unknown:
        raise ConfigError(f"train() got unknown option(s) {unknown}; known: {', '.join(sorted(KEYWORDS))}")
    if data_source is not None:
        config = _with_data_source(config, data_source)
    factory = options.get("model_factory")
    if callable(factory):
        options["model_factory"] = factory_name(factory)
    if plan is None:
        plan = select_plan(config, schedule, None, down, decoupled, staggered, split_microbatches)
    elif schedule or tuple(down):
        raise ConfigError("train() takes a plan or schedule=/down=, not both; drop one")
    launch_opts = with_keywords(launch_options or LaunchOptions(), options)
    check_runtime_chunks(config, plan, model_factory=launch_opts.model_factory, repartition=repartition,
                         chaos=launch_opts.faults.chaos is not None)
    check_runtime_split(config, plan, split_microbatches=split_microbatches, model_factory=launch_opts.model_factory,
                        repartition=repartition)
    if repartition and (launch_opts.model_factory or config.model.hf_config):
        raise ConfigError("--repartition moves layers of the built-in GPT between stages; a --model-factory or --hf "
                          "model's split is fixed. Drop one of the two")
    if not (math.isfinite(repartition_prior_s) and repartition_prior_s > 0):
        raise ConfigError(f"--repartition-prior-s {repartition_prior_s} must be a positive number of seconds (the "
                          "expected length of a failure state, e.g. 1800)")
    if repartition and not (recover and launch_opts.plan_provider is None):
        raise ConfigError("repartition=True needs recover=True and no plan_provider of your own: it changes the plans "
                          "the run switches to")
    if recover and launch_opts.plan_provider is None:
        from recycle.planner.options import PlannerOptions  # the API may use the planner; the runtime may not
        from recycle.planner.provider import RepartitioningProvider

        planner_opts = PlannerOptions(decoupled=decoupled, staggered=staggered, split_microbatches=split_microbatches)
        provider: PlanProvider = _plan_library(config, planner_opts, max_failures, plan_store, store_progress)
        if repartition:
            provider = RepartitioningProvider(config, planner_opts, provider, prior_s=repartition_prior_s,
                                              seconds_per_unit=_seconds_per_unit(config, launch_opts.debug.emulation))
        launch_opts = replace(launch_opts, plan_provider=provider)
    return launch(config, plan, launch_opts)


def _plan_library(config: Config, options: PlannerOptions, max_failures: int, plan_store: str | Path,
                  progress: IO[str] | None) -> PlanLibrary:
    """The plans a recovering run switches to: loaded from `plan_store`, or built now for `max_failures`."""
    from recycle.planner.provider import PlanLibrary

    if max_failures < 0:
        raise ConfigError(f"--max-failures {max_failures} must be >= 0 (0: plan every failure when it happens)")
    if plan_store:
        return PlanLibrary.load(plan_store, config)
    return PlanLibrary.build(config, options, max_failures, progress=progress)


def _seconds_per_unit(config: Config, emulation: Emulation | None) -> float | None:
    """Seconds per config time unit of a run: as paced (--emulate-costs), else microseconds as given; None for
    abstract slots that nothing paces."""
    from recycle.runtime.worker.emulation import pacing_seconds_per_unit

    if emulation is not None:
        return pacing_seconds_per_unit(config, emulation)
    return 1e-6 if config.time_unit == "us" else None


def _with_data_source(config: Config, data_source: str | Callable[..., Any]) -> Config:
    """The config with [training] data_source set (checked as in a TOML file)."""
    import json

    from recycle.config import parse_config
    from recycle.data.source import source_name

    name = data_source if isinstance(data_source, str) else source_name(data_source)
    raw = apply_overrides(config.to_dict(), [f"training.data_source={json.dumps(name)}"])
    return parse_config(raw, name=config.name, source=config.source)


def factory_name(factory: Callable[..., Any]) -> str:
    """'module:function' for a model factory function, the form worker processes import it by."""
    module, name = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or not name or "<" in name or "." in name:
        raise ConfigError(f"model factory {factory!r} must be a function defined at the top level of a module (workers "
                          "import it by name); a lambda, a nested function or a method cannot be imported")
    return f"{module}:{name}"
