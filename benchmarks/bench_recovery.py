"""Recovery from worker deaths, measured on real gloo processes: ReCycle's in-place recovery against a torchrun job
that restarts from its latest checkpoint, side by side in one run.

Run: .venv/bin/python benchmarks/bench_recovery.py [--quick] [--slot-ms 30] [--spacing 4]

Job: the tiny GPT (configs/tiny-gpt.toml) on D=4 pipelines x S=2 stages, M=4 micro-batches, float32, zb-h1 with the
staggered optimizer, every action paced to its config cost (`recycle train --emulate-costs --slot-ms MS`). ReCycle:
two runs (workers from a forkserver) that each kill a worker every `spacing` steps until every stage keeps one
replica (6 kills per run); run A kills before a micro-batch's F, run B before the worker's OPT (its stage's
all-reduce, while the other stage may already have stepped). Plans come from the plan store built before training
(PlanLibrary, as `recycle train` does). Per kill: detection latency, recovery latency (kill -> every worker started
its first action of the new plan), kill -> next completed step (the first step at or after the redone one), the work
redone, and the median measured period of the steps between this recovery and the next kill (the first step after
the recovery left out) against the simulator's period for the new plan.
Baseline: the same job, plan and pacing under `torchrun --max-restarts 1` (benchmarks/torchrun_job.py: checkpoint
every step, resume from the latest on start); the same worker is SIGKILLed by pid at the same step and action as
ReCycle's first kill of run A; measured: kill -> first action after the restart, kill -> first step completed after
the restart, and the steps redone.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path

from recycle.config import Config, load_config, parse_config
from recycle.errors import RuntimeFailure
from recycle.ir import Kind, Plan
from recycle.planner.options import PlannerOptions
from recycle.planner.provider import PlanLibrary
from recycle.runtime.control.launcher import TrainResult, launch
from recycle.runtime.options import ClusterOptions, DebugOptions, FaultOptions, LaunchOptions, RecoveryOptions
from recycle.runtime.tools.faults import FaultInjection
from recycle.runtime.worker.emulate import Emulation
from recycle.schedules.fault_free import build_schedule
from recycle.sim.simulator import simulate

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "benchmarks" / "torchrun_job.py"
# Kill order: alternate stages and replicas; replica 0 of every stage survives to the end.
KILL_ORDER = ((1, 0), (2, 1), (3, 0), (1, 1), (2, 0), (3, 1))
TOTAL_LIMIT_S = 600.0  # the whole benchmark; a watchdog ends it (and every process it started) past this


@dataclass(frozen=True)
class Kill:
    run: str
    worker: tuple[int, int]
    step: int  # 0-based iteration
    index: int  # action index in the worker's list of the plan in force then
    action: str
    where: str  # "F" or "OPT"


@dataclass(frozen=True)
class KillRow:
    kill: Kill
    detected_s: float | None
    resumed_s: float
    next_step_s: float
    redone_actions: int
    redone_s: float
    rolled_back: int
    plan_source: str
    down: str
    period_s: float | None  # median measured period between this recovery and the next kill
    samples: int
    sim_period_s: float


# -- helpers ---------------------------------------------------------------------------------------------------------
def say(text: str) -> None:
    print(text, flush=True)


def bench_config(steps: int) -> Config:
    raw = load_config(ROOT / "configs" / "tiny-gpt.toml").to_dict()
    raw["topology"] = {"num_replicas": 4, "num_stages": 2}
    raw["workload"]["num_microbatches"] = 4
    raw["training"]["steps"] = steps
    raw["training"]["dtype"] = "float32"
    return parse_config(raw, name="bench-recovery")


def action_index(plan: Plan, worker: tuple[int, int], where: str) -> int:
    """Index in the worker's list of the middle one of its F actions ("F"), or of its OPT."""
    actions = plan.actions[plan.rank(*worker)]
    if where == "OPT":
        return next(i for i, a in enumerate(actions) if a.kind is Kind.OPT)
    forwards = [i for i, a in enumerate(actions) if a.kind is Kind.F]
    return forwards[len(forwards) // 2]


def schedule_kills(run: str, where: str, plan: Plan, library: PlanLibrary, spacing: int) -> list[Kill]:
    """One kill every `spacing` steps, each at an action of the plan that will be in force at that moment."""
    kills, failed, current = [], set(), plan
    for number, worker in enumerate(KILL_ORDER):
        step = spacing * (number + 1) - 1
        index = action_index(current, worker, where)
        kills.append(Kill(run, worker, step, index, str(current.actions[current.rank(*worker)][index]), where))
        failed.add(worker)
        current = library.lookup(frozenset(failed)).plan
    return kills


def med_max(values: list[float]) -> tuple[float, float]:
    return statistics.median(values), max(values)


# -- ReCycle ---------------------------------------------------------------------------------------------------------
def run_recycle(config: Config, plan: Plan, library: PlanLibrary, kills: list[Kill], steps: int, slot_ms: float,
                label: str) -> list[KillRow]:
    faults = tuple((plan.rank(*k.worker), FaultInjection(k.step, k.index)) for k in kills)

    def progress(line: str) -> None:
        word = line.split()[1] if line.startswith("step ") else ""
        if "/" not in word or int(word.split("/")[0]) % 5 == 0:  # every recovery line, every 5th step line
            say(f"  [{label}] {line}")

    options = LaunchOptions(steps=steps, recovery=RecoveryOptions(timeout_s=30.0),
                            cluster=ClusterOptions(start_method="forkserver"), faults=FaultOptions(injections=faults),
                            debug=DebugOptions(emulation=Emulation(slot_ms, 1.0)), plan_provider=library.lookup,
                            progress=progress)
    began = time.time()
    try:
        result = launch(config, plan, options)
    except RuntimeFailure as exc:
        raise SystemExit(f"error: ReCycle run {label} did not survive its kills: {exc}") from None
    say(f"  [{label}] {len(result.steps)} steps, {len(result.recoveries)} recoveries in {time.time() - began:.1f} s")
    # Before the first kill (step 1 left out: its period is its own span, warm-up included).
    healthy = [s.period_s for s in result.steps if 1 < s.step < result.recoveries[0].step] if result.recoveries else []
    if healthy:
        predicted = simulate(plan, config).period * slot_ms / 1e3
        say(f"  [{label}] fault-free period {statistics.median(healthy):.3f} s over {len(healthy)} steps vs simulator "
            f"{predicted:.3f} s (ratio {statistics.median(healthy) / predicted:.3f})")
    return analyse(result, config, library, kills, slot_ms)


def analyse(result: TrainResult, config: Config, library: PlanLibrary, kills: list[Kill],
            slot_ms: float) -> list[KillRow]:
    recoveries = result.recoveries
    if len(recoveries) != len(kills):
        raise SystemExit(f"expected {len(kills)} recoveries, got {len(recoveries)}: "
                         f"{[r.line() for r in recoveries]}")
    rows = []
    for i, (kill, rec) in enumerate(zip(kills, recoveries)):
        if rec.workers != ("%d:%d" % kill.worker,):
            raise SystemExit(f"recovery {i + 1} lost {rec.workers}, expected worker {kill.worker}")
        # The first step completed at or after the one redone (a step before it may still end after the kill).
        after = [s for s in result.steps if s.step >= rec.step]
        next_step_s = after[0].end_time - rec.failure_time
        limit = recoveries[i + 1].step if i + 1 < len(recoveries) else result.end_step + 1
        periods = [s.period_s for s in result.steps
                   if rec.step < s.step < limit and s.generation == rec.generation]
        plan = library.lookup(frozenset(rec.failed)).plan
        down: dict[int, int] = {}
        for _, stage in rec.failed:
            down[stage] = down.get(stage, 0) + 1
        rows.append(KillRow(kill, rec.detected_s, rec.resumed_s, next_step_s, rec.redone_actions, rec.redone_s,
                            rec.rolled_back, rec.plan_source, " ".join(f"s{s}:{k}" for s, k in sorted(down.items())),
                            statistics.median(periods) if periods else None, len(periods),
                            simulate(plan, config).period * slot_ms / 1e3))
    return rows


# -- torchrun baseline -----------------------------------------------------------------------------------------------
class Torchrun:
    """One torchrun job in its own session; `stop()` ends it and every worker it ever started (by pid)."""

    def __init__(self, out: Path, args: list[str], nproc: int, log: Path) -> None:
        self.out = out
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1")
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   "--max-restarts", "1", str(JOB), *args]
        self.log = open(log, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                        cwd=ROOT, env=env)

    def worker_pids(self) -> list[int]:
        return [int(p.read_text()) for p in self.out.glob("pid.rank*.restart*") if p.read_text().strip()]

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        for pid in self.worker_pids():  # workers run in sessions of their own
            try:
                if JOB.name in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.kill(pid, signal.SIGKILL)
            except (FileNotFoundError, ProcessLookupError, PermissionError):
                pass
        self.log.close()


_ACTIVE: list[Torchrun] = []


def run_torchrun(config: Config, plan: Plan, kill: Kill, steps: int, slot_ms: float, tmp: Path) -> dict:
    out = tmp / "torchrun"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(replace(config, training=replace(config.training, steps=steps))
                                                .to_dict()))
    (out / "plan.json").write_text(plan.to_json())
    rank = plan.rank(*kill.worker)
    job = Torchrun(out, ["--config", str(out / "config.json"), "--plan", str(out / "plan.json"), "--out", str(out),
                         "--slot-ms", str(slot_ms), "--pause-at", f"{rank}:{kill.step}.{kill.index}",
                         "--deadline-s", "240"], len(plan.live_ranks()), tmp / "torchrun.log")
    _ACTIVE.append(job)
    try:
        began = time.time()
        deadline = began + 150
        marker = out / "pause.json"
        while not marker.is_file():
            if job.process.poll() is not None or time.time() > deadline:
                raise SystemExit(f"torchrun job ended or stalled before the kill point; log:\n"
                                 f"{(tmp / 'torchrun.log').read_text()[-3000:]}")
            time.sleep(0.005)
        pid = int((out / f"pid.rank{rank}.restart0").read_text())
        paused = json.loads(marker.read_text())
        os.kill(pid, signal.SIGKILL)
        kill_time = time.time()
        say(f"  [torchrun] SIGKILLed worker {kill.worker[0]}:{kill.worker[1]} (pid {pid}) at step {kill.step + 1} "
            f"before {paused['action']} ({kill_time - paused['time']:.3f} s after it paused there), "
            f"{kill_time - began:.1f} s after torchrun started")
        try:
            code = job.process.wait(timeout=max(10.0, deadline + 60 - time.time()))
        except subprocess.TimeoutExpired:
            raise SystemExit("torchrun job did not finish in time") from None
        if code != 0:
            raise SystemExit(f"torchrun exited {code}; log:\n{(tmp / 'torchrun.log').read_text()[-3000:]}")
        say(f"  [torchrun] finished {time.time() - began:.1f} s after it started (exit 0, restarted once)")
    finally:
        pids = job.worker_pids()
        job.stop()
        _ACTIVE.remove(job)

    world = len(plan.live_ranks())
    records = [json.loads(line) for r in range(world) for line in (out / f"steps.rank{r}.jsonl").read_text()
               .splitlines()]
    starts = [json.loads(line) for line in (out / "starts.jsonl").read_text().splitlines()]

    def completed(restart: int) -> dict[int, float]:
        ends: dict[int, list[float]] = {}
        for rec in records:
            if rec["restart"] == restart:
                ends.setdefault(rec["step"], []).append(rec["end"])
        return {step: max(e) for step, e in ends.items() if len(e) == world}

    before, after = completed(0), completed(1)
    restarted = [s for s in starts if s["restart"] == 1]
    if len(restarted) != world or not after:
        raise SystemExit(f"torchrun did not restart every worker ({len(restarted)} of {world} started again)")
    resume_step = restarted[0]["resume_step"]
    first_after = min(after)
    periods = [after[s] - after[s - 1] for s in sorted(after) if s - 1 in after]
    return {
        "kill_time": kill_time,
        "resumed_s": max(s["first_action"] for s in restarted) - kill_time,
        "next_step_s": after[first_after] - kill_time,
        "resume_step": resume_step,
        "completed_before": max(before) if before else 0,
        "steps_redone": kill.step + 1 - resume_step,  # from the checkpoint to the killed iteration, inclusive
        "period_s": statistics.median(periods) if periods else None,
        "sim_period_s": simulate(plan, config).period * slot_ms / 1e3,
        "pids": pids,
    }


# -- report ----------------------------------------------------------------------------------------------------------
def print_kills(rows: list[KillRow]) -> None:
    say("")
    say("ReCycle, per kill (times in seconds; period = median measured step period between this recovery and the "
        "next kill, first step after the recovery left out; sim = simulator period of the new plan x slot)")
    say(f"{'run':3s} {'step':>4s} {'worker':>6s} {'before':>7s} {'detect':>7s} {'resumed':>7s} {'->step':>7s} "
        f"{'redone':>6s} {'redo s':>6s} {'rb':>2s} {'down after':>10s} {'n':>2s} {'period':>7s} {'sim':>7s} "
        f"{'ratio':>6s} {'<=10%':>5s}")
    for r in rows:
        k = r.kill
        detect = f"{r.detected_s:7.3f}" if r.detected_s is not None else f"{'-':>7s}"
        if r.period_s is not None:
            ratio = r.period_s / r.sim_period_s
            within = "yes" if abs(ratio - 1) <= 0.10 else "NO"
            period = f"{r.period_s:7.3f} {r.sim_period_s:7.3f} {ratio:6.3f} {within:>5s}"
        else:
            period = f"{'-':>7s} {r.sim_period_s:7.3f} {'-':>6s} {'-':>5s}"
        say(f"{k.run:3s} {k.step + 1:4d} {k.worker[0]}:{k.worker[1]:<4d} {k.action:>7s} {detect} {r.resumed_s:7.3f} "
            f"{r.next_step_s:7.3f} {r.redone_actions:6d} {r.redone_s:6.3f} {r.rolled_back:2d} {r.down:>10s} "
            f"{r.samples:2d} {period}")


def print_summary(rows: list[KillRow], same: KillRow, base: dict | None) -> None:
    detected = [r.detected_s for r in rows if r.detected_s is not None]
    resumed = [r.resumed_s for r in rows]
    nexts = [r.next_step_s for r in rows]
    say("")
    say(f"Side by side ({len(rows)} ReCycle kills; torchrun: 1 kill of the same worker at the same step and action "
        f"as ReCycle's kill {same.kill.run}#1, step {same.kill.step + 1} before {same.kill.action} on "
        f"{same.kill.worker[0]}:{same.kill.worker[1]})")
    say(f"{'metric':38s} {'ReCycle median':>14s} {'max':>8s} {'same kill':>9s} {'torchrun':>9s} "
        f"{'torchrun/ReCycle':>17s}")

    def row(name: str, values: list[float], same_value: float | None, torch_value: float | None) -> None:
        m, x = med_max(values)
        t = f"{torch_value:9.3f}" if torch_value is not None else f"{'n/a':>9s}"
        s = f"{same_value:9.3f}" if same_value is not None else f"{'-':>9s}"
        ratio = (f"{torch_value / m:7.1f}x (same kill {torch_value / same_value:.1f}x)"
                 if torch_value is not None and same_value else f"{'':>17s}")
        say(f"{name:38s} {m:14.3f} {x:8.3f} {s} {t} {ratio}")

    row("detection latency (s)", detected, same.detected_s, None)
    row("kill -> training resumed (s)", resumed, same.resumed_s, base["resumed_s"] if base else None)
    row("kill -> next completed step (s)", nexts, same.next_step_s, base["next_step_s"] if base else None)
    row("work redone (actions)", [float(r.redone_actions) for r in rows], float(same.redone_actions), None)
    row("work redone (s of compute)", [r.redone_s for r in rows], same.redone_s, None)
    if base:
        say(f"{'work redone (whole steps re-run)':38s} {0:14d} {0:8d} {0:9d} {base['steps_redone']:9d}   "
            f"(torchrun resumed from the checkpoint of step {base['resume_step']}; {base['completed_before']} steps "
            f"were complete at the kill, in step {same.kill.step + 1}; ReCycle redoes part of the in-flight step)")
        if base["period_s"] is not None:
            say(f"{'torchrun period after the restart (s)':38s} {base['period_s']:14.3f}   (fault-free plan, "
                f"checkpoint every step; simulator {base['sim_period_s']:.3f})")
    ratios = [r.period_s / r.sim_period_s for r in rows if r.period_s is not None]
    say("")
    say(f"period after a failure / simulator period: median {statistics.median(ratios):.3f}, range "
        f"{min(ratios):.3f}..{max(ratios):.3f}, within 10 %: {sum(abs(x - 1) <= 0.10 for x in ratios)}/{len(ratios)}")
    say(f"goal: ReCycle kill -> training resumed < 2 s: max {max(resumed):.3f} s -> "
        f"{'MET' if max(resumed) < 2.0 else 'MISSED'}")
    if base:
        factor = base["next_step_s"] / statistics.median(nexts)
        factor_resumed = base["resumed_s"] / statistics.median(resumed)
        verdict = "MET" if min(factor, factor_resumed) >= 5 else "MISSED"
        say(f"goal: >= 5x faster than the torchrun restart: kill -> next completed step {factor:.1f}x, kill -> "
            f"training resumed {factor_resumed:.1f}x (medians) -> {verdict}")


# -- main ------------------------------------------------------------------------------------------------------------
def watchdog(limit_s: float) -> None:
    """Past the limit: end the torchrun job (and its workers), then exit; ReCycle's workers see their launcher
    (this process) disappear and exit by themselves."""
    def fire() -> None:
        say(f"bench_recovery: over {limit_s:.0f} s, aborting")
        for job in list(_ACTIVE):
            job.stop()
        os._exit(3)

    timer = threading.Timer(limit_s, fire)
    timer.daemon = True
    timer.start()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one ReCycle run (6 kills, 3 steps apart) and torchrun")
    parser.add_argument("--slot-ms", type=float, default=30.0, help="milliseconds per cost slot (default 30)")
    parser.add_argument("--spacing", type=int, default=0, help="steps between kills (default 4; --quick 3)")
    parser.add_argument("--no-torchrun", action="store_true", help="skip the torchrun baseline")
    args = parser.parse_args()
    watchdog(TOTAL_LIMIT_S)
    spacing = args.spacing or (3 if args.quick else 4)
    if spacing < 2:
        raise SystemExit(f"--spacing {spacing} must be >= 2 (a recovery, then at least one step to time)")
    steps = spacing * (len(KILL_ORDER) + 1)
    config = bench_config(steps)
    plan = build_schedule(config, "zb-h1", staggered=True)
    t0 = time.perf_counter()
    library = PlanLibrary.build(config, PlannerOptions(), max_failures=len(KILL_ORDER))
    say(f"bench_recovery: D={config.num_replicas} S={config.num_stages} M={config.num_microbatches} tiny GPT "
        f"float32, zb-h1 staggered, paced at {args.slot_ms:g} ms/slot, {steps} steps, a kill every {spacing} steps; "
        f"plan store built in {time.perf_counter() - t0:.2f} s; fault-free period "
        f"{simulate(plan, config).period * args.slot_ms / 1e3:.3f} s (simulator)")
    runs = [("A", "F")] if args.quick else [("A", "F"), ("B", "OPT")]
    rows: list[KillRow] = []
    started = time.time()
    for label, where in runs:
        kills = schedule_kills(label, where, plan, library, spacing)
        say(f"ReCycle run {label}: kills before {where}: " + ", ".join(
            f"{k.worker[0]}:{k.worker[1]}@{k.step + 1}.{k.index}({k.action})" for k in kills))
        rows += run_recycle(config, plan, library, kills, steps, args.slot_ms, label)
    first = rows[0]
    base = None
    if not args.no_torchrun:
        torch_steps = first.kill.step + 1 + spacing
        say(f"torchrun --max-restarts 1: {len(plan.live_ranks())} workers, {torch_steps} steps, checkpoint every "
            f"step, SIGKILL of {first.kill.worker[0]}:{first.kill.worker[1]} at step {first.kill.step + 1} before "
            f"{first.kill.action}")
        with tempfile.TemporaryDirectory(prefix="bench-recovery-") as tmp:
            try:
                base = run_torchrun(config, plan, first.kill, torch_steps, args.slot_ms, Path(tmp))
            finally:
                shutil.rmtree(Path(tmp) / "torchrun" / "ckpt", ignore_errors=True)
    print_kills(rows)
    print_summary(rows, first, base)
    left = [p.pid for p in multiprocessing.active_children()] + [pid for pid in (base or {}).get("pids", [])
                                                                 if _alive(pid)]
    say(f"\nwall time {time.time() - started:.0f} s; processes left behind: {left or 'none'}")
    if left:
        raise SystemExit(1)


def _alive(pid: int) -> bool:
    """Whether `pid` is still a torchrun_job worker (not a reused pid)."""
    try:
        return JOB.name in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


if __name__ == "__main__":
    main()
