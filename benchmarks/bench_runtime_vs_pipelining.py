"""Fault-free step time of our runtime (1F1B) against torch.distributed.pipelining's Schedule1F1B, side by side.

Same model (our GPT stages), same D, S, M, micro-batch, processes (one per worker, rank = replica * S + stage),
threads (torch.set_num_threads(1)), gloo on CPU, the same AdamW, and for D > 1 the same per-stage data-parallel
SUM all-reduce of the flattened gradients (theirs: a DP group per stage, all-reduced after `schedule.step`). Our
plan is 1F1B with a fused backward and the staggered optimizer (each stage reduces and steps on its own, no
cross-stage barrier), which is the work their loop does. Runs alternate (ours, theirs, ours, ...) to cancel machine
noise, after a warm-up round that is not counted (the process's first run is often its slowest); each run drops its
warm-up steps; the period of a step is the last worker's end of that step minus the last worker's end of the
previous one (what our launcher reports). Prints per-run medians, the overall medians and the ratio ours / theirs
(goal <= 1.0). `--compare-with TREE` adds our runtime from another source tree (e.g. the commit before a change)
as a third side in the same rounds.

    .venv/bin/python benchmarks/bench_runtime_vs_pipelining.py [--replicas 2 --stages 2 --microbatches 4 ...] \
        [--compare-with TREE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.nn import functional as F

from recycle.config import Config, parse_config
from recycle.models.gpt import DTYPES, build_stages
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import ClusterOptions, LaunchOptions, RecoveryOptions
from recycle.runtime.state.optim import allreduce_grads, fill_missing_grads, make_optimizer
from recycle.runtime.worker.data import data_source
from recycle.schedules.fault_free import build_schedule


def bench_config(args: argparse.Namespace) -> Config:
    return parse_config({
        "topology": {"num_replicas": args.replicas, "num_stages": args.stages},
        "workload": {"num_microbatches": args.microbatches, "microbatch_size": args.microbatch_size,
                     "seq_len": args.seq_len},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"preset": args.preset},
        "training": {"steps": args.steps, "lr": 1e-3, "dtype": "float32", "seed": 0},
    }, name="bench-runtime")


def periods(ends_per_step: list[float], warmup: int) -> list[float]:
    """Periods of steps warmup + 1 .. len (1-based) from the last worker's end of each step."""
    return [b - a for a, b in zip(ends_per_step, ends_per_step[1:])][max(warmup - 1, 0):]


# -- ours ---------------------------------------------------------------------------------------------------------
def run_ours(config: Config, steps: int, warmup: int,
             hang_timeout_s: float | None = None) -> tuple[list[float], list[float]]:
    """(step periods, CPU seconds per step summed over workers) after the warm-up steps."""
    plan = build_schedule(config, "1f1b", staggered=True)
    recovery = RecoveryOptions(timeout_s=120, hang_timeout_s=hang_timeout_s)
    result = launch(config, plan, LaunchOptions(steps=steps, cluster=ClusterOptions(start_method="forkserver"),
                                                recovery=recovery, progress=None))
    # period_s of step k = last end of step k - last end of step k-1 (step 1: its own span; dropped as warm-up)
    kept = result.steps[warmup:]
    return [s.period_s for s in kept], [sum(s.worker_cpu_s.values()) for s in kept]


def run_tree(tree: str, args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """run_ours with the recycle package of source tree `tree` (e.g. an older commit's, for a before/after), in a
    process of its own that runs this file with `--emit-ours`: (step periods, CPU seconds per step)."""
    command = [sys.executable, os.path.abspath(__file__), "--emit-ours", *_shape_args(args)]
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.abspath(tree), "src")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"our runtime from {tree} failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["periods"], result["cpu"]


def _shape_args(args: argparse.Namespace) -> list[str]:
    shape = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in
             ("replicas", "stages", "microbatches", "microbatch_size", "seq_len", "preset", "steps", "warmup")]
    return shape + ([f"--hang-timeout={args.hang_timeout}"] if args.hang_timeout is not None else [])


# -- theirs: torch.distributed.pipelining -------------------------------------------------------------------------
class _Logits(torch.nn.Module):
    """Our last stage without its loss: pipelining applies loss_fn to the last stage's output."""

    def __init__(self, stage: torch.nn.Module) -> None:
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stage(x)


def _their_worker(rank: int, config: Config, port: int, steps: int, results: mp.Queue) -> None:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    D, S, M = config.num_replicas, config.num_stages, config.num_microbatches
    replica, stage = divmod(rank, S)
    timeout = datetime.timedelta(seconds=120)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=dist.PrefixStore("theirs", store), rank=rank, world_size=D * S,
                            timeout=timeout)
    # Every rank creates every group in the same order (new_group is collective); pass the timeout explicitly.
    pp_groups = [dist.new_group([p * S + s for s in range(S)], timeout=timeout) for p in range(D)]
    dp_groups = [dist.new_group([p * S + s for p in range(D)], timeout=timeout) for s in range(S)]
    training, workload = config.training, config.workload
    dtype = DTYPES[training.dtype]
    module = build_stages(config.model, S, training.seed, dtype, workload.seq_len)[stage]
    optimizer = make_optimizer(module, training)
    params = [p for p in module.parameters() if p.requires_grad]
    is_first, is_last = stage == 0, stage == S - 1
    submodule = _Logits(module) if is_last else module
    pipe_stage = PipelineStage(submodule, stage, S, torch.device("cpu"), group=pp_groups[replica])
    vocab = module.shape.vocab_size
    scale = 1.0 / (D * M)

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1)) * scale

    # scale_grads=False: the loss already carries 1/(D*M), as in our runtime.
    schedule = Schedule1F1B(pipe_stage, M, loss_fn=loss_fn, scale_grads=False)
    load = data_source(config)
    ends, cpu = [], []
    for step in range(steps):
        cpu0 = time.process_time()
        if is_first or is_last:  # only these use the data, as in our runtime (a middle stage loads nothing)
            batches = [load(step, replica * M + j) for j in range(M)]
            tokens = torch.cat([b[0] for b in batches])
            targets = torch.cat([b[1] for b in batches])
        if is_first:
            schedule.step(tokens)
        elif is_last:
            schedule.step(target=targets, return_outputs=False)
        else:
            schedule.step()
        # The data-parallel reduce and step, as our OPT does it: one flat SUM all-reduce (none for D = 1, where our
        # OPT skips it too), AdamW.
        if D > 1:
            allreduce_grads(params, lambda flat: dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=dp_groups[stage]))
        else:
            fill_missing_grads(params)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.time())
        cpu.append(time.process_time() - cpu0)  # all threads of this process, gloo's included
    results.put((rank, ends, cpu))
    results.close()
    results.join_thread()  # the queue's feeder thread must flush before os._exit, or the parent waits forever
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # skip gloo teardown in the interpreter's exit (seconds)


def run_theirs(config: Config, steps: int, warmup: int) -> tuple[list[float], list[float]]:
    """(step periods, CPU seconds per step summed over workers) after the warm-up steps."""
    workers = config.num_replicas * config.num_stages
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    context = mp.get_context("forkserver")
    results = context.Queue()
    procs = [context.Process(target=_their_worker, args=(r, config, store.port, steps, results), daemon=True)
             for r in range(workers)]
    for p in procs:
        p.start()
    try:
        reports = [results.get(timeout=300) for _ in range(workers)]
    finally:
        for p in procs:
            p.join(30)
            if p.exitcode is None:
                p.kill()
                p.join(1)
    last_end = [max(ends[k] for _, ends, _ in reports) for k in range(steps)]
    cpu = [sum(c[k] for _, _, c in reports) for k in range(steps)]
    return periods(last_end, warmup), cpu[warmup:]  # the same steps as ours: warmup + 1 .. steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--preset", default="small", help="GPT preset (tiny, small, medium, gpt2)")
    parser.add_argument("--steps", type=int, default=7, help="steps per run (the first --warmup are dropped)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6, help="alternating rounds of (ours, theirs)")
    parser.add_argument("--warmup-rounds", type=int, default=1,
                        help="rounds of (ours, theirs) run first and not counted (the process's first run, always "
                             "ours, was ours' slowest in three of five runs)")
    parser.add_argument("--compare-with", metavar="TREE",
                        help="also run our runtime from source tree TREE (a checkout or `git archive` of an older "
                             "commit, with src/) as a third side, 'before', in the same alternating rounds; both of "
                             "our sides then run in a process of their own")
    parser.add_argument("--hang-timeout", type=float, default=None, metavar="S",
                        help="our runtime's limit on one action's compute (default: automatic); e.g. 300 for "
                             "benchmarks/step_profile's torch profiler, which writes its profile inside an OPT")
    parser.add_argument("--emit-ours", action="store_true", help=argparse.SUPPRESS)  # run_tree's child
    args = parser.parse_args()
    if args.microbatches < args.stages:
        # Schedule1F1B refuses it in every worker, and the parent would wait out its timeout for their results.
        print(f"error: --microbatches {args.microbatches} is fewer than --stages {args.stages}; torch's "
              f"Schedule1F1B needs at least one micro-batch per stage: pass --microbatches {args.stages} or more",
              file=sys.stderr)
        return 2
    config = bench_config(args)
    if args.emit_ours:
        samples, cpu_samples = run_ours(config, args.steps, args.warmup, args.hang_timeout)
        print(json.dumps({"periods": samples, "cpu": cpu_samples}))
        return 0
    sides: dict[str, Callable[[], tuple[list[float], list[float]]]] = {
        "ours": lambda: run_ours(config, args.steps, args.warmup, args.hang_timeout),
        "theirs": lambda: run_theirs(config, args.steps, args.warmup)}
    if args.compare_with:
        if not os.path.isdir(os.path.join(args.compare_with, "src", "recycle")):
            print(f"error: --compare-with {args.compare_with} has no src/recycle; pass a source tree of this "
                  "project, e.g. `git archive COMMIT src | tar -x -C DIR`", file=sys.stderr)
            return 2
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        sides = {"ours": lambda: run_tree(here, args), "before": lambda: run_tree(args.compare_with, args),
                 "theirs": sides["theirs"]}
    names = list(sides)
    print(f"D={args.replicas} S={args.stages} M={args.microbatches} micro-batch {args.microbatch_size}x"
          f"{args.seq_len} preset {args.preset}; {args.steps} steps per run, {args.warmup} warm-up dropped, "
          f"{args.rounds} alternating rounds of {', '.join(names)}"
          f"{f' (before: {args.compare_with})' if args.compare_with else ''}; gloo CPU, 1 thread per worker, "
          f"{os.cpu_count()} CPUs")
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    round_medians: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.warmup_rounds):
        untimed = {name: statistics.median(sides[name]()[0]) for name in names}
        print("warm-up round (not counted): " + ", ".join(f"{name} {untimed[name] * 1e3:.1f} ms" for name in names),
              flush=True)
    for r in range(args.rounds):
        # Every side takes every place in the order in turn (two sides: ours first, then theirs first, ...).
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            samples, cpu_samples = sides[name]()
            wall[name].extend(samples)
            cpu[name].extend(cpu_samples)
            round_medians[name].append(statistics.median(samples))
            print(f"round {r + 1} {name:6s}: median step {round_medians[name][-1] * 1e3:8.1f} ms, CPU "
                  f"{statistics.median(cpu_samples) * 1e3:8.1f} ms per step over all workers "
                  f"({len(samples)} steps)", flush=True)
    labels = {"ours": "ours   (recycle 1F1B)   ", "before": "before (recycle 1F1B)   ", "theirs": "theirs (pipelining 1F1B)"}
    for name in names:
        print(f"{labels[name]}  median step {statistics.median(wall[name]) * 1e3:8.1f} ms   CPU per step "
              f"{statistics.median(cpu[name]) * 1e3:8.1f} ms")
    for ours, theirs in [(n, "theirs") for n in names if n != "theirs"] + ([("ours", "before")] if "before" in names
                                                                          else []):
        ratios = [a / b for a, b in zip(round_medians[ours], round_medians[theirs])]
        best = min(round_medians[ours]) / min(round_medians[theirs])
        goal = " (goal <= 1.0)" if theirs == "theirs" else ""
        print(f"ratio {ours}/{theirs}: step time {statistics.median(wall[ours]) / statistics.median(wall[theirs]):.3f}"
              f"{goal}, median of per-round ratios {statistics.median(ratios):.3f} (range {min(ratios):.3f}-"
              f"{max(ratios):.3f}), best round {best:.3f}, CPU per step "
              f"{statistics.median(cpu[ours]) / statistics.median(cpu[theirs]):.3f}")
    # On a shared machine other jobs' bursts hit single runs: the best-round and per-round ratios are the robust
    # ones. CPU per step is not a pure measure of work there: the same forward cost about 45 % more CPU in runs whose
    # workers overlapped more (docs/runtime-performance.md), so a side that runs in parallel more pays more per op.
    return 0


if __name__ == "__main__":
    sys.exit(main())
