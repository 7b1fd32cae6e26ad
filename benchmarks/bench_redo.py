"""Work redone after a failure: survivors keep the interrupted iteration (--redo lost) against redoing it
(--redo iteration), over the kill matrix, side by side in one run on real gloo processes.

Run: .venv/bin/python benchmarks/bench_redo.py [--replicas 4 8] [--slot-ms 20] [--quick]

Job: the tiny GPT on D pipelines x S=2 stages, M=4 micro-batches, float32, ZB-H1 with the staggered optimizer, every
action paced to its config cost (`--emulate-costs --slot-ms MS`), 3 steps. The kill matrix: worker (D-1, s) is
SIGKILLed at the second step before its first F, B, W or its OPT, for each stage s. Each point runs under both
policies, alternating which goes first. Per run: the actions redone (work done before the failure and run again:
for --redo iteration, every survivor's finished actions of the iterations rolled back; for --redo lost, what the
survivors drop plus the dead worker's actions known to have finished, plus forwards and input-gradients a stage that
had stepped computes again), the dead worker's share of one iteration (its action count), the redone work's paced
seconds, and kill -> the interrupted step completed. Both runs end with the fault-free parameters (checked against
each other here; the tests check them against the single-process reference).

The last line is a JSON summary: per D, the median over the matrix of redone / share for each policy (the goal:
<= 2 with --redo lost) and of kill -> step completed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from recycle.config import Config, parse_config
from recycle.errors import RuntimeFailure
from recycle.ir import Kind, Plan
from recycle.planner.options import PlannerOptions
from recycle.planner.provider import PlanLibrary
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import (ClusterOptions, DebugOptions, FaultOptions, LaunchOptions, OutputOptions,
                                     RecoveryOptions)
from recycle.runtime.tools.faults import FaultInjection
from recycle.runtime.worker.emulate import Emulation
from recycle.schedules.fault_free import build_schedule

KILL_STEP = 1
POINTS = ("F", "B", "W", "OPT")


@dataclass(frozen=True)
class Row:
    D: int
    stage: int
    point: str
    policy: str
    redone: int
    share: int
    redone_s: float
    step_done_s: float  # kill -> the interrupted step completed
    kept: str


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def config_for(D: int) -> Config:
    return parse_config({
        "topology": {"num_replicas": D, "num_stages": 2},
        "workload": {"num_microbatches": 4, "microbatch_size": 2, "seq_len": 16},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"preset": "tiny"},
        "training": {"steps": 3, "lr": 0.01, "dtype": "float32", "seed": 5},
    }, name=f"redo-{D}x2")


def one_run(config: Config, plan: Plan, library: PlanLibrary, worker: tuple[int, int], index: int, policy: str,
            slot_ms: float, out: Path) -> tuple[Row, dict[str, torch.Tensor]]:
    save = out / f"{policy}.pt"
    options = LaunchOptions(
        steps=config.training.steps, recovery=RecoveryOptions(timeout_s=30.0, redo=policy),  # type: ignore[arg-type]
        cluster=ClusterOptions(start_method="forkserver"),
        faults=FaultOptions(injections=((plan.rank(*worker), FaultInjection(KILL_STEP, index)),)),
        debug=DebugOptions(emulation=Emulation(slot_ms, 1.0)), plan_provider=library.lookup, progress=None,
        outputs=OutputOptions(save_path=str(save)))
    try:
        result = launch(config, plan, options)
    except RuntimeFailure as exc:
        raise SystemExit(f"error: the run with --redo {policy} did not survive its kill: {exc}") from None
    (recovery,) = result.recoveries
    after = [s for s in result.steps if s.step >= recovery.step]
    share = len(plan.worker_actions(*worker))
    row = Row(config.num_replicas, worker[1], "", policy, recovery.redone_actions, share, recovery.redone_s,
              after[0].end_time - recovery.failure_time, recovery.kept)
    return row, torch.load(save, weights_only=True)["model"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[4, 8], metavar="D")
    parser.add_argument("--slot-ms", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="only the B and OPT kills of each stage")
    args = parser.parse_args()
    points = ("B", "OPT") if args.quick else POINTS
    rows: list[Row] = []
    began = time.time()
    for D in args.replicas:
        config = config_for(D)
        plan = build_schedule(config, "zb-h1", staggered=True)
        library = PlanLibrary.build(config, PlannerOptions(), max_failures=1)
        for stage in range(config.num_stages):
            for n, point in enumerate(points):
                worker = (D - 1, stage)
                kind = {"F": Kind.F, "B": Kind.B, "W": Kind.W, "OPT": Kind.OPT}[point]
                index = next(i for i, a in enumerate(plan.worker_actions(*worker)) if a.kind is kind)
                order = ("lost", "iteration") if (stage * len(points) + n) % 2 == 0 else ("iteration", "lost")
                params = {}
                with tempfile.TemporaryDirectory() as tmp:
                    for policy in order:
                        row, params[policy] = one_run(config, plan, library, worker, index, policy, args.slot_ms,
                                                      Path(tmp))
                        row = replace(row, point=point)
                        rows.append(row)
                        say(f"D={D} kill {worker[0]}:{stage} at {point:3s} --redo {policy:9s}: redone {row.redone:3d} "
                            f"actions ({row.redone_s:.2f} s) / share {row.share} = {row.redone / row.share:.2f}; "
                            f"kill -> step done {row.step_done_s:.2f} s; {row.kept or '-'}")
                worst = max(float((params["lost"][k] - v).abs().max()) for k, v in params["iteration"].items())
                say(f"  both policies end with the same parameters: max |difference| {worst:.2e}")
                if worst > 1e-4:
                    raise SystemExit(f"error: --redo lost and --redo iteration disagree by {worst:.2e}")
    summary: dict[str, object] = {"slot_ms": args.slot_ms, "points": list(points), "wall_s": round(time.time() - began, 1)}
    print("\n| D | policy | redone / dead worker's share, median (max) | redone actions, median | redone paced s, median "
          "| kill → step completed, median |")
    print("|---|---|---|---|---|---|")
    for D in args.replicas:
        per: dict[str, object] = {}
        for policy in ("lost", "iteration"):
            mine = [r for r in rows if r.D == D and r.policy == policy]
            ratios = [r.redone / r.share for r in mine]
            print(f"| {D} | {policy} | {statistics.median(ratios):.2f} ({max(ratios):.2f}) | "
                  f"{statistics.median(r.redone for r in mine):.0f} | {statistics.median(r.redone_s for r in mine):.2f} "
                  f"| {statistics.median(r.step_done_s for r in mine):.2f} s |")
            per[policy] = {"median_redone_over_share": round(statistics.median(ratios), 3),
                           "max_redone_over_share": round(max(ratios), 3),
                           "median_step_done_s": round(statistics.median(r.step_done_s for r in mine), 3)}
        summary[f"D{D}"] = per
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
