"""The simulator meets the runtime: chaos soaks' exact events replayed by the job simulator, side by side.

Run: .venv/bin/python benchmarks/bench_sim_vs_runtime.py [--seeds 7 11] [--steps 100] [--rate 0.15] [--slot-ms 40]

Per seed:
1. A soak of the tiny GPT (D=3 x S=2, M=2, float64, zb-h1 staggered, every action paced to its config cost:
   `--emulate-costs`), seeded chaos (real SIGKILLs and SIGSTOPs, whole stages lost; each repaired after 0.5-2 s and
   re-admitted), a checkpoint every 5 steps, plans from a PlanLibrary built before training (as `recycle train`
   does). Its records: OUT/seed<N>/metrics.jsonl (`--metrics`) and its checkpoint folder OUT/seed<N>/ckpt.
2. The records become an event trace in which a node is a machine (`traces.soak.machine_trace`: a dead worker's
   machine leaves, the repaired machine comes back, a reshape's donor keeps its machine), OUT/seed<N>/trace.csv.
3. The job model's costs are fitted to the records (`traces.calibration`): the failure, re-join and restore pauses
   (means of the recoveries' `resumed_s`), the redone share of an iteration per failure, the checkpoint interval
   and how long after its step a checkpoint is restorable (the checkpoint folder's files). Seconds per slot: one
   scale fitted over every state's steps (their summed time / their summed simulated periods: the emulated cost
   plus this machine's per-action overhead and load, as a profile of the job measures it); the fault-free steps
   alone give another (printed too).
4. (a) Per failure state: the runtime's median step period (the first step of each generation left out: it holds
   the recovery) against simulate() of the plan the runtime ran x the fitted slot. (b) Goodput: useful steps x
   samples per step over the run (end of step 1 to end of the last step) against the job simulator's ReCycle
   (runtime layout, runtime's plans as its period per state) over the same timeline, calibrated on this run
   (in-sample) and on the other seed's run (its costs and slot: out-of-sample), each with the restores charged by
   the replay's own checkpoint phase and by their expected loss (--restore-expected-loss), and through `recycle
   simulate` (the CLI, with --calibrate-from). The model before issue 27 (planner layout, checkpoints by time, the default redo fraction)
   is printed for comparison.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chaos import soak_config  # noqa: E402  (the soak's job, shared with the chaos benchmark)

from recycle.fileio import atomic_write_text  # noqa: E402
from recycle.planner.failures import normalize  # noqa: E402
from recycle.planner.options import PlannerOptions  # noqa: E402
from recycle.planner.provider import PlanLibrary  # noqa: E402
from recycle.runtime.control.launcher import launch  # noqa: E402
from recycle.runtime.options import (CheckpointOptions, ClusterOptions, DebugOptions, FaultOptions,  # noqa: E402
                                     LaunchOptions, OutputOptions, RecoveryOptions)
from recycle.runtime.tools.chaos import ChaosSpec  # noqa: E402
from recycle.runtime.worker.emulate import Emulation  # noqa: E402
from recycle.schedules.fault_free import build_schedule  # noqa: E402
from recycle.sim.simulator import simulate  # noqa: E402
from recycle.traces.calibration import RuntimeCalibration, calibrate, iteration_work_units, read_metrics  # noqa: E402
from recycle.traces.experiments import JobSetup, run_job  # noqa: E402
from recycle.traces.model import JobCosts  # noqa: E402
from recycle.traces.reader import read_trace  # noqa: E402
from recycle.traces.soak import SoakTrace, changes_from_records, machine_trace, soak_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOODPUT_GOAL = 0.10
STATE_GOAL = 0.05
CHECKPOINT_EVERY = 5


def say(line: str) -> None:
    print(line, flush=True)


def _toml(config, steps: int) -> str:
    """The soak's config as the TOML file `recycle simulate --config` reads (checked against it below)."""
    return "\n".join([
        'name = "chaos-soak"', 'time_unit = "slot"', "",
        "[topology]", f"num_replicas = {config.num_replicas}", f"num_stages = {config.num_stages}", "",
        "[workload]", "num_microbatches = 2", "microbatch_size = 2", "seq_len = 8", "",
        "[costs]", "forward = 1", "backward_input = 1", "backward_weight = 1", "",
        "[model]", 'preset = "tiny"', "",
        "[training]", f"steps = {steps}", "lr = 0.003", "weight_decay = 0.1", 'dtype = "float64"', "seed = 1", ""])


@dataclass
class Soak:
    """One seed's run and everything measured from its records."""

    seed: int
    folder: Path
    records: list
    duration_s: float
    runtime_goodput: float
    per_key: dict  # runtime key -> step periods (s)
    profiled_slot_s: float  # the fault-free steps' median / the simulated fault-free period
    fitted_slot_s: float  # every state's steps: their summed time / their summed simulated periods
    trace: SoakTrace
    trace_path: Path
    fit: RuntimeCalibration
    old_trace_path: Path


def run_soak(args, seed: int, config, plan, library, folder: Path) -> None:
    """The soak; its --metrics records in FOLDER/metrics.jsonl and its checkpoints in FOLDER/ckpt."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)

    def progress(line: str) -> None:
        if line.startswith("chaos") or (line.startswith("step ") and "/" in line.split()[1]
                                        and int(line.split()[1].split("/")[0]) % 25 == 0):
            say(f"  [soak {seed}] {line}")
    launch(config, plan, LaunchOptions(
        checkpoint=CheckpointOptions(dir=str(folder / "ckpt"), every=CHECKPOINT_EVERY),
        outputs=OutputOptions(metrics_path=str(folder / "metrics.jsonl")),
        recovery=RecoveryOptions(timeout_s=20, heartbeat_timeout_s=1.0, heartbeat_s=0.25),
        cluster=ClusterOptions(start_method="forkserver"),
        faults=FaultOptions(chaos=ChaosSpec(seed, args.rate)),
        debug=DebugOptions(emulation=Emulation(args.slot_ms, 1.0)), plan_provider=library.lookup,
        progress=progress))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[7, 11])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rate", type=float, default=0.15, help="chaos failures per step")
    parser.add_argument("--slot-ms", type=float, default=40.0)
    parser.add_argument("--out", default="", help="folder for records, traces and simulator output (default: temp)")
    parser.add_argument("--reuse", action="store_true", help="replay the records already in --out (no soak)")
    parser.add_argument("--limit-s", type=int, default=420, help="hard limit for the whole benchmark")
    args = parser.parse_args()

    def overtime(signum, frame):  # launch() stops its workers on the way out
        raise TimeoutError(f"bench_sim_vs_runtime ran past --limit-s {args.limit_s}")
    signal.signal(signal.SIGALRM, overtime)
    signal.alarm(args.limit_s)

    bench_started = time.time()
    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sim-vs-runtime-"))
    out.mkdir(parents=True, exist_ok=True)
    config = soak_config(args.steps)
    plan = build_schedule(config, "zb-h1", staggered=True)
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=4)
    slot_s = args.slot_ms / 1e3
    D, S = config.num_replicas, config.num_stages
    samples_per_step = D * config.num_microbatches * config.workload.microbatch_size
    toml_path = out / "soak.toml"
    atomic_write_text(toml_path, _toml(config, args.steps))
    from recycle.config import load_config
    if load_config(toml_path).fingerprint() != config.fingerprint():
        raise SystemExit(f"error: {toml_path} does not describe the soak's config; fix _toml()")

    periods: dict[tuple[int, ...], float] = {}

    def period_slots(key: tuple[int, ...]) -> float:
        """The period (slots) of the plan the runtime runs in this state: its library's plan, simulated."""
        if any(k >= D for k in key):
            return math.inf
        if key not in periods:
            failed = {(p, s) for s, k in enumerate(key) for p in range(k)}
            periods[key] = simulate(plan if not failed else library.lookup(frozenset(failed)).plan, config).period
        return periods[key]

    ff_slots = period_slots((0,) * S)
    say(f"soak: D={D} x S={S} tiny GPT float64, {args.steps} steps paced at {args.slot_ms:g} ms/slot, chaos rate "
        f"{args.rate}/step, seeds {args.seeds}, checkpoint every {CHECKPOINT_EVERY} steps")

    soaks: list[Soak] = []
    for seed in args.seeds:
        folder = out / f"seed{seed}"
        if not args.reuse:
            started = time.time()
            run_soak(args, seed, config, plan, library, folder)
            say(f"soak {seed}: done in {time.time() - started:.1f} s; processes left: {len(mp.active_children())}")
        records = read_metrics(folder / "metrics.jsonl")
        steps = [r for r in records if "event" not in r]
        t0, t_end = steps[0]["end_time"], steps[-1]["end_time"]  # from the end of step 1: warm-up is not modelled
        failed_by_gen = {0: ()}
        for r in records:
            if r.get("event") == "recovery":
                failed_by_gen[r["generation"]] = tuple(tuple(w) for w in r["failed"])
        first_of_gen: dict[int, int] = {}
        for st in steps:
            first_of_gen.setdefault(st["generation"], st["step"])
        per_key: dict[tuple[int, ...], list[float]] = {}
        for st in steps:
            if st["step"] == 1 or st["step"] == first_of_gen[st["generation"]]:
                continue
            per_key.setdefault(normalize(failed_by_gen[st["generation"]], D, S).key, []).append(st["period_s"])
        healthy = per_key.get((0,) * S)
        profiled = statistics.median(healthy) / ff_slots if healthy else slot_s
        fitted = (sum(sum(v) for v in per_key.values())
                  / sum(period_slots(k) * len(v) for k, v in per_key.items())) if per_key else slot_s
        changes = changes_from_records(records, t0)
        trace = machine_trace(changes, D, S, end_s=t_end - t0)
        trace_path = folder / "trace.csv"
        atomic_write_text(trace_path, "\n".join(trace.lines) + "\n")
        old = soak_trace([replace(c, moved=()) for c in changes], D, S, end_s=t_end - t0)
        old_path = folder / "trace-planner-layout.csv"
        atomic_write_text(old_path, "\n".join(old.lines) + "\n")
        fit = calibrate(records, iteration_work_units(config) * fitted, folder / "ckpt")
        useful_steps = steps[-1]["step"] - 1
        soaks.append(Soak(seed, folder, records, t_end - t0, useful_steps * samples_per_step / (t_end - t0), per_key,
                          profiled, fitted, trace, trace_path, fit, old_path))

    def replay(soak: Soak, costs: JobCosts, trace_path: Path, seconds_per_slot: float) -> float:
        job = run_job(config, read_trace(trace_path), systems=("recycle",), costs=costs,
                      setup=JobSetup(replicas="keep", slot_seconds=seconds_per_slot, reference="planner"),
                      period_fn=period_slots, period_label="runtime's plans, simulated")
        run = job.runs["recycle"]
        return run.useful_samples / run.duration_s

    # The trace starts at the end of step 1: the runtime's checkpoints (steps 5, 10, ...) fall 4, 9, ... steps in.
    base = JobCosts(reshape=False, runtime_layout=True, fallback_checkpoint_cost_s=0.0, steps_done_at_start=1)
    verdicts: list[bool] = []
    expected_verdicts: list[bool] = []
    state_verdicts: list[bool] = []
    for i, soak in enumerate(soaks):
        other = soaks[(i + 1) % len(soaks)]
        say("")
        say(f"=== seed {soak.seed}: {soak.duration_s:.2f} s from the end of step 1 to the end of step {args.steps}; "
            f"{sum(1 for r in soak.records if r.get('event') == 'recovery')} recoveries, "
            f"{sum(1 for r in soak.records if r.get('event') == 'chaos')} chaos events")
        say(f"seconds per slot: {soak.fitted_slot_s * 1e3:.1f} ms fitted over every state's steps (their time / their "
            f"simulated periods: one scale for all states), {soak.profiled_slot_s * 1e3:.1f} ms from the fault-free "
            f"steps alone ({len(soak.per_key.get((0,) * S, []))}), nominal {args.slot_ms:g} ms")
        say("(a) per failure state: median step period vs simulate() of the runtime's plan x seconds per slot")
        say(f"{'key (failed/stage)':20s} {'steps':>5s} {'measured s':>11s} {'x fitted':>9s} {'error':>8s} "
            f"{'x fault-free':>12s} {'error':>8s} {'x nominal':>10s} {'error':>8s}")
        errors = []
        for key in sorted(soak.per_key):
            measured = statistics.median(soak.per_key[key])
            fitted, prof = period_slots(key) * soak.fitted_slot_s, period_slots(key) * soak.profiled_slot_s
            nom = period_slots(key) * slot_s
            errors.append(measured / fitted - 1)
            say(f"{str(key):20s} {len(soak.per_key[key]):5d} {measured:11.3f} {fitted:9.3f} "
                f"{measured / fitted - 1:+8.1%} {prof:12.3f} {measured / prof - 1:+8.1%} {nom:10.3f} "
                f"{measured / nom - 1:+8.1%}")
        worst = max(errors, key=abs) if errors else 0.0
        state_ok = abs(worst) <= STATE_GOAL
        state_verdicts.append(state_ok)
        say(f"goal (a) every state within {STATE_GOAL:.0%} at the fitted slot: worst {worst:+.1%}: "
            f"{'MET' if state_ok else 'NOT MET'}")
        say(f"trace: {len(soak.trace.lines) - 1} lines, {len(soak.trace.times_s) - 1} changes; the simulator's state "
            f"differs from the runtime's after {soak.trace.mismatched} of them; {soak.trace.restores} restore(s)")
        for note in soak.trace.notes:
            say(f"  note: {note}")
        say(f"calibration (this run): {soak.fit.describe()}")
        own = soak.fit.costs(base)
        cross = other.fit.costs(base)
        slot = soak.fitted_slot_s
        expected = replace(own, restore_expected_loss=True)
        goodputs = [
            ("job simulator, calibrated on this run", replay(soak, own, soak.trace_path, slot)),
            (f"job simulator, calibrated on seed {other.seed}'s run (costs, slot)",
             replay(soak, cross, soak.trace_path, other.fitted_slot_s)),
            ("job simulator, calibrated, expected restore loss", replay(soak, expected, soak.trace_path, slot)),
            (f"  the same calibrated on seed {other.seed}'s run",
             replay(soak, replace(cross, restore_expected_loss=True), soak.trace_path, other.fitted_slot_s)),
        ]
        # The pieces, each taken out in turn (in-sample): what each part of the model is worth here.
        goodputs += [
            ("  without the checkpoint latency", replay(soak, replace(own, checkpoint_latency_s=0.0),
                                                        soak.trace_path, slot)),
            ("  checkpoints by time (5 fault-free periods)",
             replay(soak, replace(own, checkpoint_every_steps=0.0, checkpoint_latency_s=0.0,
                                  fallback_checkpoint_interval_s=CHECKPOINT_EVERY * ff_slots * slot),
                    soak.trace_path, slot)),
            ("  redo fraction 0.5 (the old default)", replay(soak, replace(own, redo_fraction=0.5), soak.trace_path,
                                                            slot)),
            ("  slot from the fault-free steps alone", replay(soak, own, soak.trace_path, soak.profiled_slot_s)),
            ("  nominal slot", replay(soak, own, soak.trace_path, slot_s)),
        ]
        old_costs = replace(own, runtime_layout=False, redo_fraction=0.5, checkpoint_every_steps=0.0,
                            checkpoint_latency_s=0.0, fallback_checkpoint_interval_s=CHECKPOINT_EVERY * ff_slots * slot)
        goodputs.append(("the model before (planner layout, by time, redo 0.5)",
                         replay(soak, old_costs, soak.old_trace_path, slot)))
        cli_out = soak.folder / "cli"
        cmd = [sys.executable, "-m", "recycle", "simulate", "--config", str(toml_path), "--trace",
               str(soak.trace_path), "--slot-seconds", f"{slot:.6g}", "--systems", "recycle",
               "fault-free", "--replicas", "keep", "--reference", "planner", "--no-reshape", "--runtime-layout",
               "--calibrate-from", str(soak.folder / "metrics.jsonl"), "--calibrate-checkpoints",
               str(soak.folder / "ckpt"), "--fallback-checkpoint-cost-s", "0", "--steps-done-at-start", "1",
               "--no-plan-cache", "--json", "--out",
               str(cli_out)]
        cli = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
        if cli.returncode != 0:
            raise SystemExit(f"error: recycle simulate failed: {cli.stderr.strip()[-500:]}")
        cli_json = json.loads(cli.stdout)
        cli_goodput = cli_json["recycle"]["goodput"] * cli_json["fault_free_throughput"]
        goodputs.append(("recycle simulate CLI (planner's periods), calibrated", cli_goodput))
        say(f"(b) goodput, samples/s over {soak.duration_s:.2f} s")
        say(f"{'source':58s} {'goodput':>8s} {'error':>8s}")
        say(f"{'runtime: useful steps x ' + str(samples_per_step) + ' samples':58s} {soak.runtime_goodput:8.3f} "
            f"{'-':>8s}")
        for label, value in goodputs:
            say(f"{label:58s} {value:8.3f} {value / soak.runtime_goodput - 1:+8.1%}")
        errs = [value / soak.runtime_goodput - 1 for _, value in goodputs[:4]]
        verdicts.append(abs(errs[0]) <= GOODPUT_GOAL)
        expected_verdicts.append(abs(errs[2]) <= GOODPUT_GOAL)

        def met(err: float) -> str:
            return f"{err:+.1%} {'MET' if abs(err) <= GOODPUT_GOAL else 'NOT MET'}"
        say(f"goal (b) goodput within {GOODPUT_GOAL:.0%}: replayed checkpoint phase {met(errs[0])} in-sample, "
            f"{met(errs[1])} calibrated on the other run; expected restore loss {met(errs[2])} in-sample, "
            f"{met(errs[3])} on the other run")
        say(f"command: .venv/bin/python {' '.join(cmd[1:])}")
    say("")
    say(f"summary: goodput within {GOODPUT_GOAL:.0%} (in-sample) in {sum(verdicts)}/{len(verdicts)} runs with the "
        f"replayed checkpoint phase, {sum(expected_verdicts)}/{len(expected_verdicts)} with the expected restore loss; "
        "every failure state "
        f"within {STATE_GOAL:.0%} in {sum(state_verdicts)}/{len(state_verdicts)} runs; files in {out}; "
        f"{time.time() - bench_started:.0f} s in all")
    say(f"processes left behind: {len(mp.active_children())}")
    signal.alarm(0)
    return 0  # the goal lines above say MET or NOT MET; `make bench` goes on to the next benchmark either way


if __name__ == "__main__":
    sys.exit(main())
