"""`recycle train`: real D x S pipeline-parallel training of the built-in GPT with a fault-free schedule, a plan file,
or an adaptive plan for workers marked down."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Mapping

from recycle.api import select_plan
from recycle.commands import add_checkpointing_option, add_set_option, checkpointing_override
from recycle.config import Config, Topology, load_config
from recycle.errors import ConfigError
from recycle.ir.worker import workers_text
from recycle.runtime.control.cluster_env import NodeRole, resolve_role
from recycle.runtime.control.worker_start import warm_start
from recycle.runtime.options import (REDO_POLICIES, STAGE_LOSS_POLICIES, START_METHODS, CheckpointOptions,
                                     ClusterOptions, CoordinatorPlace, DebugOptions, FaultOptions, LaunchOptions,
                                     OutputOptions, RecoveryOptions, StartMethod, hosts_coordinator)
from recycle.runtime.tools.chaos import parse_chaos
from recycle.runtime.tools.faults import FaultInjection, parse_fault, parse_rejoin

if TYPE_CHECKING:
    from recycle.runtime.control.launcher import TrainResult
    from recycle.runtime.worker.emulation import Emulation

# The launcher and the emulation pull in torch: they are imported in run(), so `recycle train --help` starts fast.

__all__ = ["register", "run", "run_job", "select_plan", "node_role", "coordinator_place", "start_method",
           "DEFAULT_CHECKPOINT_EVERY"]  # select_plan: recycle.api's

DEFAULT_CHECKPOINT_EVERY = 10  # steps; a restore loses at most this many


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="train the built-in GPT on real processes (gloo on CPU, NCCL on CUDA)",
                              description=__doc__)
    # In the order --help lists them.
    add_job_options(p)
    add_recovery_options(p)
    add_cluster_options(p)
    add_model_options(p)
    p.set_defaults(func=run)
    return p


def add_job_options(p: argparse.ArgumentParser) -> None:
    """The config, the plan, the steps and the outputs."""
    p.add_argument("--config", required=True, help="TOML config, e.g. configs/tiny-gpt.toml")
    add_set_option(p)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--schedule", help="fault-free schedule: gpipe, 1f1b, 1f1b-decoupled, zb-h1 "
                        "(default: zb-h1, or 1f1b with --no-decouple)")
    source.add_argument("--plan", help="a plan JSON file (from `recycle plan` / `recycle schedule`)")
    p.add_argument("--down", action="append", default=[], metavar="R:S",
                   help="a worker (replica:stage) that is down from the start; repeatable; its micro-batches are "
                        "re-routed to the surviving replicas of its stage by the planner")
    p.add_argument("--steps", type=int, help="total number of steps (default: [training] steps)")
    p.add_argument("--no-stagger", action="store_true", help="coupled optimizer: all stages step together")
    p.add_argument("--no-decouple", action="store_true", help="fused backward (no B/W split)")
    p.add_argument("--split-microbatches", action="store_true",
                   help="let the planner cut a failed worker's micro-batches into pieces shared equally by its "
                        "stage's survivors, where that is faster (built-in GPT only; docs/planner.md)")
    p.add_argument("--save", help="write the final parameters (one state dict of the whole model) here: a .pt file, "
                                  "or safetensors when PATH ends in .safetensors")
    p.add_argument("--export-hf", default="", metavar="DIR",
                   help="with --hf: write the final model here as a folder transformers loads "
                        "(AutoModelForCausalLM.from_pretrained(DIR): config.json + model.safetensors); DIR must be "
                        "new or empty")
    p.add_argument("--metrics", help="write per-step metrics here as JSON lines")
    p.add_argument("--tensorboard", default="", metavar="DIR",
                   help="write TensorBoard event files here (node 0): loss, lr, tokens/s, period, grad norm, live "
                        "workers, recoveries; needs the optional extra: pip install 'recycle[tensorboard]'")
    p.add_argument("--checkpoint-dir", default="", help="write checkpoints here (torch.distributed.checkpoint "
                                                         "folders keyed by the whole model's parameter names)")
    p.add_argument("--checkpoint-every", type=int, default=None, metavar="K",
                   help=f"checkpoint every K steps (default with --checkpoint-dir: {DEFAULT_CHECKPOINT_EVERY}); "
                        "written in the background, and what the run restores by itself when a stage loses every "
                        "replica")
    p.add_argument("--keep-checkpoints", type=int, default=None, metavar="N",
                   help="keep only the newest N complete checkpoints in --checkpoint-dir (N >= 1): older step "
                        "folders are deleted once 'latest' has moved past them (default: keep all)")
    p.add_argument("--resume", default="", metavar="DIR",
                   help="resume from the latest checkpoint in DIR (any number of stages or replicas)")
    p.add_argument("--timeout", type=float, default=30.0,
                   help="seconds a collective or message may take before the peer counts as stuck (default 30)")


def add_recovery_options(p: argparse.ArgumentParser) -> None:
    """Surviving failures: planning ahead, detection, scripted and random faults, re-joins, re-partitioning."""
    recovery = p.add_argument_group("surviving failures")
    recovery.add_argument("--max-failures", type=int, default=2, metavar="F",
                          help="plan every failure state with up to F workers down before training starts (default "
                               "2); a state beyond is planned online by the heuristic when it happens")
    recovery.add_argument("--plan-store", default="", metavar="DIR",
                          help="use the plans of a store made by `recycle plan --max-failures F --out DIR`")
    recovery.add_argument("--heartbeat-timeout", type=float, default=5.0, metavar="S",
                          help="a worker (or a node's launcher) that sends no heartbeat for S seconds is frozen or "
                               "cut off: it is fenced (shut out of the job's store, and killed where its node can "
                               "be reached) and its micro-batches re-routed (default 5)")
    recovery.add_argument("--coordinator-grace", type=float, default=600.0, metavar="S",
                          help="with --coordinator separate: how long a node waits for a coordinator that died to be "
                               "restarted (same command) while its workers train on, before it stops; and how long "
                               "the coordinator waits when every node falls silent at once (its own network, more "
                               "likely) before it declares them dead (default 600)")
    recovery.add_argument("--hang-timeout", type=float, default=None, metavar="S",
                          help="a worker whose heartbeat goes on while one action has computed for S seconds is "
                               "hung (a stuck compute thread): fenced like a frozen one. Default: 20 x the median "
                               "step period, at least 10 s (the --timeout before the first step)")
    recovery.add_argument("--inject", action="append", default=[], metavar="MODE:R:S@STEP[.ACTION]",
                          help="scripted fault, repeatable: kill:1:1@3.5 SIGKILLs worker 1:1 before action 5 of "
                               "step 3; hang: freezes it (SIGSTOP); stall: blocks its main thread while its heartbeat goes on; "
                               "raise: raises; ACTION may also be 'ckpt' (during "
                               "its checkpoint write), 'recovery' (while a recovery is under way) or 'eval' (at "
                               "its first forward of the evaluation after the step); kill:1:1:1@3.5 hits TP rank 1 "
                               "of worker 1:1 ([topology] gpus_per_worker > 1); rejoin:1:1@8 "
                               "starts worker 1:1 again at step 8 (it takes its state from a live replica)")
    recovery.add_argument("--on-stage-loss", choices=STAGE_LOSS_POLICIES, default="reshape",
                          help="when a stage loses every replica (the run restores the latest checkpoint): reshape = "
                               "move a live worker of the stage with the most replicas into it (no spare machine "
                               "needed; default), respawn = wait for a replacement worker for the dead slot (a "
                               "repaired machine). reshape falls back to respawn when no stage has a replica to "
                               "spare")
    recovery.add_argument("--redo", choices=REDO_POLICIES, default="lost",
                          help="what a failure costs in the iteration it interrupts: lost = the survivors keep their "
                               "work and only what died with the failed workers is computed again, re-routed to "
                               "their stage's replicas (default; where that cannot be exact the iteration is redone), "
                               "iteration = every survivor redoes the whole iteration")
    recovery.add_argument("--respawn-after", type=float, default=None, metavar="SECONDS",
                          help="start every worker that died again after SECONDS (a stand-in for a repair on one "
                               "machine); it re-joins at an iteration boundary")
    recovery.add_argument("--chaos", default="", metavar="SEED,RATE",
                          help="soak test: kill or freeze random workers (now and then a whole stage, restored from "
                               "the checkpoint) at RATE failures per step, each started again after 0.5-2 s")
    recovery.add_argument("--repartition", action="store_true",
                          help="beyond ReCycle: in a failure state, also move whole layers between stages when the "
                               "planner finds a faster layer partition (the stage with fewer live replicas holds "
                               "fewer layers); layers move back when workers return. Built-in GPT only")
    recovery.add_argument("--repartition-prior-s", type=float, default=1800.0, metavar="S",
                          help="with --repartition: expected seconds a failure state lasts before the run has seen "
                               "any (then the mean gap between changes, this counted as one); layers move only when "
                               "the faster plan repays the migration pause within it (default: 1800)")
    recovery.add_argument("--no-recover", action="store_true",
                          help="stop the run at the first worker failure instead of re-routing around it")


def add_cluster_options(p: argparse.ArgumentParser, coordinator: bool = False) -> None:
    """Multi-node: the job secret, the store's address, and how workers start (`coordinator`: the flags of
    `recycle coordinator`, which runs no worker)."""
    p.add_argument("--token-file", default="", metavar="FILE",
                   help="multi-node: the job secret (mode 600, the same file on every node); or set "
                        "RECYCLE_JOB_TOKEN")
    cluster = p.add_argument_group(
        "multi-node (one `recycle train` per node)",
        "Without these flags each is read from the environment: torchrun's env:// names (MASTER_ADDR, MASTER_PORT, "
        "NNODES, NODE_RANK; WORLD_SIZE and RANK when they count nodes), a Kubeflow PyTorchJob's (PET_NNODES, "
        "PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT) or SLURM's (SLURM_NNODES, SLURM_NODEID, the first host of "
        "SLURM_JOB_NODELIST, a port derived from SLURM_JOB_ID); a flag wins over the environment (docs/cluster.md)")
    cluster.add_argument("--nnodes", type=int, default=None,
                         help="number of training nodes (default 1; node 0 hosts the store unless the coordinator "
                              "is separate; --save and checkpoints need a shared filesystem)")
    if not coordinator:
        cluster.add_argument("--node-rank", type=int, default=None, help="this node's index (default 0); node 0 "
                             "hosts the store unless the coordinator is separate")
    cluster.add_argument("--master-addr", default=None, help="address of the job's store (node 0, or the separate "
                         "coordinator); it listens there only (default 127.0.0.1)")
    cluster.add_argument("--master-port", type=int, default=None,
                         help="the store's port (default 0: any free port, 1 node only)")
    if coordinator:
        return
    cluster.add_argument("--coordinator", choices=("node0", "separate"), default=None,
                         help="where the job's store and coordinator run: node0 = in node 0's launcher (default); "
                              "separate = in a `recycle coordinator` process at --master-addr:--master-port, so that "
                              "node 0 is an ordinary training node whose loss the run survives (env: "
                              "RECYCLE_COORDINATOR)")
    p.add_argument("--start-method", choices=START_METHODS, default=None,
                   help="how workers start: spawn (fresh interpreter each; default) or forkserver (torch imported "
                        "once per launcher process: workers and replacements start in a fraction of the time; env: "
                        "RECYCLE_START_METHOD)")


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The model to train, and cost emulation for timing studies."""
    p.add_argument("--model-factory", default="", metavar="MODULE:FUNC",
                   help="bring your own model: a function (config, num_stages) -> list of stage modules "
                        "(see docs/runtime.md); default: the built-in GPT of [model]")
    p.add_argument("--data-source", default="", metavar="MODULE:FUNC",
                   help="bring your own data: a function (config) -> source, source(iteration, mb) returning "
                        "(inputs, targets) (see docs/runtime.md; same as [training] data_source); default: [training] "
                        "dataset")
    p.add_argument("--hf", default="", metavar="CONFIG_JSON|DIR",
                   help="train a Hugging Face causal LM (same as [model] hf_config; needs the extra: pip install "
                        "'recycle[hf]'), split into the stages by decoder layers: a config JSON starts from a random "
                        "init from [training] seed; a folder saved by save_pretrained (config.json + safetensors "
                        "weights) starts from its weights. Nothing is downloaded")
    p.add_argument("--hf-weights", default="", metavar="PATH",
                   help="with --hf CONFIG_JSON: start from these pretrained weights, a .safetensors file or a "
                        "save_pretrained folder (same as [model] hf_weights); each worker reads only its stage's "
                        "tensors")
    add_checkpointing_option(p)
    p.add_argument("--emulate-costs", action="store_true",
                   help="pad every action to the config's cost after its real work (timing studies that follow "
                        "the plan, not CPU contention); see docs/runtime-performance.md")
    p.add_argument("--slot-ms", type=float, default=None, metavar="MS",
                   help="with --emulate-costs: milliseconds per slot of a slot-unit config "
                        "(default: runtime.emulate.DEFAULT_SLOT_MS, 40)")
    p.add_argument("--cost-scale", type=float, default=None, metavar="X",
                   help="with --emulate-costs: factor on the durations of a microsecond (\"us\") config (default 1)")


def node_role(args: argparse.Namespace, env: Mapping[str, str]) -> NodeRole:
    """This node's part in the job: the flags given, the rest from the cluster's environment variables."""
    role = resolve_role(env, nnodes=args.nnodes, node_rank=args.node_rank, master_addr=args.master_addr,
                        master_port=args.master_port)
    if any(source != "default" and not source.startswith("--") for _, source in role.sources):
        import logging  # here, not at the top: `recycle train --help` stays without it

        logging.getLogger(__name__).info("node %d of %d, store at %s:%d (%s)", role.node_rank, role.nnodes, role.master_addr,
                 role.master_port, role.describe())
    return role


def coordinator_place(args: argparse.Namespace, env: Mapping[str, str]) -> CoordinatorPlace:
    """--coordinator, else RECYCLE_COORDINATOR, else node0."""
    place = args.coordinator or env.get("RECYCLE_COORDINATOR", "") or "node0"
    if place not in ("node0", "separate"):
        raise ConfigError(f"RECYCLE_COORDINATOR={place!r} is not a coordinator place; use node0 (node 0's launcher "
                          "runs it) or separate (a `recycle coordinator` process does)")
    return place  # type: ignore[return-value]  # checked just above


def start_method(args: argparse.Namespace, env: Mapping[str, str]) -> StartMethod:
    """--start-method, else RECYCLE_START_METHOD, else spawn."""
    method = args.start_method or env.get("RECYCLE_START_METHOD", "") or "spawn"
    if method not in START_METHODS:
        raise ConfigError(f"RECYCLE_START_METHOD={method!r} is not a start method; use one of "
                          f"{', '.join(START_METHODS)} (or unset it for spawn)")
    return method  # type: ignore[return-value]  # checked just above


def run(args: argparse.Namespace) -> int:
    return run_job(args, coordinator_place(args, os.environ))


def run_job(args: argparse.Namespace, place: CoordinatorPlace) -> int:
    """`recycle train` on a training node (place node0 or separate), or `recycle coordinator` (place self)."""
    from recycle.api import check_runtime_chunks, train

    role = node_role(args, os.environ)
    tensorboard = args.tensorboard if hosts_coordinator(place, role.node_rank) else ""  # the coordinator gathers the metrics
    if tensorboard:
        from recycle.runtime.control.tensorboard_sink import summary_writer

        summary_writer(tensorboard)  # a missing extra fails now, not after the plan store is built
    hf = [f"model.hf_config={json.dumps(os.path.abspath(args.hf))}"] if args.hf else []
    if args.hf_weights:
        hf.append(f"model.hf_weights={json.dumps(os.path.abspath(args.hf_weights))}")
    data = [f"training.data_source={json.dumps(args.data_source)}"] if args.data_source else []
    config = load_config(args.config, [*args.set, *hf, *data, *checkpointing_override(args)])
    check_runtime_chunks(config, model_factory=args.model_factory, repartition=args.repartition)
    if role.nnodes > config.topology.num_workers:
        raise ConfigError(f"--nnodes {role.nnodes} is more than the job's D x S = {config.topology.num_workers} "
                          "workers: every node runs at least one; use at most that many nodes")
    if config.topology.gpus_per_worker > 1:  # a tensor-parallel degree the model cannot take fails before planning
        from recycle.runtime.worker.stage import check_model

        check_model(config, args.model_factory)
    plan = select_plan(config, args.schedule, args.plan, args.down, decoupled=not args.no_decouple,
                       staggered=not args.no_stagger, split_microbatches=args.split_microbatches)
    faults, rejoins = _scripted_faults(args.inject, config.topology)
    _check_emulation_flags(args)
    if plan.failed:
        print(f"workers down: {workers_text(plan.failed)}; running plan "
              f"{plan.meta.schedule or 'adaptive'} ({'staggered' if plan.staggered else 'coupled'} optimizer)")
    options = _launch_options(args, role, faults, rejoins, place)
    check_emulation(config, options.debug.emulation, options.recovery.timeout_s)
    sink = None
    if tensorboard:
        from dataclasses import replace

        from recycle.runtime.control.tensorboard_sink import TensorBoardSink

        sink = TensorBoardSink(tensorboard)
        options = replace(options, sink=sink)
    if place != "self":  # the coordinator process starts no worker
        warm_start(options.cluster.start_method)
    try:
        result = train(config, plan, decoupled=not args.no_decouple, staggered=not args.no_stagger,
                       recover=not args.no_recover, max_failures=args.max_failures, plan_store=args.plan_store,
                       store_progress=sys.stdout, repartition=args.repartition,
                       repartition_prior_s=args.repartition_prior_s, launch_options=options,
                       split_microbatches=args.split_microbatches)
    finally:
        if sink is not None:
            sink.close()
    _print_result(result, role.node_rank, args.save, place, args.export_hf)
    return 0


def _scripted_faults(specs: list[str],
                     topology: Topology) -> tuple[list[tuple[int, FaultInjection]], list[tuple[int, int]]]:
    """--inject specs -> ([(rank, fault)], [(rank, re-join step)])."""
    faults, rejoins = [], []
    for spec in specs:
        if spec.strip().startswith("rejoin:"):
            worker, step = parse_rejoin(spec, topology.num_replicas, topology.num_stages)
            rejoins.append((topology.rank(*worker), step))
        else:
            worker, fault = parse_fault(spec, topology.num_replicas, topology.num_stages, topology.gpus_per_worker)
            faults.append((topology.rank(*worker), fault))
    return faults, rejoins


def _launch_options(args: argparse.Namespace, role: NodeRole, faults: list[tuple[int, FaultInjection]],
                    rejoins: list[tuple[int, int]], place: CoordinatorPlace = "node0") -> LaunchOptions:
    """The launcher's options from the command line (each part checks its flags' values as it is made)."""
    from recycle.runtime.protocol.token import read_token
    from recycle.runtime.worker.emulation import DEFAULT_SLOT_MS, Emulation

    checkpoint_every = args.checkpoint_every
    if checkpoint_every is None:
        checkpoint_every = DEFAULT_CHECKPOINT_EVERY if args.checkpoint_dir else 0
    return LaunchOptions(
        steps=args.steps, model_factory=args.model_factory,
        outputs=OutputOptions(save_path=args.save or "", metrics_path=args.metrics or "", export_hf=args.export_hf),
        checkpoint=CheckpointOptions(dir=args.checkpoint_dir, every=checkpoint_every, keep=args.keep_checkpoints,
                                     resume_dir=args.resume),
        recovery=RecoveryOptions(timeout_s=args.timeout, heartbeat_timeout_s=args.heartbeat_timeout,
                                 hang_timeout_s=args.hang_timeout, stage_loss=args.on_stage_loss,
                                 coordinator_grace_s=args.coordinator_grace, redo=args.redo),
        cluster=ClusterOptions(master_addr=role.master_addr, master_port=role.master_port, nnodes=role.nnodes,
                               node_rank=role.node_rank, token=read_token(_checked_token_file(args.token_file)),
                               start_method=start_method(args, os.environ), coordinator=place),
        faults=FaultOptions(injections=tuple(faults), rejoins=tuple(rejoins), respawn_after_s=args.respawn_after,
                            chaos=parse_chaos(args.chaos) if args.chaos else None),
        debug=DebugOptions(emulation=Emulation(DEFAULT_SLOT_MS if args.slot_ms is None else args.slot_ms,
                                               1.0 if args.cost_scale is None else args.cost_scale)
                           if args.emulate_costs else None))


def _check_emulation_flags(args: argparse.Namespace) -> None:
    """--slot-ms and --cost-scale only pace a run with --emulate-costs: given without it, they would be ignored and
    the run timed by the host instead, so that is an error (like --checkpoint-every without --checkpoint-dir)."""
    if args.emulate_costs:
        return
    for flag, value in (("--slot-ms", args.slot_ms), ("--cost-scale", args.cost_scale)):
        if value is not None:
            raise ConfigError(f"{flag} {value:g} paces actions only with --emulate-costs, which is not given; add "
                              f"--emulate-costs, or drop {flag}")


def check_emulation(config: Config, emulation: Emulation | None, timeout_s: float) -> None:
    """The longest action padded to its cost must end within --timeout, or its peers count it as stuck."""
    if emulation is None:
        return
    from recycle.runtime.worker.emulation import pacing_seconds_per_unit

    c = config.costs
    longest = max(max(c.forward), max(c.backward_fused), max(c.backward_input), max(c.backward_weight),
                  max(c.optimizer))
    seconds = longest * pacing_seconds_per_unit(config, emulation)
    if seconds > timeout_s:
        pace = f"--slot-ms {emulation.slot_ms:g}" if config.time_unit == "slot" else \
            f"--cost-scale {emulation.scale:g}"
        unit = "slots" if config.time_unit == "slot" else "us"
        raise ConfigError(f"{pace} pads the longest action ({longest:g} {unit}) to {seconds:,.3g} s, more "
                          f"than --timeout {timeout_s:g} s: its peers would count it as stuck; lower "
                          f"{pace.split()[0]} or raise --timeout")


TOKEN_FILE_LIMIT = 4096  # bytes: a job secret is 48 hex digits


def _checked_token_file(path: str) -> str:
    """`path`, once it is known to be a small UTF-8 text file (a binary or huge file was a traceback in read_token,
    which checks the rest: existence, mode, the secret's form)."""
    if path and os.path.isfile(path):
        from recycle.inputs import read_input_text

        read_input_text(path, f"--token-file {path!r}", TOKEN_FILE_LIMIT, "write the job secret there: 48 hex digits "
                        "from `python -c 'import secrets; print(secrets.token_hex(24))'`")
    return path


def _print_result(result: TrainResult, node_rank: int, save: str | None, place: CoordinatorPlace,
                  export_hf: str = "") -> None:
    """What the run did, where the coordinator runs (the other nodes say who reports)."""
    if not hosts_coordinator(place, node_rank):
        who = "node 0" if place == "node0" else "the coordinator"
        print(f"node {node_rank}: the run has finished ({who} reports the steps and writes the outputs)")
        return
    if result.steps:
        last = result.steps[-1]
        print(f"trained steps {result.start_step + 1}..{result.end_step} in {result.wall_s:.1f} s; final loss "
              f"{last.loss:.4f}")
    if result.recoveries:
        failures = sum(1 for r in result.recoveries if r.causes)
        joins = sum(len(r.joined) for r in result.recoveries)
        down = workers_text(result.failed, most=32)
        print(f"survived {failures} failure(s) without a restart ({joins} worker(s) re-joined); "
              + (f"workers down at the end: {down}" if down else "every worker is up at the end"))
    if not result.steps:  # a resume already at the last step
        print(f"nothing to do: already at step {result.end_step}")
    if save:
        print(f"saved final parameters to {save}")
    if export_hf and result.end_step > result.start_step:
        print(f"exported the model to {export_hf} (transformers: AutoModelForCausalLM.from_pretrained)")
