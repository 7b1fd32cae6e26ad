"""A torchrun entry point for bench_recovery.py's baseline: one worker of a fault-free plan built from recycle's own
pieces (stage, optimizer, executor, transport, data, pacing, checkpoints), checkpointing every step and resuming from
the latest checkpoint whenever torchrun (re)starts it.

Run by the benchmark as (one node, D*S processes; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 so that --max-restarts works
with gloo, see /work/shared/reference/measured-here.md):

    torchrun --standalone --nproc-per-node 8 --max-restarts 1 benchmarks/torchrun_job.py \
        --config CFG.json --plan PLAN.json --out DIR --slot-ms 30 [--pause-at RANK:STEP.INDEX]

Each worker writes into DIR: its pid (pid.rank{R}.restart{N}), one JSON line per completed step (steps.rank{R}.jsonl:
restart, step, start, end in wall-clock seconds) and one line per start (starts.jsonl: restart, rank, resume step,
the time its first action began). `--pause-at` makes worker RANK of the first attempt stop before action INDEX of
step STEP (0-based) and write DIR/pause.json, so that the benchmark can SIGKILL it by pid at exactly that point
(the same point a recycle FaultInjection fires at); it never pauses after a restart.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from recycle.config import parse_config
from recycle.ir import Plan
from recycle.models.gpt import DTYPES
from recycle.runtime.state import checkpoint
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.stage_state import IterationPosition, StageState
from recycle.runtime.worker.data import data_source
from recycle.runtime.worker.emulate import Emulation, cost_pacer
from recycle.runtime.worker.executor import StageExecutor
from recycle.runtime.worker.stage import build_stage
from recycle.runtime.worker.transport import Transport


def _append(path: Path, record: dict) -> None:
    """One JSON line, flushed at once (the process may be SIGKILLed any moment)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def _watchdog(deadline: float) -> None:
    """Exit if torchrun's agent is gone (workers run in their own session, so nothing else would stop them) or
    the benchmark's deadline has passed: a baseline run never leaves a process behind."""
    parent = os.getppid()
    while True:
        if os.getppid() != parent or time.time() > deadline:
            os._exit(5)
        time.sleep(0.2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", required=True, help="config as JSON (Config.to_dict())")
    parser.add_argument("--plan", required=True, help="plan JSON (the fault-free plan)")
    parser.add_argument("--out", required=True, help="directory for pids, step times and checkpoints")
    parser.add_argument("--slot-ms", type=float, required=True)
    parser.add_argument("--pause-at", default="", metavar="RANK:STEP.INDEX")
    parser.add_argument("--timeout", type=float, default=30.0, help="gloo timeout of every op (s)")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="hard limit on this worker's life (s)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    threading.Thread(target=_watchdog, args=(time.time() + args.deadline_s,), daemon=True).start()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = Path(args.out)
    (out / f"pid.rank{rank}.restart{restart}").write_text(str(os.getpid()))
    pause = None
    if args.pause_at and restart == 0:
        who, _, where = args.pause_at.partition(":")
        step_text, _, index_text = where.partition(".")
        if int(who) == rank:
            pause = (int(step_text), int(index_text))

    config = parse_config(json.loads(Path(args.config).read_text()), name="torchrun-baseline")
    plan = Plan.from_json(Path(args.plan).read_text())
    if world != len(plan.live_ranks()):
        raise SystemExit(f"torchrun started {world} workers but the plan has {len(plan.live_ranks())}; pass "
                         f"--nproc-per-node {len(plan.live_ranks())}")
    replica, stage = plan.worker(rank)
    training = config.training
    ckpt = out / "ckpt"
    built = build_stage(config, stage)
    optimizer = make_optimizer(built.module, training)
    start = checkpoint.latest_step(ckpt) if (ckpt / "latest").is_file() else 0
    position = IterationPosition(start - 1)
    state = StageState(built.module, optimizer, stage, position)
    if start > 0:
        checkpoint.load_stage(ckpt, start, state)
    load = data_source(config)

    # The store torchrun's env points at (rank 0 hosts it; with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 every attempt
    # gets a new MASTER_PORT), keyed by the attempt as well so that no key of a dead attempt is ever read.
    root = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=rank == 0,
                         timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    store = dist.PrefixStore(f"torchrun-restart{restart}", root)
    stage_ranks = {s: [plan.rank(p, s) for p in plan.live_replicas(s)] for s in range(plan.num_stages)}
    transport = Transport(store, 0, rank, plan.live_ranks(), stage_ranks, args.timeout, "gloo", torch.device("cpu"))

    first_action: list[float] = []

    def before_action(action) -> None:
        if not first_action:
            first_action.append(time.time())
            _append(out / "starts.jsonl", {"restart": restart, "rank": rank, "resume_step": start,
                                           "first_action": first_action[0]})
        progress = executor.progress
        if pause is not None and (progress.iteration, progress.index) == pause:
            checkpoint.atomic_write_text(out / "pause.json", json.dumps({"rank": rank, "pid": os.getpid(),
                                                                         "time": time.time(),
                                                                         "action": str(action)}))
            time.sleep(args.timeout)  # the benchmark SIGKILLs this process now

    executor = StageExecutor(plan, rank, built.module, optimizer, transport, load, built.input_shape,
                             built.output_shape, DTYPES[training.dtype], grad_clip=training.grad_clip,
                             seed=training.seed, before_action=before_action,
                             pacing=cost_pacer(config, plan, rank, Emulation(args.slot_ms, 1.0)), position=position)
    writer = replica == plan.live_replicas(stage)[0]
    for step in range(start, training.steps):
        result = executor.run_iteration(step)
        _append(out / f"steps.rank{rank}.jsonl", {"restart": restart, "step": step + 1, "start": result.start,
                                                  "end": result.end})
        if writer:  # every step, as a restart-based job must to lose little work
            checkpoint.save_shard(ckpt, step + 1, stage, built.layout,
                                  checkpoint.shard_entries(state, copy=False))
            if store.add(f"ckpt/{step + 1}", 1) == plan.num_stages:  # the last stage file of this step is written
                # Two stages' writers may mark steps n and n+1 at about the same moment: never move `latest` back.
                if not (ckpt / "latest").is_file() or checkpoint.latest_step(ckpt) < step + 1:
                    checkpoint.mark_latest(ckpt, step + 1, plan.num_stages)
    transport.flush()
    transport.barrier()
    store.add("finished", 1)
    if rank == 0:  # host of the store: stay until everybody has left it
        deadline = time.time() + 10
        while store.add("finished", 0) < world and time.time() < deadline:
            time.sleep(0.02)
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown of gloo's threads


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # torchrun sees the non-zero exit; skip teardown (a broken group can hang in it)
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
