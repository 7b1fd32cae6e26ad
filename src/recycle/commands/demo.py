"""`recycle demo`: the walk-through `make demo` runs, as a list of sections that each print and write files."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from recycle.config import Config, load_config, uniform_config
from recycle.schedules.fault_free import build_schedule
from recycle.sim.simulator import simulate

__all__ = ["register", "run", "DemoContext", "Section", "SECTIONS", "toy_config", "fault_free_section"]


def toy_config() -> Config:
    """The paper's toy (configs/toy.toml) built in, so the demo runs from any folder: D=3, S=4, M=6, F=B=W=1, opt 3."""
    return uniform_config(3, 4, 6, forward=1, backward_input=1, backward_weight=1, optimizer=3, name="toy")


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
            result = simulate(plan, cfg, iterations=2, record=not staggered)
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


# The lead extends the demo by appending sections (planner, failure adaptation, a real training run).
SECTIONS: list[Section] = [
    Section("Fault-free schedules (two iterations each; Gantt charts of the coupled-optimizer runs)",
            fault_free_section),
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("demo", help="run the demo: tables on stdout, charts into --out",
                                   description="Walk through recycle on the paper's toy example.")
    parser.add_argument("--out", default="out/demo", help="folder for the charts (default out/demo)")
    parser.add_argument("--config", help="TOML config (default: the built-in toy, same as configs/toy.toml)")
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    config = load_config(args.config) if args.config else toy_config()
    ctx = DemoContext(out_dir=Path(args.out), config=config)
    ctx.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"recycle demo on {config.name!r}: D={config.num_replicas} S={config.num_stages} "
          f"M={config.num_microbatches} (time unit {config.time_unit})")
    for number, section in enumerate(SECTIONS, start=1):
        print(f"\n== {number}. {section.title}")
        section.run(ctx)
    print("\nfiles written:")
    for path in ctx.written:
        print(f"  {path}")
    return 0
