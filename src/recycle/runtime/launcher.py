"""The launcher/coordinator: hosts the TCPStore, spawns one process per live worker, gathers per-step metrics,
and stops the whole job within seconds (naming the culprit) when a worker raises or dies."""

from __future__ import annotations

import datetime
import functools
import json
import multiprocessing as mp
from multiprocessing import connection as mp_connection
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from recycle.config import Config
from recycle.errors import ConfigError, RuntimeFailure
from recycle.ir import Plan, validate_plan
from recycle.runtime import checkpoint, preflight
from recycle.runtime.data import load_dataset
from recycle.runtime.emulate import Emulation
from recycle.runtime.messages import check_plan_matches
from recycle.runtime.stage import check_model
from recycle.runtime.transport import default_backend
from recycle.runtime.worker import FaultInjection, WorkerSpec, error_key, metrics_key, worker_main

__all__ = ["LaunchOptions", "StepMetrics", "TrainResult", "launch", "node_ranks"]


@dataclass(frozen=True)
class LaunchOptions:
    steps: int | None = None  # total steps to reach (default: [training] steps)
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    resume_dir: str = ""
    save_path: str = ""
    metrics_path: str = ""
    timeout_s: float = 30.0  # every collective and p2p op; catches frozen peers
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: pick a free port (single node only)
    nnodes: int = 1
    node_rank: int = 0
    backend: str = ""  # "" = nccl with CUDA, else gloo
    record_timings: bool = False
    model_factory: str = ""  # "package.module:function" returning the S stage modules; "" = the built-in GPT
    verify_replicas: bool = False  # check after every step that all live replicas of a stage are bit-identical
    faults: tuple[tuple[int, FaultInjection], ...] = ()  # (topology rank, fault): test hook
    emulation: Emulation | None = None  # pad every action to the config's cost (--emulate-costs)
    # "spawn": a fresh interpreter per worker. "forkserver": workers fork from one clean server process that has
    # imported torch once (per launcher process), so repeated launches (tests, benchmarks) skip ~2 s of imports each.
    start_method: str = "spawn"
    grace_s: float = 1.0  # after a failure, how long survivors get to report their own errors
    progress: Callable[[str], None] | None = functools.partial(print, flush=True)  # None: silent


@dataclass(frozen=True)
class StepMetrics:
    step: int  # 1-based count of completed steps
    loss: float
    tokens_per_s: float
    period_s: float  # end of this iteration minus end of the previous one (the first step: its own span)
    step_time_s: float  # first start to last end over all workers
    elapsed_s: float
    grad_norm: float | None = None
    worker_time_s: dict[str, float] = field(default_factory=dict)  # "replica:stage" -> busy span of the iteration
    worker_cpu_s: dict[str, float] = field(default_factory=dict)  # "replica:stage" -> CPU seconds of the iteration
    digests: dict[str, str] = field(default_factory=dict)  # "replica:stage" -> parameter digest (verify_replicas)


@dataclass(frozen=True)
class TrainResult:
    start_step: int
    end_step: int
    steps: tuple[StepMetrics, ...]
    wall_s: float


def node_ranks(live: list[int], nnodes: int, node_rank: int) -> list[int]:
    """The live workers node `node_rank` starts: contiguous, as even as possible."""
    base, extra = divmod(len(live), nnodes)
    start = node_rank * base + min(node_rank, extra)
    return live[start:start + base + (1 if node_rank < extra else 0)]


def _check_options(config: Config, plan: Plan, options: LaunchOptions) -> tuple[int, int]:
    check_plan_matches(plan, config.num_replicas, config.num_stages, config.num_microbatches)
    validate_plan(plan)
    end = config.training.steps if options.steps is None else options.steps
    if end < 0:
        raise ConfigError(f"--steps {end} must be >= 0")
    if options.checkpoint_every < 0 or (options.checkpoint_every > 0 and not options.checkpoint_dir):
        raise ConfigError(f"--checkpoint-every {options.checkpoint_every} needs --checkpoint-dir DIR and a value "
                          ">= 1")
    if not 0 <= options.node_rank < options.nnodes:
        raise ConfigError(f"--node-rank {options.node_rank} must be in [0, --nnodes {options.nnodes})")
    if options.nnodes > 1 and options.master_port == 0:
        raise ConfigError("--nnodes > 1 needs a fixed --master-port that every node uses")
    # Catch model and data errors here, with a clear message, rather than in every worker.
    check_model(config, options.model_factory)
    load_dataset(config.training.dataset, config.workload.seq_len, base_dir=os.path.dirname(config.source) or None)
    start = preflight.check_launch(config, options, end)  # options, outputs, checkpoint: before any worker
    if start > end:
        raise ConfigError(f"the checkpoint in {options.resume_dir!r} is at step {start}, past --steps {end}; "
                          f"ask for more steps than {start}")
    return start, end


def launch(config: Config, plan: Plan, options: LaunchOptions = LaunchOptions()) -> TrainResult:
    """Train `config`'s model with `plan` for the requested steps; raise RuntimeFailure if any worker fails."""
    start_step, end_step = _check_options(config, plan, options)
    backend = options.backend or default_backend()
    is_master = options.node_rank == 0
    store = dist.TCPStore(options.master_addr, options.master_port, is_master=is_master,
                          wait_for_workers=False, timeout=datetime.timedelta(seconds=max(options.timeout_s, 60.0)))
    generation = 0
    gen_store = dist.PrefixStore(f"gen{generation}", store)
    live = plan.live_ranks()
    mine = node_ranks(live, options.nnodes, options.node_rank)
    faults = dict(options.faults)
    plan_json = plan.to_json()
    context = _context(options.start_method)
    processes: dict[int, mp.process.BaseProcess] = {}
    # Workers block reading this pipe; only the launcher holds the write end, so they see EOF the moment it dies.
    launcher_alive, alive_writer = context.Pipe(duplex=False)
    wall0 = time.time()
    try:
        for local_index, rank in enumerate(mine):
            spec = WorkerSpec(
                rank=rank, config=config, plan_json=plan_json, store_host=options.master_addr,
                store_port=store.port, generation=generation, start_step=start_step, end_step=end_step,
                timeout_s=options.timeout_s, backend=backend,
                device_index=local_index % max(torch.cuda.device_count(), 1),
                checkpoint_dir=options.checkpoint_dir, checkpoint_every=options.checkpoint_every,
                resume_dir=options.resume_dir, save_path=options.save_path,
                record_timings=options.record_timings, verify_replicas=options.verify_replicas,
                model_factory=options.model_factory, fault=faults.get(rank),
                emulation=options.emulation)
            replica, stage = plan.worker(rank)
            process = context.Process(target=worker_main, args=(spec, launcher_alive),
                                      name=f"recycle-worker-{replica}:{stage}", daemon=True)
            process.start()
            processes[rank] = process
        steps = _monitor(config, plan, options, gen_store, processes, live, start_step, end_step, wall0)
        if options.nnodes > 1:
            _finish_nodes(gen_store, options)
    finally:
        _stop(processes)
        alive_writer.close()
        launcher_alive.close()
    if options.save_path and is_master and end_step > start_step:
        checkpoint.merge_stage_parts(options.save_path, plan.num_stages,
                                     {"step": end_step, "config": config.to_dict()})
    return TrainResult(start_step, end_step, tuple(steps), time.time() - wall0)


def _context(start_method: str) -> mp.context.BaseContext:
    if start_method not in ("spawn", "forkserver"):
        raise ConfigError(f"start method {start_method!r} is not supported; use 'spawn' or 'forkserver' (plain fork "
                          "would copy the launcher's threads and store connection)")
    context = mp.get_context(start_method)
    if start_method == "forkserver":
        context.set_forkserver_preload(["torch", "torch.distributed", "recycle.runtime.worker"])
    return context


def _monitor(config: Config, plan: Plan, options: LaunchOptions, gen_store: dist.Store,
             processes: dict[int, mp.process.BaseProcess], live: list[int], start_step: int, end_step: int,
             wall0: float) -> list[StepMetrics]:
    tokens_per_step = plan.total_microbatches * config.workload.microbatch_size * config.workload.seq_len
    steps: list[StepMetrics] = []
    previous_end: float | None = None
    next_step = start_step

    def drain() -> None:
        """Report every step all live workers have finished, in order."""
        nonlocal previous_end, next_step
        while next_step < end_step and gen_store.check([metrics_key(next_step, r) for r in live]):
            records = [json.loads(gen_store.get(metrics_key(next_step, r))) for r in live]
            metrics = _step_metrics(next_step, records, tokens_per_step, previous_end, wall0)
            previous_end = max(r["end"] for r in records)
            if options.verify_replicas:
                _check_replicas(plan, metrics)
            steps.append(metrics)
            if options.checkpoint_dir and sum(r["checkpointed"] for r in records) == plan.num_stages:
                checkpoint.mark_latest(options.checkpoint_dir, next_step + 1)
            if options.progress:
                options.progress(f"step {metrics.step}/{end_step} loss {metrics.loss:.4f} "
                                 f"tokens/s {metrics.tokens_per_s:,.0f} period {metrics.period_s * 1e3:.1f} ms")
            if options.metrics_path:
                checkpoint.atomic_write_text(options.metrics_path,
                                             "".join(json.dumps(asdict(m)) + "\n" for m in steps))
            next_step += 1

    while True:
        failed = [r for r, p in processes.items() if p.exitcode not in (None, 0)]
        if failed:
            # Survivors see a dead peer within milliseconds: give them a moment to record their own (secondary)
            # errors and to finish reporting steps that completed before the failure.
            deadline = time.time() + options.grace_s
            while time.time() < deadline and any(p.exitcode is None for p in processes.values()):
                time.sleep(0.05)
            drain()
            _fail(plan, gen_store, processes, next_step, options)
        if options.nnodes > 1 and gen_store.check(["abort"]):
            _stop(processes)
            raise RuntimeFailure(gen_store.get("abort").decode())
        drain()
        if processes and all(p.exitcode == 0 for p in processes.values()):
            drain()  # the last step's records may have landed after the poll above
            if next_step < end_step and options.nnodes == 1:
                raise RuntimeFailure(f"all workers exited but only {next_step} of {end_step} steps were reported")
            return steps
        if not processes and next_step >= end_step:
            return steps
        # Sleep until a worker exits (seen at once) or the next poll of the step records; a busy poll would take
        # CPU from the workers on a small machine.
        if processes:
            mp_connection.wait([p.sentinel for p in processes.values() if p.exitcode is None], timeout=0.1)
        else:
            time.sleep(0.1)


def _step_metrics(step: int, records: list[dict], tokens_per_step: int, previous_end: float | None,
                  wall0: float) -> StepMetrics:
    first = min(r["start"] for r in records)
    last = max(r["end"] for r in records)
    # Steady-state period: time between the completions of consecutive iterations (the first step: its span).
    period = last - previous_end if previous_end is not None else last - first
    loss = sum(r["loss_sum"] for r in records if r["loss_sum"] is not None)
    norms = [r["grad_norm"] for r in records if r["grad_norm"] is not None]
    return StepMetrics(step=step + 1, loss=loss, tokens_per_s=tokens_per_step / period if period > 0 else 0.0,
                       period_s=period, step_time_s=last - first, elapsed_s=time.time() - wall0,
                       grad_norm=norms[0] if norms else None,
                       worker_time_s={f"{r['replica']}:{r['stage']}": r["end"] - r["start"] for r in records},
                       digests={f"{r['replica']}:{r['stage']}": r["digest"] for r in records if r["digest"]},
                       worker_cpu_s={f"{r['replica']}:{r['stage']}": r["cpu_s"] for r in records if "cpu_s" in r})


def _check_replicas(plan: Plan, metrics: StepMetrics) -> None:
    """Raise RuntimeFailure if two live replicas of a stage hold different parameters after this step."""
    for stage in range(plan.num_stages):
        seen = {f"{p}:{stage}": metrics.digests[f"{p}:{stage}"] for p in plan.live_replicas(stage)}
        if len(set(seen.values())) > 1:
            raise RuntimeFailure(f"after step {metrics.step} the replicas of stage {stage} differ "
                                 f"({', '.join(f'{w}={d[:12]}' for w, d in seen.items())}); the data-parallel "
                                 "all-reduce or the optimizer is not deterministic across replicas")


def _finish_nodes(gen_store: dist.Store, options: LaunchOptions) -> None:
    """Multi-node: say this node is done; node 0 keeps the store up until every node has said so."""
    gen_store.set(f"node_done/{options.node_rank}", "1")
    if options.node_rank == 0:
        keys = [f"node_done/{n}" for n in range(options.nnodes)]
        deadline = time.time() + max(options.timeout_s, 60.0)
        while not gen_store.check(keys):
            if gen_store.check(["abort"]):
                raise RuntimeFailure(gen_store.get("abort").decode())
            if time.time() > deadline:
                raise RuntimeFailure(f"node 0 finished but not every node reported done within "
                                     f"{max(options.timeout_s, 60.0):g} s")
            time.sleep(0.05)


def _fail(plan: Plan, gen_store: dist.Store, processes: dict[int, mp.process.BaseProcess], step: int,
          options: LaunchOptions) -> None:
    """Find the worker that caused the failure, stop everyone, raise RuntimeFailure naming it (the caller has
    already given the survivors their grace period)."""
    timeout_s = options.timeout_s
    exitcodes = {r: p.exitcode for r, p in processes.items()}
    _stop(processes)
    errors = {}
    for r in processes:
        if gen_store.check([error_key(r)]):
            errors[r] = json.loads(gen_store.get(error_key(r)))

    def name(r: int) -> str:
        replica, stage = plan.worker(r)
        return f"worker {replica}:{stage} (rank {r}, pid {processes[r].pid})"

    killed = [r for r, code in exitcodes.items() if code is not None and code < 0]
    raised = sorted((e["time"], r) for r, e in errors.items() if not e["comm"])
    silent = [r for r, code in exitcodes.items() if code not in (None, 0) and code > 0 and r not in errors]
    comm = sorted((e["time"], r) for r, e in errors.items() if e["comm"])
    hung = [r for r, code in exitcodes.items() if code is None]  # still running after its peers gave up on it
    if killed:
        r = killed[0]
        reason = f"{name(r)} died (killed by signal {-exitcodes[r]})"
    elif raised:
        r = raised[0][1]
        reason = f"{name(r)} raised {errors[r]['type']}: {errors[r]['message']}"
    elif silent:
        r = silent[0]
        reason = f"{name(r)} exited with code {exitcodes[r]} without reporting an error (see its stderr above)"
    elif hung and comm:
        r = hung[0]
        reason = (f"{name(r)} stopped responding (its peers timed out after {timeout_s:g} s waiting for it: "
                  f"{errors[comm[0][1]]['message']})")
    elif comm:
        r = comm[0][1]
        reason = f"{name(r)} lost contact with a peer: {errors[r]['message']}"
    else:
        reason = "a worker failed without a record"
    others = sorted(set(errors) - ({r} if (killed or raised or silent or comm) else set()))
    detail = f"; {len(others)} other worker(s) stopped on communication errors as a result" if others else ""
    message = (f"{reason} during step {step + 1}; the run was stopped{detail}. Restart with --resume from the "
               "last checkpoint, or mark the worker down with --down R:S")
    if options.nnodes > 1:
        message = f"node {options.node_rank}: {message}"
        gen_store.set("abort", message)  # the other nodes' launchers stop their workers and report this
    raise RuntimeFailure(message)


def _stop(processes: dict[int, mp.process.BaseProcess]) -> None:
    """Terminate every still-running worker (SIGTERM, then SIGKILL) and reap it: no orphans."""
    for p in processes.values():
        if p.exitcode is None:
            p.terminate()
            try:
                os.kill(p.pid, signal.SIGCONT)  # a frozen (SIGSTOPped) worker only acts on SIGTERM once continued
            except ProcessLookupError:
                pass
    deadline = time.time() + 3.0
    for p in processes.values():
        p.join(max(0.0, deadline - time.time()))
        if p.exitcode is None:
            p.kill()
            p.join(1.0)
