"""The worker process: joins the launcher's store, builds its stage, runs the plan step by step and reports."""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from recycle.config import Config
from recycle.ir import Plan
from recycle.models.gpt import DTYPES
from recycle.runtime import checkpoint
from recycle.runtime.data import load_dataset, microbatch
from recycle.runtime.emulate import Emulation, install_pacing
from recycle.runtime.executor import StageExecutor
from recycle.runtime.optim import AdamW
from recycle.runtime.stage import build_stage
from recycle.runtime.transport import Transport, is_comm_error

__all__ = ["WorkerSpec", "FaultInjection", "worker_main", "metrics_key", "error_key", "make_optimizer",
           "parameter_digest"]


@dataclass(frozen=True)
class FaultInjection:
    """Test hook: at (step, action index) the worker SIGKILLs itself ("kill"), raises ("raise") or freezes
    ("freeze": SIGSTOP, a hung worker that only the timeout can catch)."""

    step: int
    index: int
    mode: str = "kill"


@dataclass(frozen=True)
class WorkerSpec:
    rank: int  # topology rank = replica * S + stage
    config: Config
    plan_json: str
    store_host: str
    store_port: int
    generation: int
    start_step: int
    end_step: int  # exclusive
    timeout_s: float
    backend: str
    device_index: int = 0
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    resume_dir: str = ""
    save_path: str = ""
    record_timings: bool = False
    model_factory: str = ""  # "package.module:function" (runtime.stage); "" = the built-in GPT
    verify_replicas: bool = False  # report a digest of the stage parameters after every step
    fault: FaultInjection | None = None
    emulation: Emulation | None = None  # pad every action to the config's cost (runtime.emulate)


def metrics_key(step: int, rank: int) -> str:
    return f"metrics/{step}/{rank}"


def error_key(rank: int) -> str:
    return f"error/{rank}"


def make_optimizer(module: torch.nn.Module, lr: float, weight_decay: float) -> AdamW:
    """The stage optimizer (the reference uses the same one)."""
    return AdamW(module.parameters(), lr=lr, weight_decay=weight_decay)


def parameter_digest(module: torch.nn.Module) -> str:
    """SHA-256 of the parameters' bytes: equal digests mean bit-identical replicas."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _watch_launcher(launcher_alive: Connection) -> None:
    """Exit as soon as the launcher disappears, so no worker outlives its job. The thread sleeps in a blocking read
    of a pipe whose only writer is the launcher: no polling, and EOF arrives the moment the launcher dies."""
    try:
        launcher_alive.recv_bytes()
    except (EOFError, OSError):
        pass
    os._exit(3)


def worker_main(spec: WorkerSpec, launcher_alive: Connection | None = None) -> None:
    """Process entry point; exits non-zero after writing an error record to the store if anything fails."""
    torch.set_num_threads(1)
    if spec.backend == "gloo" and spec.store_host in ("127.0.0.1", "localhost"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # single machine: keep gloo on loopback
    if launcher_alive is not None:
        threading.Thread(target=_watch_launcher, args=(launcher_alive,), daemon=True).start()
    store = dist.TCPStore(spec.store_host, spec.store_port, is_master=False,
                          timeout=datetime.timedelta(seconds=max(spec.timeout_s, 30.0)))
    gen_store = dist.PrefixStore(f"gen{spec.generation}", store)
    try:
        _run(spec, gen_store, store)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # skip interpreter teardown of gloo's threads (seconds); everything is flushed and closed
    except BaseException as exc:  # report every failure, including a KeyboardInterrupt/SystemExit, then exit 1
        comm = is_comm_error(exc)
        record = {"type": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else "",
                  "comm": comm, "time": time.time(), "traceback": traceback.format_exc()}
        try:
            gen_store.set(error_key(spec.rank), json.dumps(record))
        except Exception:
            pass
        if not comm:
            traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)  # skip interpreter teardown: a broken process group can hang in its destructor


def _run(spec: WorkerSpec, gen_store: dist.Store, root_store: dist.Store) -> None:
    config = spec.config
    plan = Plan.from_json(spec.plan_json)
    replica, stage = plan.worker(spec.rank)
    S = plan.num_stages
    training, workload = config.training, config.workload
    device = torch.device(f"cuda:{spec.device_index}") if spec.backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = DTYPES[training.dtype]

    built = build_stage(config, stage, spec.model_factory)
    module, layers = built.module.to(device), built.layout
    optimizer = make_optimizer(module, training.lr, training.weight_decay)
    if spec.resume_dir:
        checkpoint.load_stage(spec.resume_dir, spec.start_step, stage, layers, module, optimizer)
    dataset = load_dataset(training.dataset, workload.seq_len, base_dir=os.path.dirname(config.source) or None)

    def load(iteration: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        return microbatch(dataset, iteration, mb, workload.microbatch_size, workload.seq_len)

    stage_ranks = {s: [plan.rank(p, s) for p in plan.live_replicas(s)] for s in range(S)}
    transport = Transport(root_store, spec.generation, spec.rank, plan.live_ranks(), stage_ranks, spec.timeout_s,
                          spec.backend, device)
    executor = StageExecutor(plan, spec.rank, module, optimizer, transport, load,
                             built.input_shape, built.output_shape, dtype,
                             grad_clip=training.grad_clip, seed=training.seed, device=device,
                             record_timings=spec.record_timings)
    if spec.emulation is not None:
        install_pacing(executor, config, spec.emulation)
    if spec.fault is not None:
        _arm_fault(executor, spec.fault)
    writer = replica == plan.live_replicas(stage)[0]  # one replica per stage writes stage files
    for step in range(spec.start_step, spec.end_step):
        cpu0 = time.process_time()
        result = executor.run_iteration(step)
        cpu_s = time.process_time() - cpu0  # all threads of this process, gloo's included
        done = step + 1
        saved = False
        if writer and spec.checkpoint_dir and spec.checkpoint_every > 0 and done % spec.checkpoint_every == 0:
            checkpoint.save_stage(spec.checkpoint_dir, done, stage, layers, module, optimizer)
            saved = True
        gen_store.set(metrics_key(step, spec.rank), json.dumps({
            "start": result.start, "end": result.end, "loss_sum": result.loss_sum, "grad_norm": result.grad_norm,
            "checkpointed": saved, "replica": replica, "stage": stage, "cpu_s": cpu_s,
            "digest": parameter_digest(module) if spec.verify_replicas else "",
            "timings": [[t.action, t.start, t.end] for t in result.timings],
        }))
    if writer and spec.save_path:
        checkpoint.atomic_torch_save({k: v.detach().cpu() for k, v in module.state_dict().items()},
                                     checkpoint.part_file(spec.save_path, stage))
    transport.flush()
    transport.barrier()  # nobody tears its connections down while a peer may still be talking to it
    transport.close()


def _arm_fault(executor: StageExecutor, fault: FaultInjection) -> None:
    """Wrap run_action so the fault fires exactly at (step, action index)."""
    original = executor.run_action

    def run_action(action):  # type: ignore[no-untyped-def]
        progress = executor.progress
        if progress.iteration == fault.step and progress.index == fault.index:
            if fault.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.mode == "freeze":
                os.kill(os.getpid(), signal.SIGSTOP)  # if ever continued, carry on as a slow worker would
            else:
                raise ValueError(f"injected fault at step {fault.step}, action {fault.index} ({action})")
        original(action)

    executor.run_action = run_action  # type: ignore[method-assign]
