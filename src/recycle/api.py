"""The public Python API: configs, plans, plan stores, simulation of plans and traces, and training.

Everything the CLI does goes through these functions (the CLI only parses arguments). Heavy modules (torch, the
planner, OR-Tools) are imported when a function needs them, so `import recycle` stays cheap. docs/api.md is the
reference, tested as a doctest (tests/unit/test_api.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

from recycle.config import Config, apply_overrides, parse_config
from recycle.config import load_config as _load_config
from recycle.errors import ConfigError, PlanError

if TYPE_CHECKING:  # only for annotations: importing them here would pull in torch and the planner
    from recycle.ir.plan import Plan
    from recycle.planner.provider import PlanLibrary
    from recycle.runtime.launcher import LaunchOptions, TrainResult
    from recycle.sim.simulator import SimResult
    from recycle.traces.experiments import JobResult, JobSetup
    from recycle.traces.model import JobCosts

__all__ = ["load_config", "config_from_dict", "parse_workers", "plan", "fault_free_plan", "select_plan",
           "plan_store", "load_plan_store", "simulate", "simulate_trace", "train"]

Worker = tuple[int, int]


# -- configs ----------------------------------------------------------------------------------------------------------
def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """A validated config from a TOML file, with `section.key=value` overrides applied (as `--set`)."""
    return _load_config(path, overrides)


def config_from_dict(raw: Mapping[str, Any], overrides: Sequence[str] = (), name: str | None = None) -> Config:
    """A validated config from a mapping shaped like the TOML file (sections as nested dicts)."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config_from_dict takes a mapping of sections, got {type(raw).__name__}")
    data = apply_overrides(dict(raw), overrides)
    return parse_config(data, name=name or str(data.get("name", "config")), source="")


def parse_workers(config: Config, workers: Iterable[Worker | str]) -> frozenset[Worker]:
    """(replica, stage) pairs or "R:S" strings, checked against the config's topology."""
    from recycle.planner.failures import parse_worker

    out = set()
    for worker in workers:
        text = worker if isinstance(worker, str) else "%s:%s" % tuple(worker)
        out.add(parse_worker(text, config.num_replicas, config.num_stages))
    return frozenset(out)


# -- plans ------------------------------------------------------------------------------------------------------------
def plan(config: Config, failed: Iterable[Worker | str] = (), *, solver: str = "heuristic",
         decoupled: bool = True, staggered: bool = True, routing: str = "traffic", time_limit_s: float = 10.0,
         search: bool = True) -> "Plan":
    """The adaptive plan for `failed` workers (none: the fault-free plan of the planner), on the real ranks."""
    from recycle.planner.api import make_plan
    from recycle.planner.options import PlannerOptions

    options = PlannerOptions(decoupled=decoupled, staggered=staggered, search=search)
    return make_plan(config, parse_workers(config, failed), options=options, solver=solver,
                     time_limit_s=time_limit_s, routing=routing)


def fault_free_plan(config: Config, schedule: str = "zb-h1", staggered: bool = True) -> "Plan":
    """A named fault-free schedule (gpipe, 1f1b, zb-h1) as a plan."""
    from recycle.schedules.fault_free import build_schedule

    return build_schedule(config, schedule, staggered=staggered)


def select_plan(config: Config, schedule: str | None = None, plan_file: str | None = None,
                down: Iterable[Worker | str] = (), decoupled: bool = True, staggered: bool = True) -> "Plan":
    """The plan a training run starts with: a plan file, the adaptive plan for workers already `down`, or a
    fault-free schedule (default zb-h1 when decoupled, else 1f1b)."""
    from recycle.ir.text import read_plan

    failed = parse_workers(config, down)
    if plan_file:
        loaded = read_plan(plan_file, "--plan")
        if failed and loaded.failed != failed:
            raise PlanError(f"--plan {plan_file!r} is for failed workers {sorted(loaded.failed)} but --down names "
                            f"{sorted(failed)}; drop --down or pass the plan for that failure state")
        return loaded
    if failed:
        if schedule:
            raise ConfigError("--schedule names a fault-free schedule; with --down the planner makes the plan, so "
                              "drop --schedule")
        return plan(config, failed, decoupled=decoupled, staggered=staggered)
    return fault_free_plan(config, schedule or ("zb-h1" if decoupled else "1f1b"), staggered=staggered)


def plan_store(config: Config, max_failures: int = 2, *, decoupled: bool = True, staggered: bool = True,
               progress: Any = None) -> "PlanLibrary":
    """Plans for every normalized failure state with up to `max_failures` failed workers, built now (a failure
    beyond them is planned by the heuristic when it happens). `progress`: a stream for progress lines."""
    from recycle.planner.options import PlannerOptions
    from recycle.planner.provider import PlanLibrary

    if max_failures < 0:
        raise ConfigError(f"max_failures = {max_failures} must be >= 0 (0: plan every failure when it happens)")
    return PlanLibrary.build(config, PlannerOptions(decoupled=decoupled, staggered=staggered), max_failures,
                             progress=progress)


def load_plan_store(directory: str | Path, config: Config) -> "PlanLibrary":
    """A plan store written by `recycle plan --max-failures F --out DIR`, checked against `config`."""
    from recycle.planner.provider import PlanLibrary

    return PlanLibrary.load(directory, config)


# -- simulation -------------------------------------------------------------------------------------------------------
def simulate(plan: "Plan", config: Config, iterations: int | None = None) -> "SimResult":
    """Time a plan in the discrete-event simulator (period, makespan, bubbles) with the config's costs."""
    from recycle.sim.simulator import simulate as _simulate

    return _simulate(plan, config, iterations=iterations)


def simulate_trace(config: Config, trace: str | Path | None = None, generate: str | None = None, *,
                   systems: Sequence[str] | None = None, costs: "JobCosts | None" = None,
                   setup: "JobSetup | None" = None, placement: str = "random", seed: int = 0,
                   strict: bool = False, progress: Callable[[str], None] | None = None) -> "JobResult":
    """Replay a failure trace over the job: ReCycle and the baseline models. Give a trace file (event or
    availability format, docs/traces.md) or a `generate` spec (e.g. "paper-gcp", "poisson:nodes=64,days=7")."""
    from recycle.traces.experiments import SYSTEM_NAMES, JobSetup, job_grid, run_job
    from recycle.traces.generate import parse_generate_spec
    from recycle.traces.model import JobCosts
    from recycle.traces.reader import read_trace

    if (trace is None) == (generate is None):
        raise ConfigError("simulate_trace needs exactly one of trace=PATH or generate=SPEC")
    setup = setup or JobSetup()
    grid = job_grid(config, setup.gpus_per_node, setup.replicas)
    if trace is not None:
        events = read_trace(trace, strict=strict, seed=seed, placement=placement, grid=grid)
    else:
        events = parse_generate_spec(str(generate), grid=grid, placement=placement, seed=seed)
    return run_job(config, events, systems=tuple(systems or SYSTEM_NAMES), costs=costs or JobCosts(), setup=setup,
                   progress=progress)


# -- training ---------------------------------------------------------------------------------------------------------
def train(config: Config, plan: "Plan | None" = None, options: "LaunchOptions | None" = None, *,
          recover: bool = True, max_failures: int = 2, plans: "PlanLibrary | None" = None,
          progress: Callable[[str], None] | None | str = "print", **launch_options: Any) -> "TrainResult":
    """Train the config's model on D x S worker processes (gloo on CPU, NCCL on CUDA) and return the result
    (steps, recoveries, workers down). `plan`: default the fault-free zb-h1 schedule. With `recover` (default) a
    failed worker is survived with plans from `plans` (default: a plan store for up to `max_failures`, built now).
    Launch settings come as `options` (runtime.launcher.LaunchOptions) or as its field names:
    `train(config, steps=20, checkpoint_dir="ckpt", save_path="model.pt")`. `progress`: a callable for progress
    lines (default: print them), None for silence."""
    from dataclasses import fields, replace

    from recycle.runtime.launcher import LaunchOptions, PlanChoice, launch

    base = options or (LaunchOptions() if progress == "print" else LaunchOptions(progress=progress))  # type: ignore
    known = {f.name for f in fields(LaunchOptions)}
    unknown = sorted(set(launch_options) - known)
    if unknown:
        raise ConfigError(f"train() got unknown option(s) {unknown}; LaunchOptions fields: {sorted(known)}")
    base = replace(base, **launch_options)
    if recover and base.plan_provider is None:
        library = plans or plan_store(config, max_failures, decoupled=True, staggered=True,
                                      progress=None if base.progress is None else sys.stdout)
        base = replace(base, plan_provider=library.provider(PlanChoice))
    return launch(config, plan or fault_free_plan(config), base)

