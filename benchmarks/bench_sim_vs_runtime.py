"""The simulator meets the runtime: a chaos soak's exact events replayed by the job simulator, side by side.

Run: .venv/bin/python benchmarks/bench_sim_vs_runtime.py [--steps 100] [--seed 7] [--rate 0.15] [--slot-ms 40]

1. A soak of the tiny GPT (D=3 x S=2, M=2, float64, zb-h1 staggered, every action paced to its config cost:
   `--emulate-costs`), seeded chaos (kills, hangs, whole stages lost; each repaired after 0.5-2 s and re-admitted),
   a checkpoint every 5 steps, plans from a PlanLibrary built before training (as `recycle train` does).
2. Its recoveries become an event trace (recycle.traces.soak: node n<rank> is worker (rank // S, rank % S) in the
   simulator's layout; a death at its failure time, a re-join at its recovery's time), written to OUT/soak-trace.csv
   with the soak's config as OUT/soak.toml.
   Two costs per slot: the nominal `--slot-ms`, and the profiled one (the run's median fault-free step over the
   simulated fault-free period: the emulated cost plus this machine's fixed per-action overhead, what a profile of
   the job would measure). The job model charges each failure the iteration it interrupted (`redo_fraction`).
3. (a) Per failure state: the runtime's median step period (the first step after each recovery left out: it holds
   the recovery) against simulate() of the plan the runtime ran, x slot_ms. (b) Goodput: useful steps x samples per
   step over the run (from the end of step 1 to the end of the last step) against the job simulator's ReCycle
   useful samples over the same timeline, with the runtime's own plans as its period per state (Python API) and
   with `recycle simulate`'s planner (the CLI, as a user would run it). The job model's pause knobs are set from
   the soak's measured recovery latencies (printed).
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
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_chaos import soak_config  # noqa: E402  (the soak's job, shared with the chaos benchmark)

from recycle.fileio import atomic_write_text  # noqa: E402
from recycle.planner.failures import normalize  # noqa: E402
from recycle.planner.options import PlannerOptions  # noqa: E402
from recycle.planner.provider import PlanLibrary  # noqa: E402
from recycle.runtime.control.launcher import TrainResult, launch  # noqa: E402
from recycle.runtime.options import (CheckpointOptions, ClusterOptions, DebugOptions, FaultOptions,  # noqa: E402
                                     LaunchOptions, OutputOptions, RecoveryOptions)
from recycle.runtime.tools.chaos import ChaosSpec  # noqa: E402
from recycle.runtime.worker.emulate import Emulation  # noqa: E402
from recycle.schedules.fault_free import build_schedule  # noqa: E402
from recycle.sim.simulator import simulate  # noqa: E402
from recycle.traces.experiments import JobSetup, run_job  # noqa: E402
from recycle.traces.jobsim import rate_at  # noqa: E402
from recycle.traces.model import JobCosts  # noqa: E402
from recycle.traces.reader import read_trace  # noqa: E402
from recycle.traces.soak import SoakChange, soak_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GOAL = 0.10
CHECKPOINT_EVERY = 5


def say(line: str) -> None:
    print(line, flush=True)


def _worker(text: str) -> tuple[int, int]:
    r, s = text.split(":")
    return int(r), int(s)


def _toml(config, steps: int) -> str:
    """The soak's config as the TOML file `recycle simulate --config` reads (checked against it below)."""
    return "\n".join([
        'name = "chaos-soak"', 'time_unit = "slot"', "",
        "[topology]", f"num_replicas = {config.num_replicas}", f"num_stages = {config.num_stages}", "",
        "[workload]", "num_microbatches = 2", "microbatch_size = 2", "seq_len = 8", "",
        "[costs]", "forward = 1", "backward_input = 1", "backward_weight = 1", "",
        "[model]", 'preset = "tiny"', "",
        "[training]", f"steps = {steps}", "lr = 0.003", "weight_decay = 0.1", 'dtype = "float64"', "seed = 1", ""])


def run_soak(args, config, plan, library, out: Path) -> TrainResult:
    """The soak, its --metrics records in OUT/metrics.jsonl and its checkpoints in OUT/ckpt (the calibration reads
    both)."""
    if (out / "ckpt").exists():
        shutil.rmtree(out / "ckpt")
    if True:
        def progress(line: str) -> None:
            if line.startswith("chaos") or (line.startswith("step ") and "/" in line.split()[1]
                                            and int(line.split()[1].split("/")[0]) % 25 == 0):
                say(f"  [soak] {line}")
        return launch(config, plan, LaunchOptions(
            checkpoint=CheckpointOptions(dir=str(out / "ckpt"), every=CHECKPOINT_EVERY),
            outputs=OutputOptions(metrics_path=str(out / "metrics.jsonl")),
            recovery=RecoveryOptions(timeout_s=20, heartbeat_timeout_s=1.0, heartbeat_s=0.25),
            cluster=ClusterOptions(start_method="forkserver"),
            faults=FaultOptions(chaos=ChaosSpec(args.seed, args.rate)),
            debug=DebugOptions(emulation=Emulation(args.slot_ms, 1.0)), plan_provider=library.lookup,
            progress=progress))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--rate", type=float, default=0.15, help="chaos failures per step")
    parser.add_argument("--slot-ms", type=float, default=40.0)
    parser.add_argument("--out", default="", help="folder for the trace, config and simulator output (default: temp)")
    parser.add_argument("--limit-s", type=int, default=300, help="hard limit for the whole benchmark")
    args = parser.parse_args()

    def overtime(signum, frame):  # launch() stops its workers on the way out
        raise TimeoutError(f"bench_sim_vs_runtime ran past --limit-s {args.limit_s}")
    signal.signal(signal.SIGALRM, overtime)
    signal.alarm(args.limit_s)

    out = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="sim-vs-runtime-"))
    out.mkdir(parents=True, exist_ok=True)
    config = soak_config(args.steps)
    plan = build_schedule(config, "zb-h1", staggered=True)
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=4)
    slot_s = args.slot_ms / 1e3
    D, S = config.num_replicas, config.num_stages
    samples_per_step = D * config.num_microbatches * config.workload.microbatch_size

    def plan_for(failed) -> object:
        return plan if not failed else library.lookup(frozenset(failed)).plan

    def period_slots(key: tuple[int, ...]) -> float:
        if any(k >= D for k in key):
            return math.inf
        return simulate(plan_for({(p, s) for s, k in enumerate(key) for p in range(k)}), config).period

    say(f"soak: D={D} x S={S} tiny GPT float64, {args.steps} steps paced at {args.slot_ms:g} ms/slot, chaos seed "
        f"{args.seed} rate {args.rate}/step, checkpoint every 5 steps")
    started = time.time()
    result = run_soak(args, config, plan, library, out)
    say(f"soak: {result.end_step} steps, {len(result.recoveries)} recoveries, {len(result.chaos_events)} chaos events "
        f"in {time.time() - started:.1f} s; processes left: {len(mp.active_children())}")

    # -- (a) per failure state -------------------------------------------------------------------------------------
    failed_by_gen = {0: ()}
    first_step_of_gen: dict[int, int] = {}
    for rec in result.recoveries:
        failed_by_gen[rec.generation] = tuple(tuple(w) for w in rec.failed)
    for st in result.steps:
        first_step_of_gen.setdefault(st.generation, st.step)
    per_key: dict[tuple[int, ...], list[float]] = {}
    for st in result.steps:
        if st.step == 1 or st.step == first_step_of_gen[st.generation]:
            continue
        key = normalize(failed_by_gen[st.generation], D, S).key
        per_key.setdefault(key, []).append(st.period_s)
    say("")
    say("(a) per failure state: measured median step period vs simulate() of the runtime's plan x slot")
    say(f"{'key (failed/stage)':20s} {'steps':>5s} {'measured s':>11s} {'simulated s':>12s} {'error':>8s}")
    errors, weights, meas_total, sim_total = [], [], 0.0, 0.0
    for key in sorted(per_key):
        measured = statistics.median(per_key[key])
        predicted = period_slots(key) * slot_s
        err = measured / predicted - 1
        errors.append(err)
        weights.append(len(per_key[key]))
        meas_total += sum(per_key[key])
        sim_total += predicted * len(per_key[key])
        say(f"{str(key):20s} {len(per_key[key]):5d} {measured:11.3f} {predicted:12.3f} {err:+8.1%}")
    worst = max(errors, key=abs)
    weighted = sum(abs(e) * w for e, w in zip(errors, weights)) / sum(weights)
    total_err = meas_total / sim_total - 1
    say(f"overall: worst state {worst:+.1%}, step-weighted mean |error| {weighted:.1%}, summed periods "
        f"{meas_total:.2f} s measured vs {sim_total:.2f} s simulated ({total_err:+.1%})")
    ok_a = abs(worst) <= GOAL
    say(f"goal (a) every state within {GOAL:.0%}: {'MET' if ok_a else 'NOT MET'}")

    # -- the trace --------------------------------------------------------------------------------------------------
    t0 = result.steps[0].end_time  # step 1 ends: warm-up (imports, first contact) is not in the job model
    t_end = result.steps[-1].end_time
    end_of = {st.step: st.end_time for st in result.steps}  # a redone step: its last (kept) end

    def event_time(rec) -> float:
        """A failure: its fault time. A join alone: the iteration boundary where the survivors stopped to admit it
        (its own failure_time is when the joiner came up; training went on until the boundary)."""
        if rec.workers or rec.step - 1 not in end_of:
            return rec.failure_time
        return max(rec.failure_time, end_of[rec.step - 1])

    changes = [SoakChange(event_time(rec) - t0, tuple(_worker(w) for w in rec.workers),
                          tuple(_worker(w) for w in rec.joined), tuple(tuple(w) for w in rec.failed))
               for rec in result.recoveries]
    trace = soak_trace(changes, D, S, end_s=t_end - t0)
    trace_path, toml_path = out / "soak-trace.csv", out / "soak.toml"
    atomic_write_text(trace_path, "\n".join(trace.lines) + "\n")
    atomic_write_text(toml_path, _toml(config, args.steps))
    from recycle.config import load_config
    if load_config(toml_path).fingerprint() != config.fingerprint():
        raise SystemExit(f"error: {toml_path} does not describe the soak's config; fix _toml()")
    say("")
    say(f"trace: {len(trace.lines) - 1} lines, {len(changes)} changes, {trace.restores} checkpoint restore(s) in the "
        f"simulator; states where the simulator's key differs from the runtime's: {trace.mismatched}")
    for note in trace.notes:
        say(f"  note: {note}")

    # -- the job model's pauses, from the soak's measured recovery latencies ----------------------------------------
    joins = [r.resumed_s for r in result.recoveries if r.joined and not r.workers]
    fails = [r.resumed_s for r in result.recoveries if r.workers and r.restored_step is None]
    restores = [r.resumed_s for r in result.recoveries if r.restored_step is not None]
    plan_switch = statistics.fmean(joins) if joins else 0.0
    detect = max(0.0, (statistics.fmean(fails) if fails else 0.0) - plan_switch)
    restart = max(0.0, (statistics.fmean(restores) if restores else 0.0) - plan_switch)
    ff_period_s = period_slots((0,) * S) * slot_s
    costs = JobCosts(detect_s=detect, plan_switch_s=plan_switch, restart_s=restart,
                     fallback_checkpoint_interval_s=5 * ff_period_s, fallback_checkpoint_cost_s=0.0, reshape=False)
    say(f"job model pauses (means of the soak's recoveries): plan_switch_s {plan_switch:.3f} (re-join pause, "
        f"{len(joins)}), detect_s {detect:.3f} (failure pause {statistics.fmean(fails) if fails else 0:.3f} - switch, "
        f"{len(fails)}), restart_s {restart:.3f} (restore pause - switch, {len(restores)}); fallback checkpoint every "
        f"{5 * ff_period_s:.3f} s of running (5 fault-free periods), redo_fraction {costs.redo_fraction} (default), "
        "reshape off, no state-copy time (config has no link costs)")

    # -- (b) goodput ------------------------------------------------------------------------------------------------
    duration = t_end - t0
    useful_steps = result.end_step - 1
    runtime_goodput = useful_steps * samples_per_step / duration
    # "Profiled costs": seconds per slot as the fault-free steps of this run measured them (what `recycle profile`
    # does before a real job): the emulated costs plus this machine's fixed per-action overhead.
    healthy = per_key.get((0,) * S)
    profiled_slot_s = statistics.median(healthy) / period_slots((0,) * S) if healthy else slot_s

    def replay_goodput(knobs: JobCosts, seconds_per_slot: float = slot_s):
        job = run_job(config, read_trace(trace_path), systems=("recycle",), costs=knobs,
                      setup=JobSetup(replicas="keep", slot_seconds=seconds_per_slot, reference="planner"),
                      period_fn=period_slots, period_label="runtime's plans, simulated")
        run = job.runs["recycle"]
        return run, run.useful_samples / run.duration_s

    rc, sim_goodput = replay_goodput(costs)
    _, noredo_goodput = replay_goodput(replace(costs, redo_fraction=0.0))
    # (the soak checkpoints every 5 steps: 5 fault-free periods at the profiled slot)
    profiled_interval_s = 5 * period_slots((0,) * S) * profiled_slot_s
    _, prof_goodput = replay_goodput(replace(costs, fallback_checkpoint_interval_s=profiled_interval_s),
                                     profiled_slot_s)
    # A cross-check of the redo term: charge each event's whole measured loss as its pause: failure (or join) -> end
    # of the first step completed after it, minus one simulated period of the new state.
    def event_loss(rec) -> float:
        after = [st for st in result.steps if st.step >= rec.step and st.end_time > event_time(rec)]
        if not after:
            return rec.resumed_s
        key = normalize(failed_by_gen.get(after[0].generation, ()), D, S).key
        return max(0.0, after[0].end_time - event_time(rec) - period_slots(key) * slot_s)
    loss_join = [event_loss(r) for r in result.recoveries if r.joined and not r.workers]
    loss_fail = [event_loss(r) for r in result.recoveries if r.workers and r.restored_step is None]
    loss_restore = [event_loss(r) for r in result.recoveries if r.restored_step is not None]
    switch2 = statistics.fmean(loss_join) if loss_join else 0.0
    full_costs = JobCosts(detect_s=max(0.0, (statistics.fmean(loss_fail) if loss_fail else 0.0) - switch2),
                          plan_switch_s=switch2,
                          restart_s=max(0.0, (statistics.fmean(loss_restore) if loss_restore else 0.0) - switch2),
                          fallback_checkpoint_interval_s=5 * ff_period_s, fallback_checkpoint_cost_s=0.0,
                          reshape=False, redo_fraction=0.0)
    rc_full, full_goodput = replay_goodput(full_costs)
    # The replay must be in the states the trace meant: its running rate just after each change.
    expected = [0.0 if k is None else samples_per_step / (period_slots(k) * slot_s) for k in trace.sim_keys]
    got = [rate_at(rc.steady, t + 0.002) for t in trace.times_s]
    off = sum(abs(a - b) > 1e-9 * max(1.0, a) for a, b in zip(expected, got))

    cli_out = out / "cli"
    cmd = [sys.executable, "-m", "recycle", "simulate", "--config", str(toml_path), "--trace", str(trace_path),
           "--slot-seconds", f"{slot_s:g}", "--systems", "recycle", "fault-free", "--replicas", "keep",
           "--reference", "planner", "--no-reshape", "--detect-s", f"{detect:.4f}", "--plan-switch-s",
           f"{plan_switch:.4f}", "--restart-s", f"{restart:.4f}", "--fallback-checkpoint-interval-s",
           f"{5 * ff_period_s:.4f}", "--json", "--out", str(cli_out)]

    def run_cli(seconds_per_slot: float) -> tuple[float, float]:
        argv = [*cmd]
        argv[argv.index("--slot-seconds") + 1] = f"{seconds_per_slot:.6g}"
        argv[argv.index("--fallback-checkpoint-interval-s") + 1] = (
            f"{5 * period_slots((0,) * S) * seconds_per_slot:.4f}")
        cli = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT)
        if cli.returncode != 0:
            raise SystemExit(f"error: recycle simulate failed: {cli.stderr.strip()[-500:]}")
        cli_json = json.loads(cli.stdout)
        summary = json.loads((cli_out / "summary.json").read_text())
        return (cli_json["recycle"]["goodput"] * cli_json["fault_free_throughput"],
                summary["systems"]["recycle"]["lost_s"].get("lost work", 0.0))
    cli_goodput, cli_lost = run_cli(slot_s)
    cli_prof_goodput, _ = run_cli(profiled_slot_s)
    cmd[cmd.index("--slot-seconds") + 1] = f"{profiled_slot_s:.6g}"
    cmd[cmd.index("--fallback-checkpoint-interval-s") + 1] = f"{profiled_interval_s:.4f}"

    lost = rc.lost_s
    runtime_pauses = sum(r.resumed_s for r in result.recoveries)
    redone = sum(r.redone_s for r in result.recoveries)
    steps_lost = sum(r.steps_lost for r in result.recoveries)
    say("")
    say(f"(b) goodput over {duration:.2f} s (end of step 1 -> end of step {result.end_step}), samples/s")
    say(f"{'source':52s} {'goodput':>8s} {'error':>8s}")
    say(f"{'runtime: ' + str(useful_steps) + ' useful steps x ' + str(samples_per_step) + ' samples':52s} "
        f"{runtime_goodput:8.3f} {'-':>8s}")
    say(f"{'job simulator, the runtime plans (API)':52s} {sim_goodput:8.3f} {sim_goodput / runtime_goodput - 1:+8.1%}")
    say(f"{'  the same without the redo term (--redo-fraction 0)':52s} {noredo_goodput:8.3f} "
        f"{noredo_goodput / runtime_goodput - 1:+8.1%}")
    say(f"{'job simulator, runtime plans, measured loss as pauses':52s} {full_goodput:8.3f} "
        f"{full_goodput / runtime_goodput - 1:+8.1%}")
    say(f"    (pauses per event: detect_s {full_costs.detect_s:.3f}, plan_switch_s {full_costs.plan_switch_s:.3f}, "
        f"restart_s {full_costs.restart_s:.3f})")
    say(f"{'recycle simulate CLI (planner periods)':52s} {cli_goodput:8.3f} {cli_goodput / runtime_goodput - 1:+8.1%}")
    say(f"profiled costs: {profiled_slot_s * 1e3:.1f} ms per slot (median fault-free step / simulated fault-free "
        f"period; nominal {slot_s * 1e3:g} ms)")
    say(f"{'job simulator, runtime plans, profiled slot (API)':52s} {prof_goodput:8.3f} "
        f"{prof_goodput / runtime_goodput - 1:+8.1%}")
    say(f"{'recycle simulate CLI, profiled slot':52s} {cli_prof_goodput:8.3f} "
        f"{cli_prof_goodput / runtime_goodput - 1:+8.1%}")
    say(f"    (fallback checkpoint every 5 fault-free periods, as the soak; lost work {cli_lost:.2f} s)")
    say(f"{'fault-free (runtime zb-h1 plan, simulated)':52s} {samples_per_step / ff_period_s:8.3f}")

    def verdict(x: float) -> str:
        return "MET" if abs(x / runtime_goodput - 1) <= GOAL else "NOT MET"
    say(f"goal (b) goodput within {GOAL:.0%} with profiled costs: API {verdict(prof_goodput)}, CLI "
        f"{verdict(cli_prof_goodput)}; with the nominal slot: API {verdict(sim_goodput)}, CLI {verdict(cli_goodput)}; "
        f"(nominal, without the redo term {verdict(noredo_goodput)}; measured loss as pauses {verdict(full_goodput)})")
    say(f"replay check: running rate after each change as the trace meant: {len(got) - off}/{len(got)}")
    say("")
    say("where the time went (s):")
    say(f"  runtime: recovery pauses (failure or stop -> first action of the new plan) {runtime_pauses:.2f}, "
        f"redone work inside them {redone:.2f}, steps lost to restores {steps_lost} "
        f"(~{steps_lost * ff_period_s:.2f} s); steps x simulated period of their state "
        f"{sum(period_slots(normalize(failed_by_gen[st.generation], D, S).key) * slot_s for st in result.steps[1:]):.2f}"
        f" of {duration:.2f}")
    say("  simulator: " + ", ".join(f"{k} {v:.2f}" for k, v in lost.items() if v > 0) +
        " (fault-free-equivalent seconds)")
    say("  simulator, pauses incl. redone work: " + ", ".join(f"{k} {v:.2f}" for k, v in rc_full.lost_s.items()
                                                            if v > 0))
    say(f"files: {trace_path}, {toml_path}, {cli_out}/summary.json")
    say(f"command (profiled slot): .venv/bin/python {' '.join(cmd[1:])}")
    say(f"processes left behind: {len(mp.active_children())}")
    signal.alarm(0)
    return 0  # the goal lines above say MET or NOT MET; `make bench` goes on to the next benchmark either way


if __name__ == "__main__":
    sys.exit(main())
