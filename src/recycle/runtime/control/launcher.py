"""The launcher: spawns one process per live worker of its node and follows the coordinator's fences and respawns;
where the coordinator runs (node 0's launcher by default, or `recycle coordinator` alone), it hosts the job's store
and runs the supervisor that keeps the job going when workers die: it detects the failure, fences the worker, picks
the plan for the new failure state and announces the next generation; it also gathers per-step metrics."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from recycle.config import Config
from recycle.errors import ConfigError, RuntimeFailure
from recycle.ir import Plan, validate_plan
from recycle.ir.worker import Worker
from recycle.runtime.control import preflight
from recycle.runtime.control.processes import Spawner, WorkerProcesses, node_ranks, start_context
from recycle.runtime.control.reporter import Recovery, StepMetrics
from recycle.runtime.control.supervisor import Supervisor
from recycle.runtime.control.worker_table import WorkerRow, replacement_line, worker_table
from recycle.runtime.options import ClusterOptions, LaunchOptions, OutputOptions
from recycle.runtime.protocol.channels import (Channels, Flags, JobStore, Keys, connect_store, host_store,
                                               launcher_identity, new_incarnation, new_token)
from recycle.runtime.protocol.messages import check_plan_matches
from recycle.runtime.protocol.records import JobSettings
from recycle.runtime.protocol.store import LocalStore, StoreFenced, StoreServer
from recycle.runtime.state import checkpoint
from recycle.runtime.worker.data import check_data
from recycle.runtime.worker.process import WorkerSpec
from recycle.runtime.worker.stage import check_model
from recycle.runtime.worker.transport import default_backend

__all__ = ["StepMetrics", "Recovery", "TrainResult", "launch", "node_ranks"]


@dataclass(frozen=True)
class TrainResult:
    start_step: int
    end_step: int
    steps: tuple[StepMetrics, ...]
    wall_s: float
    recoveries: tuple[Recovery, ...] = ()
    failed: tuple[tuple[int, int], ...] = ()  # workers down at the end
    chaos_events: tuple[dict[str, Any], ...] = ()  # what --chaos did: time, kind, workers, step


def _check_options(config: Config, plan: Plan, options: LaunchOptions) -> tuple[int, int]:
    """What the options cannot check alone (each sub-config checked its own values): against the config and the
    plan, the model, the outputs and the checkpoint to resume."""
    check_plan_matches(plan, config.num_replicas, config.num_stages, config.num_microbatches)
    validate_plan(plan)
    end = config.training.steps if options.steps is None else options.steps  # both checked >= 0
    # Catch model and data errors here, with a clear message, rather than in every worker.
    check_model(config, options.model_factory)
    check_data(config, options.model_factory)
    start = preflight.check_launch(config, options, end)  # outputs, checkpoint: before any worker
    if start > end:
        raise ConfigError(f"the checkpoint in {options.checkpoint.resume_dir!r} is at step {start}, past --steps "
                          f"{end}; ask for more steps than {start}")
    return start, end


def launch(config: Config, plan: Plan, options: LaunchOptions = LaunchOptions()) -> TrainResult:
    """Train `config`'s model with `plan` for the requested steps, surviving worker failures when a plan provider
    is given; raise RuntimeFailure when the run cannot continue."""
    start_step, end_step = _check_options(config, plan, options)
    cluster = options.cluster
    token = cluster.token or new_token()
    store_timeout_s = max(options.recovery.timeout_s, 60.0)
    server: StoreServer | None = None
    store: Any
    if cluster.hosts_coordinator:
        # The coordinator's process serves the store and reads it in-process (no socket, and it cannot be fenced).
        server = host_store(cluster.master_addr, cluster.master_port, token)
        store, store_port = LocalStore(server.data, store_timeout_s), server.port
    else:
        store = connect_store(cluster.master_addr, cluster.master_port, token,
                              launcher_identity(cluster.node_rank, new_incarnation()), store_timeout_s,
                              connect_timeout_s=store_timeout_s)
        store_port = cluster.master_port
    # What the workers are told: the store's real port, the job secret and the backend, all settled.
    resolved = replace(cluster, master_port=store_port, token=token, backend=cluster.backend or default_backend())
    mine = node_ranks(plan.live_ranks(), cluster.nnodes, cluster.node_rank) if cluster.runs_workers else []
    wall0 = time.time()
    jobs = JobStore(store)
    _agree_on_settings(jobs, _job_settings(config, plan, options, end_step), cluster)
    # A node started again while its job runs (a repaired node) brings its workers back as replacements.
    rejoining = not cluster.hosts_coordinator and jobs.is_set(Flags.RUNNING)
    spec_for = _spec_maker(config, plan, options, resolved, start_step, end_step, mine)
    spawner = Spawner(start_context(cluster.start_method), spec_for, plan.worker)
    workers = WorkerProcesses(jobs, spawner)
    finished = False
    try:
        if options.progress and cluster.runs_workers:
            options.progress(f"starting {len(mine)} worker process(es) ({cluster.start_method}): each imports torch "
                             "and builds its stage; step 1 follows when every worker has joined"
                             + (" (this node re-joins a running job)" if rejoining else ""))
        elif options.progress:
            options.progress(f"coordinator: the job's store listens on {cluster.master_addr}:{store_port}; waiting "
                             f"for {cluster.nnodes} training node(s) to start their workers (`recycle train "
                             "--coordinator separate --node-rank R` with the same config and job secret)")
        for rank in mine:
            workers.start(rank, joining=rejoining)
        if options.progress and mine:
            options.progress(f"node {cluster.node_rank}'s workers started (pid -> worker; `ps -o pid,comm` shows "
                             "each as 'recycle R:S'):")
            for line in worker_table([WorkerRow(cluster.node_rank, Worker(*plan.worker(r)), r, workers.pid(r))
                                      for r in mine]):
                options.progress(line)
        if cluster.hosts_coordinator:
            run = Supervisor(config, plan, options, store, workers, start_step, end_step, wall0, server)
            steps, recoveries, failed = run.run()
            chaos_events = [event.record() for event in run.reporter.chaos_events]
        else:
            _follow(jobs, workers, options, plan)
            steps, recoveries, failed, chaos_events = [], [], plan.failed, []
        finished = True
    finally:
        workers.stop()
        spawner.close()
        if server is not None:
            server.close()
        if not finished and options.checkpoint.dir:  # a shard being written when the run failed
            checkpoint.clear_dead_writers(options.checkpoint.dir)
        if not finished and options.outputs.parts_path and cluster.hosts_coordinator:
            for stage in range(plan.num_stages):  # a failed run leaves no half-made --save behind
                checkpoint.part_file(options.outputs.parts_path, stage).unlink(missing_ok=True)
    if options.outputs.parts_path and cluster.hosts_coordinator and end_step > start_step:
        _write_final(config, options.outputs, plan.num_stages, end_step, options.model_factory)
    return TrainResult(start_step, end_step, tuple(steps), time.time() - wall0, tuple(recoveries),
                       tuple(sorted(failed)), tuple(chaos_events))


def _write_final(config: Config, outputs: OutputOptions, num_stages: int, end_step: int, factory: str = "") -> None:
    """--save (the stages' parts merged) and --export-hf (a from_pretrained folder), from the parts the stages'
    writers left; no part outlives this."""
    from recycle.runtime.worker.stage import drop_tied_copies, tied_copy_keys

    try:
        stages = drop_tied_copies(checkpoint.read_stage_parts(outputs.parts_path, num_stages),
                                  tied_copy_keys(config, factory))  # written once, as save_pretrained writes it
        if outputs.save_path:
            checkpoint.write_merged(outputs.save_path, stages, {"step": end_step, "config": config.to_dict()})
        if outputs.export_hf:
            from recycle.models.hf_export import export_hf
            from recycle.runtime.worker.stage import hf_path

            export_hf(hf_path(config), config.workload.seq_len, {k: v for s in stages for k, v in s.items()},
                      outputs.export_hf)
    finally:
        checkpoint.remove_stage_parts(outputs.parts_path, num_stages)


def _job_settings(config: Config, plan: Plan, options: LaunchOptions, end_step: int) -> JobSettings:
    def digest(text: str) -> str:
        return hashlib.sha256(text.encode()).hexdigest()

    return JobSettings(digest(json.dumps(config.to_dict(), sort_keys=True)), digest(plan.to_json()),
                       options.model_factory, end_step, options.outputs.save_path, options.checkpoint.dir,
                       options.checkpoint.every, options.checkpoint.resume_dir, options.outputs.export_hf)


def _agree_on_settings(jobs: JobStore, mine: JobSettings, cluster: ClusterOptions) -> None:
    """The coordinator publishes the run's settings; every node launcher checks its own against them before it
    starts a worker, so that a node started with other flags is refused at once, saying what differs."""
    if cluster.hosts_coordinator:
        jobs.put(Channels.JOB, mine)
        return
    differences = mine.differences(jobs.get(Channels.JOB))
    if differences:
        raise ConfigError(f"node {cluster.node_rank} was started with other settings than the job's coordinator "
                          f"({'; '.join(differences)}); start every node, and the coordinator, with the same flags")


def _spec_maker(config: Config, plan: Plan, options: LaunchOptions, cluster: ClusterOptions, start_step: int,
                end_step: int, mine: list[int]) -> Callable[[int, bool], WorkerSpec]:
    """What a worker process of this launcher is told: its rank, the run, and whether it joins a running job
    (a replacement: no resume, no scripted faults)."""
    plan_json = plan.to_json()

    def spec_for(rank: int, joining: bool) -> WorkerSpec:
        return WorkerSpec(
            rank=rank, config=config, plan_json=plan_json, cluster=cluster, start_step=start_step, end_step=end_step,
            model_factory=options.model_factory, outputs=options.outputs, checkpoint=options.checkpoint,
            recovery=options.recovery, debug=options.debug, faults=() if joining else options.faults.of(rank),
            device_index=(mine.index(rank) if rank in mine else rank) % max(torch.cuda.device_count(), 1),
            joining=joining, incarnation=new_incarnation(),
            joiner_dies_at=os.environ.get("RECYCLE_TEST_JOINER_DIES", "") if joining else "")

    return spec_for


def _follow(jobs: JobStore, workers: WorkerProcesses, options: LaunchOptions, plan: Plan) -> None:
    """A node whose coordinator runs elsewhere (node 0's launcher or `recycle coordinator`): report its workers'
    exits, carry out fences and respawns, stop when the run ends."""
    try:
        _follow_loop(jobs, workers, options, plan)
    except StoreFenced:
        workers.stop()
        raise RuntimeFailure(f"node {options.cluster.node_rank} was declared dead by the job's coordinator while it "
                             "did not respond (frozen or cut off), and the run went on without it; its workers have "
                             "been stopped. Start this node's launcher again (the same command) to re-join the run as a "
                             "repaired node") from None
    except dist.DistError:
        workers.stop()
        where = "node 0" if options.cluster.coordinator == "node0" else "the coordinator"
        raise RuntimeFailure(f"node {options.cluster.node_rank} lost contact with the job's store on {where} "
                             f"({options.cluster.master_addr}:{options.cluster.master_port}): the run has ended or "
                             f"{where} is gone") \
            from None


def _follow_loop(jobs: JobStore, workers: WorkerProcesses, options: LaunchOptions, plan: Plan) -> None:
    reported: dict[int, int | None] = {}  # rank -> pid whose exit was reported
    for rank in workers.ranks:
        jobs.lower_flag(Flags.FENCE, rank)
    while True:
        # Node 0 tells a frozen or cut-off node by its silence.
        jobs.raw.add(Keys.node_heartbeat(options.cluster.node_rank), 1)
        for rank in workers.ranks:
            code = workers.exitcode(rank)
            if code is not None and reported.get(rank) != workers.pid(rank):
                jobs.raise_flag(Flags.EXITED, rank, text=str(code))
                reported[rank] = workers.pid(rank)
                jobs.lower_flag(Flags.FENCE, rank)
            elif code is None and jobs.is_set(Flags.FENCE, rank):
                workers.signal(rank, signal.SIGKILL)
            if code is not None and jobs.is_set(Flags.RESPAWN, rank):
                reason = jobs.flag_text(Flags.RESPAWN, rank) or ""
                jobs.lower_flag(Flags.RESPAWN, rank)
                pid = workers.start(rank, joining=True)
                if options.progress:
                    options.progress(replacement_line(
                        WorkerRow(options.cluster.node_rank, Worker(*plan.worker(rank)), rank, pid), reason))
        abort = jobs.flag_text(Flags.ABORT_RUN)
        if abort is not None:
            workers.stop()
            raise RuntimeFailure(abort)
        if jobs.is_set(Flags.FINISHED) and all(workers.exitcode(r) is not None for r in workers.ranks):
            jobs.raise_flag(Flags.NODE_DONE, options.cluster.node_rank)
            return
        workers.wait(0.1)
