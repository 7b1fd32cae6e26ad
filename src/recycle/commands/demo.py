"""`recycle demo`: the walk-through `make demo` runs, as a list of sections that each print and write files."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from recycle.config import Config, load_config, uniform_config
from recycle.errors import ConfigError
from recycle.ir.worker import workers_text
from recycle.schedules.fault_free import build_schedule
from recycle.sim.simulator import simulate

__all__ = ["register", "run", "DemoContext", "Section", "SECTIONS", "toy_config", "fault_free_section"]


def toy_config() -> Config:
    """The paper's toy (configs/toy.toml) built in, so the demo runs from any folder: D=3, S=4, M=6, F=B=W=1, opt 3."""
    return uniform_config(3, 4, 6, forward=1, backward_input=1, backward_weight=1, optimizer=3, name="toy")


_REPO = Path(__file__).resolve().parents[3]


def _repo_config(name: str) -> Config | None:
    """A config shipped in the checkout's configs/ folder, or None (with a note) when the demo runs elsewhere."""
    path = _REPO / "configs" / name
    if not path.is_file():
        print(f"{path} not found (run the demo from a checkout); section skipped")
        return None
    return load_config(path)


@dataclass
class DemoContext:
    """What every section gets: the output folder, the config, and a record of the files written."""

    out_dir: Path
    config: Config
    written: list[Path] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)  # numbers a later section may reuse, keyed by section


@dataclass(frozen=True)
class Section:
    title: str
    run: Callable[[DemoContext], None]


def fault_free_section(ctx: DemoContext) -> None:
    """Time the config under every fault-free schedule (coupled and staggered optimizer); a Gantt PNG for each."""
    from recycle.report.gantt import write_gantt

    cfg = ctx.config
    names = ["gpipe", "1f1b", "1f1b-decoupled", "zb-h1"]
    header = f"{'schedule':<16}{'optimizer':<11}{'makespan':>9}{'period':>8}{'bubble':>8}  peak activations/stage"
    print(header)
    print("-" * len(header))
    table = {}
    for name in names:
        for staggered in (False, True):
            plan = build_schedule(cfg, name, staggered=staggered)
            result = simulate(plan, cfg, record=not staggered)
            S = plan.num_stages
            peaks = "/".join(str(max(result.peak_activations[r] for r in range(s, plan.num_workers, S)))
                             for s in range(S))
            mode = "staggered" if staggered else "coupled"
            print(f"{name:<16}{mode:<11}{result.makespan:>9g}{result.period:>8g}{result.bubble_fraction:>8.3f}  "
                  f"{peaks}")
            table[(name, mode)] = result
            if not staggered:
                path = ctx.out_dir / f"gantt-{cfg.name}-{name}.png"
                title = (f"{cfg.name}: {name}; period {result.period:g}, makespan {result.makespan:g} "
                         f"{cfg.time_unit}, bubble {result.bubble_fraction:.0%}")
                ctx.written.append(write_gantt(result, plan, path, title=title, time_unit=cfg.time_unit))
    ctx.results["fault_free"] = table


def _stage_peaks(plan: Any, peaks: tuple[int, ...]) -> str:
    """Peak live micro-batches per stage (max over that stage's live replicas), e.g. '4/3/2/1'."""
    S = plan.num_stages
    return "/".join(str(max(peaks[r] for r in range(s, plan.num_workers, S))) for s in range(S))


def adaptation_section(ctx: DemoContext) -> None:
    """The paper's ladder: one worker down, each ReCycle technique added in turn (heuristic and exact planner)."""
    from recycle.planner.api import baseline_1f1b_period, make_plan, resolve_memory_cap
    from recycle.planner.options import PlannerOptions
    from recycle.report.gantt import write_gantt

    cfg = ctx.config
    failed = [(min(1, cfg.num_replicas - 1), min(2, cfg.num_stages - 1))]
    if cfg.num_replicas < 2:
        print("needs at least two replicas; skipped")
        return
    cap = resolve_memory_cap(cfg, "1f1b")
    ladder = [
        ("coupled backward + optimizer, 1F1B memory cap", PlannerOptions(False, False, cap)),
        ("coupled backward + optimizer, no cap", PlannerOptions(False, False, None)),
        ("+ decoupled backprop, no cap", PlannerOptions(True, False, None)),
        ("+ staggered optimizer, no cap", PlannerOptions(True, True, None)),
    ]
    fault_free = baseline_1f1b_period(cfg)
    print(f"worker {failed[0][0]}:{failed[0][1]} down; fault-free 1F1B period {fault_free:g}")
    header = (f"{'plan':<48}{'solver':<10}{'period':>8}{'[makespan]':>11}{'slowdown':>9}{'bound':>8}  "
              f"{'status':<9} peak/stage")
    print(header)
    print("-" * len(header))
    rows = []
    for label, options in ladder:
        solvers = ["heuristic"] if options.memory_cap else ["heuristic", "exact"]
        for solver in solvers:
            plan = make_plan(cfg, failed, options, solver=solver, time_limit_s=10.0)
            result = simulate(plan, cfg, record=True)
            rows.append((label, solver, result.period))
            print(f"{label:<48}{solver:<10}{result.period:>8g}{'[' + format(result.makespan, 'g') + ']':>11}"
                  f"{result.period / fault_free:>9.3f}{plan.meta.lower_bound or 0:>8g}  {plan.meta.status:<9} "
                  f"{_stage_peaks(plan, result.peak_activations)}")
            if solver == "heuristic":
                slug = label.split(",")[0].replace("+ ", "").replace(" ", "-")
                path = ctx.out_dir / f"gantt-{cfg.name}-down-{slug}-{'cap' if options.memory_cap else 'nocap'}.png"
                title = f"{cfg.name}, {failed[0][0]}:{failed[0][1]} down: {label}; period {result.period:g}"
                ctx.written.append(write_gantt(result, plan, path, title=title, time_unit=cfg.time_unit))
    ctx.results["adaptation"] = rows


def degradation_section(ctx: DemoContext) -> None:
    """GPT-3 6.7B on 24 A100s (D=6, S=4): throughput as workers fail, against the fault-scaled line."""
    from recycle.planner.api import baseline_1f1b_period, make_plan
    from recycle.planner.options import PlannerOptions

    cfg = _repo_config("gpt3-6.7b-a100.toml")
    if cfg is None:
        return
    D, S = cfg.num_replicas, cfg.num_stages
    fault_free = baseline_1f1b_period(cfg)
    print(f"{cfg.name}: D={D} S={S} M={cfg.num_microbatches}; throughput relative to fault-free 1F1B")
    print(f"{'failed':>6}  {'workers down':<28}{'period (s)':>11}{'throughput':>11}{'fault-scaled':>13}")
    order = [(s % D, s % S) for s in range(S)] + [(D - 1, 0), (D - 2, 1)]
    for k in range(0, min(len(order), D * S - 1) + 1):
        failed = order[:k]
        plan = make_plan(cfg, failed, PlannerOptions())
        period = plan.meta.predicted_period
        scale = 1e6 if cfg.time_unit == "us" else 1.0
        down = workers_text(failed) or "-"
        print(f"{k:>6}  {down:<28}{period / scale:>11.3f}{fault_free / period:>11.3f}{1 - k / (D * S):>13.3f}")


def training_section(ctx: DemoContext) -> None:
    """A real run on gloo: the tiny GPT fault-free and with a worker down from the start reach the same weights."""
    import torch

    from recycle.commands.train import select_plan
    from recycle.runtime.control.launcher import launch
    from recycle.runtime.options import ClusterOptions, LaunchOptions, OutputOptions

    cfg = _repo_config("tiny-gpt.toml")
    if cfg is None:
        return
    saved = {}
    for label, down in (("fault-free 1F1B", []), ("worker 1:1 down, adaptive plan", ["1:1"])):
        plan = select_plan(cfg, None if down else "1f1b", None, down, decoupled=True, staggered=True)
        out = ctx.out_dir / f"train-{'down' if down else 'fault-free'}.pt"
        print(f"-- {label}: {len(plan.live_ranks())} processes")
        launch(cfg, plan, LaunchOptions(steps=3, outputs=OutputOptions(save_path=str(out)),
                                        cluster=ClusterOptions(start_method="forkserver")))
        saved[label] = torch.load(out, weights_only=True)["model"]
        ctx.written.append(out)
    a, b = saved.values()
    worst = max(float(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30))) for k in a)
    print(f"largest relative parameter difference after 3 steps: {worst:.2e} (float32; summation order only)")


def live_failure_section(ctx: DemoContext) -> None:
    """A real SIGKILL mid-step: the survivors re-route the dead worker's micro-batches on the plan from the store and
    finish with the fault-free run's weights (float64, so only summation order differs)."""
    import torch

    from recycle.config import parse_config
    from recycle.planner.options import PlannerOptions
    from recycle.planner.provider import PlanLibrary
    from recycle.runtime.control.launcher import launch
    from recycle.runtime.options import ClusterOptions, FaultOptions, LaunchOptions, OutputOptions
    from recycle.runtime.tools.faults import parse_fault

    tiny = _repo_config("tiny-gpt.toml")
    if tiny is None:
        return
    data = tiny.to_dict()
    data["training"] = {**data["training"], "dtype": "float64", "steps": 6}
    cfg = parse_config(data, name="tiny-gpt-float64")
    plan = build_schedule(cfg, "zb-h1", staggered=True)
    provider = PlanLibrary.build(cfg, PlannerOptions(), max_failures=2)
    (replica, stage), fault = parse_fault("kill:1:1@3.5", cfg.num_replicas, cfg.num_stages)
    saved = {}
    for label, faults in (("fault-free", ()), ("worker 1:1 SIGKILLed before action 5 of step 3", (
            (replica * cfg.num_stages + stage, fault),))):
        out = ctx.out_dir / f"live-{'killed' if faults else 'fault-free'}.pt"
        print(f"-- {label}")
        result = launch(cfg, plan, LaunchOptions(outputs=OutputOptions(save_path=str(out)),
                                                 cluster=ClusterOptions(start_method="forkserver"),
                                                 faults=FaultOptions(injections=faults), plan_provider=provider))
        saved[label] = torch.load(out, weights_only=True)["model"]
        ctx.written.append(out)
        if result.recoveries:
            r = result.recoveries[0]
            print(f"survived: training resumed {r.resumed_s:.2f} s after the kill; {r.redone_actions} actions redone; "
                  f"workers down at the end: {workers_text(result.failed)}")
    a, b = saved.values()
    worst = max(float(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-30))) for k in a)
    print(f"largest relative parameter difference, killed run vs fault-free run: {worst:.1e} (float64)")


def trace_section(ctx: DemoContext) -> None:
    """Replay a trace shaped like the paper's GCP trace (24 workers dipping to 15) for ReCycle and the baselines."""
    from recycle.cli import build_parser

    cfg = _repo_config("gpt3-6.7b-a100.toml")
    if cfg is None:
        return
    out = ctx.out_dir / "trace"
    # Same code path and defaults as `recycle simulate` (failures spread over stages; see docs/traces.md).
    # ReCycle+ (layer re-partitioning) is left out to keep the demo at ~20 s: benchmarks/bench_repartition.py.
    from recycle.traces.experiments import SYSTEM_NAMES

    systems = [s for s in SYSTEM_NAMES if s != "recycle-plus"]
    args = build_parser().parse_args(["simulate", "--config", cfg.source, "--generate", "paper-gcp",
                                      "--placement", "spread", "--out", str(out), "--systems", *systems])
    args.func(args)
    ctx.written += [out / "report.md", out / "throughput.png", out / "summary.json"]


SECTIONS: list[Section] = [
    Section("Fault-free schedules (settled period; Gantt charts of the coupled-optimizer runs)", fault_free_section),
    Section("Pipeline adaptation: one worker down, ReCycle's techniques added one by one", adaptation_section),
    Section("Graceful degradation: GPT-3 6.7B, D=6 x S=4, failures spread over stages", degradation_section),
    Section("Real training on torch.distributed (gloo): same model with a worker down", training_section),
    Section("A live failure: a worker is SIGKILLed mid-step and training goes on", live_failure_section),
    Section("Trace replay: GPT-3 6.7B over a trace shaped like the paper's (models of the baselines)", trace_section),
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("demo", help="run the demo: tables on stdout, charts into --out",
                                   description="Walk through recycle on the paper's toy example.")
    parser.add_argument("--out", default="out/demo", help="folder for the charts (default out/demo)")
    parser.add_argument("--config", help="TOML config (default: the built-in toy, same as configs/toy.toml)")
    parser.add_argument("--only", default="", metavar="N[,N...]",
                        help=f"run only these sections (1..{len(SECTIONS)}); default all")
    parser.set_defaults(func=run)
    return parser


def _selected(spec: str) -> list[int]:
    if not spec.strip():
        return list(range(1, len(SECTIONS) + 1))
    try:
        chosen = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        chosen = []
    if not chosen or any(not 1 <= n <= len(SECTIONS) for n in chosen):
        raise ConfigError(f"--only {spec!r} must list section numbers between 1 and {len(SECTIONS)}, e.g. --only 1,2")
    return chosen


def run(args: argparse.Namespace) -> int:
    chosen = _selected(args.only)
    config = load_config(args.config) if args.config else toy_config()
    ctx = DemoContext(out_dir=Path(args.out), config=config)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"recycle demo on {config.name!r}: D={config.num_replicas} S={config.num_stages} "
          f"M={config.num_microbatches} (time unit {config.time_unit})")
    from recycle.progress import progress_lines

    # The section headers are the plain progress lines; on a terminal a bar on stderr also counts the sections.
    with progress_lines("demo sections", total=len(chosen), echo=False) as report:
        for number, section in enumerate(SECTIONS, start=1):
            if number not in chosen:
                continue
            print(f"\n== {number}. {section.title}")
            section.run(ctx)
            report(f"{number}. {section.title}")
    print("\nfiles written:")
    for path in ctx.written:
        print(f"  {path}")
    return 0
