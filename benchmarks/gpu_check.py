"""The prepared GPU check (`make gpu-check`): one command for any CUDA machine that prints ONE JSON summary on
stdout (progress on stderr) and finishes in under 5 minutes. Without CUDA it prints {"skipped": "no CUDA device", ...}
and exits 0.

Parts, each in its own process under a hard timeout, so a hang or crash of one is reported as {"error": ...} for it:
  nccl_cycles           NCCL init (device_id, recycle's NCCL environment), all-reduce on the world and a new_group,
                        _abort_process_group, re-init on a fresh store prefix: 5 cycles at world size 1, timed
  kill                  (2+ GPUs) 2 NCCL ranks all-reducing; rank 1 SIGKILLed; rank 0's watcher thread aborts its
                        groups; the time from the kill until rank 0's blocked main thread is released, and a re-init
  executor              recycle's StageExecutor on the device (every worker a thread, in-memory transport): a
                        fault-free and a re-routed plan (worker 1:1 down), float64, against the CPU reference
  bf16                  the project's GPT under recycle's bf16 autocast recipe: finite loss and gradients
  decoupled             one GPT layer (hidden 2048 and 4096, 8 x 1024 tokens): fused backward vs B (input grad,
                        retain_graph) + W (weight grads) exactly as the executor runs them; ratio (B+W)/fused
  nccl_cycles_blocking  nccl_cycles with TORCH_NCCL_USE_COMM_NONBLOCKING=0 (to compare the two init modes)

Run: .venv/bin/python benchmarks/gpu_check.py [--budget-s 280] [--device cpu]
`--device cpu` is a dry run of every part on gloo and CPU at small sizes (the unit tests use it). Exit status: 0
when every part passed (or the check was skipped), 1 when some part failed or reported an error ("failed" lists
them).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path
from queue import Queue
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
MARK = "GPU_CHECK_RESULT "  # the line a part process prints its result on (NCCL_DEBUG also writes to stdout)
STORE_HOST = "127.0.0.1"


def _log(text: str) -> None:
    print(f"[gpu-check] {text}", file=sys.stderr, flush=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _error(exc: BaseException) -> dict[str, Any]:
    tail = traceback.format_exception(type(exc), exc, exc.__traceback__)[-3:]
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "where": "".join(tail)[-1500:]}


# -- (a) the executor on the device ----------------------------------------------------------------------------------
class _Hub:
    """In-memory transport shared by the worker threads: one FIFO per ordered pair, rank-ordered SUM all-reduces
    (tensors stay on the device)."""

    def __init__(self, plan: Any) -> None:
        self.queues: dict[tuple[int, int], Queue] = defaultdict(Queue)
        self.lock = threading.Lock()
        self.groups = {("world",): plan.live_ranks()}
        for s in range(plan.num_stages):
            self.groups[("stage", s)] = [plan.rank(p, s) for p in plan.live_replicas(s)]
        self.barriers = {k: threading.Barrier(len(v), timeout=60) for k, v in self.groups.items()}
        self.slots: dict[tuple, dict[int, torch.Tensor]] = defaultdict(dict)

    def allreduce(self, key: tuple, rank: int, count: int, tensor: torch.Tensor) -> None:
        with self.lock:
            self.slots[(key, count)][rank] = tensor.clone()
        self.barriers[key].wait()
        parts = self.slots[(key, count)]
        total = parts[min(parts)].clone()
        for r in sorted(parts)[1:]:
            total += parts[r]
        tensor.copy_(total)
        self.barriers[key].wait()


class _ThreadComm:
    """The executor's Comm over a _Hub."""

    def __init__(self, hub: _Hub, rank: int, device: torch.device) -> None:
        self.hub, self.rank, self.device = hub, rank, device
        self.counts: dict[tuple, int] = defaultdict(int)

    def send(self, message: Any, tensor: torch.Tensor) -> None:
        self.hub.queues[(message.src, message.dst)].put((message, tensor.detach().clone()))

    def recv(self, message: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        got, tensor = self.hub.queues[(message.src, self.rank)].get(timeout=60)
        if got != message or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise RuntimeError(f"rank {self.rank} expected {message} {shape} {dtype}, got {got} "
                               f"{tuple(tensor.shape)} {tensor.dtype}")
        return tensor

    def flush(self) -> None:
        pass

    def _reduce(self, key: tuple, tensor: torch.Tensor) -> None:
        self.counts[key] += 1
        self.hub.allreduce(key, self.rank, self.counts[key], tensor)

    def stage_allreduce_sum(self, stage: int, tensor: torch.Tensor) -> None:
        self._reduce(("stage", stage), tensor)

    def world_allreduce_sum(self, tensor: torch.Tensor) -> None:
        self._reduce(("world",), tensor)

    def barrier(self) -> None:
        self.world_allreduce_sum(torch.zeros(1, device=self.device))


def _train_in_threads(config: Any, plan: Any, device: torch.device) -> tuple[dict[int, torch.nn.Module], list]:
    """Train `plan` with every live worker on a thread on `device`; (rank -> stage module, per-rank results)."""
    from recycle.models.gpt import build_stages
    from recycle.runtime.state.optim import make_optimizer
    from recycle.runtime.state.precision import weights_dtype
    from recycle.runtime.worker.data import data_source
    from recycle.runtime.worker.executor import StageExecutor

    training, workload = config.training, config.workload
    load = data_source(config)
    hub = _Hub(plan)
    modules: dict[int, torch.nn.Module] = {}
    results: dict[int, list] = {}
    errors: list[tuple[int, BaseException]] = []

    def work(rank: int) -> None:
        try:
            _, stage = plan.worker(rank)
            module = build_stages(config.model, plan.num_stages, training.seed, weights_dtype(training.dtype),
                                  workload.seq_len)[stage].to(device)
            modules[rank] = module
            shape = module.boundary_shape(workload.microbatch_size, workload.seq_len)
            executor = StageExecutor(
                plan, rank, module, make_optimizer(module, training), _ThreadComm(hub, rank, device),
                load,
                shape, shape, next(module.parameters()).dtype, grad_clip=training.grad_clip, seed=training.seed,
                device=device, precision=training.dtype)
            results[rank] = [executor.run_iteration(step) for step in range(training.steps)]
            _sync(device)
        except BaseException as exc:  # reported by the caller
            errors.append((rank, exc))
            for barrier in hub.barriers.values():
                barrier.abort()

    threads = [threading.Thread(target=work, args=(r,), daemon=True) for r in plan.live_ranks()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        rank, exc = errors[0]
        raise RuntimeError(f"worker rank {rank}: {type(exc).__name__}: {exc}") from exc
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a worker thread did not finish within 120 s")
    return modules, [results[r] for r in sorted(results)]


def check_executor(device: str = "cuda", steps: int = 3) -> dict[str, Any]:
    """A fault-free and a re-routed plan on `device`, float64, compared with the single-process CPU reference.

    SGD with momentum, not AdamW: a gradient that is zero in exact arithmetic (the attention key bias) is rounding
    noise that differs between CUDA and CPU kernels, and Adam's normalisation turns any such noise into a step of
    lr; SGD keeps it at noise size, so the comparison across devices can be tight."""
    from recycle.config import parse_config
    from recycle.planner.api import make_plan
    from recycle.planner.options import PlannerOptions
    from recycle.runtime.tools.reference import reference_train
    from recycle.schedules.fault_free import build_schedule

    dev = torch.device(device)
    config = parse_config({
        "topology": {"num_replicas": 2, "num_stages": 2},
        "workload": {"num_microbatches": 4, "microbatch_size": 2, "seq_len": 32},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"preset": "tiny"},
        "training": {"steps": steps, "lr": 0.1, "weight_decay": 0.0, "dtype": "float64", "seed": 7,
                     "optimizer": "SGD", "momentum": 0.9},
    }, name="gpu-check")
    ref, ref_losses = reference_train(config)
    plans = {
        "fault_free_zb_h1": build_schedule(config, "zb-h1", staggered=True),
        "rerouted_1_1_down": make_plan(config, frozenset({(1, 1)}),
                                       options=PlannerOptions(decoupled=True, staggered=True), solver="heuristic"),
    }
    threads = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)  # one intra-op thread per worker thread, as a worker process has
    out: dict[str, Any] = {"device": str(dev), "dtype": "float64", "steps": steps,
                           "reference_losses": [round(x, 6) for x in ref_losses]}
    try:
        for name, plan in plans.items():
            t0 = time.perf_counter()
            modules, results = _train_in_threads(config, plan, dev)
            wall = time.perf_counter() - t0
            err, identical = 0.0, True
            for s in range(plan.num_stages):
                replicas = [modules[plan.rank(p, s)] for p in plan.live_replicas(s)]
                states = [{k: v.detach().cpu() for k, v in m.state_dict().items()} for m in replicas]
                identical &= all(torch.equal(states[0][k], other[k]) for other in states[1:] for k in states[0])
                for key, value in states[0].items():
                    scale = ref[key].abs().max().clamp_min(1e-12)
                    err = max(err, float((value - ref[key]).abs().max() / scale))
            periods = [max(r[i].end for r in results) - min(r[i].start for r in results)
                       for i in range(steps)]
            out[name] = {"live_workers": len(plan.live_ranks()), "failed": sorted(plan.failed),
                         "max_rel_err_vs_cpu_reference": err, "replicas_bit_identical": bool(identical),
                         "step_s": [round(p, 4) for p in periods], "wall_s": round(wall, 3)}
    finally:
        torch.set_num_threads(threads)
    out["matches_reference"] = all(out[n]["max_rel_err_vs_cpu_reference"] < 1e-9
                                   and out[n]["replicas_bit_identical"] for n in plans)
    return out


# -- (b) bf16 autocast -----------------------------------------------------------------------------------------------
def check_bf16(device: str = "cuda", preset: str = "gpt2", batch: int = 8, seq: int = 512) -> dict[str, Any]:
    """The project's GPT forward + backward under recycle's "bfloat16" recipe (bf16 autocast over float32 weights)."""
    from recycle.config import ModelSpec
    from recycle.data import builtin_windows
    from recycle.models.gpt import full_model
    from recycle.runtime.state.precision import autocast

    dev = torch.device(device)
    model = full_model(ModelSpec(preset=preset), seq, seed=0, dtype="float32").to(dev)
    tokens, targets = (t.to(dev) for t in builtin_windows(batch, seq)(0, 0))
    seen: list[torch.dtype] = []
    first_linear = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    hook = first_linear.register_forward_hook(lambda _m, _i, output: seen.append(output.dtype))
    losses = {}
    grads_finite = {}
    times = {}
    for recipe in ("bfloat16", "float32"):
        model.zero_grad(set_to_none=True)
        _sync(dev)
        t0 = time.perf_counter()
        with autocast(recipe, dev):
            loss = model(tokens, targets)
        loss.backward()
        _sync(dev)
        times[recipe] = round(time.perf_counter() - t0, 4)
        losses[recipe] = float(loss.detach())
        grads_finite[recipe] = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()
                                   if p.grad is not None)
    hook.remove()
    rel = abs(losses["bfloat16"] - losses["float32"]) / max(abs(losses["float32"]), 1e-12)
    return {"device": str(dev), "preset": preset, "tokens": batch * seq, "loss": losses,
            "loss_rel_diff_bf16_vs_fp32": rel, "grads_finite": grads_finite,
            "autocast_matmul_dtype": str(seen[0]) if seen else None, "fwd_bwd_s": times,
            "ok": all(math.isfinite(v) for v in losses.values()) and all(grads_finite.values())
            and bool(seen) and seen[0] == torch.bfloat16 and rel < 0.05}


# -- (c) the decoupled backward's cost -------------------------------------------------------------------------------
def _median_ms(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e3, 3)


def check_decoupled(device: str = "cuda", widths: tuple[int, ...] = (2048, 4096), batch: int = 8, seq: int = 1024,
                    repeats: int = 10, warmup: int = 3, recipes: tuple[str, ...] = ("bfloat16", "float32"),
                    head_dim: int = 128) -> dict[str, Any]:
    """One GPT layer as a middle stage: fused backward (BW) against B then W, with the executor's own calls
    (StageExecutor.backward_input's autograd.grad with retain_graph, _backward_into_grad for W and BW)."""
    from recycle.models.gpt import Block, GPTShape
    from recycle.runtime.state.precision import autocast
    from recycle.runtime.worker.executor import StageExecutor

    dev = torch.device(device)
    out: dict[str, Any] = {"device": str(dev), "tokens": batch * seq, "batch": batch, "seq": seq,
                           "repeats": repeats}
    for width in widths:
        for recipe in recipes:
            key = f"hidden_{width}_{recipe}"
            try:
                out[key] = _decoupled_one(dev, width, batch, seq, repeats, warmup, recipe, max(1, width // head_dim),
                                          Block, GPTShape, StageExecutor, autocast)
            except torch.cuda.OutOfMemoryError as exc:
                out[key] = {"error": f"out of memory: {exc}"[:300]}
            finally:
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
    return out


def _decoupled_one(dev: torch.device, width: int, batch: int, seq: int, repeats: int, warmup: int, recipe: str,
                   heads: int, Block: Any, GPTShape: Any, StageExecutor: Any, autocast: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    block = Block(GPTShape(vocab_size=256, n_layer=1, n_head=heads, n_embd=width, block_size=seq)).to(dev)
    params = [p for p in block.parameters() if p.requires_grad]
    x = torch.randn(batch, seq, width, device=dev)
    grad_out = torch.randn(batch, seq, width, device=dev)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        inp = x.detach().clone().requires_grad_()  # a received activation: the stage input leaf
        with autocast(recipe, dev):
            result = block(inp)
        if result.dtype != torch.float32:
            result = result.to(torch.float32)  # the executor sends the boundary in the weights' dtype
        return inp, result

    fused, b_times, w_times = [], [], []
    worst: float | None = None
    for i in range(warmup + repeats):
        block.zero_grad(set_to_none=True)
        inp, result = forward()
        _sync(dev)
        t0 = time.perf_counter()
        StageExecutor._backward_into_grad(result, grad_out, [inp, *params])  # BW
        _sync(dev)
        t1 = time.perf_counter()
        if i >= warmup:
            fused.append(t1 - t0)
        fused_grads = [inp.grad.detach().clone(), *(p.grad.detach().clone() for p in params)] if i == 0 else None

        block.zero_grad(set_to_none=True)
        inp, result = forward()
        _sync(dev)
        t0 = time.perf_counter()
        (grad_in,) = torch.autograd.grad(result, [inp], grad_out, retain_graph=True)  # B (executor.backward_input)
        _sync(dev)
        t1 = time.perf_counter()
        StageExecutor._backward_into_grad(result, grad_out, params)  # W (executor.backward_weight)
        _sync(dev)
        t2 = time.perf_counter()
        if i >= warmup:
            b_times.append(t1 - t0)
            w_times.append(t2 - t1)
        if fused_grads is not None:
            split = [grad_in, *(p.grad for p in params)]
            worst = max(float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
                        for a, b in zip(split, fused_grads))
    peak = torch.cuda.max_memory_allocated(dev) / 2 ** 30 if dev.type == "cuda" else None
    f, b, w = _median_ms(fused), _median_ms(b_times), _median_ms(w_times)
    return {"recipe": recipe, "hidden": width, "heads": heads,
            "parameters": sum(p.numel() for p in params), "fused_ms": f, "b_ms": b, "w_ms": w,
            "ratio_b_plus_w_over_fused": round((b + w) / f, 4) if f > 0 else None,
            "split_vs_fused_grad_max_rel_diff": worst, "peak_gib": round(peak, 2) if peak is not None else None}


# -- (d) init / abort / re-init cycles -------------------------------------------------------------------------------
def _prepare_env(backend: str, timeout_s: float) -> dict[str, Any]:
    """recycle's NCCL environment and version gate, as a worker applies them before its first group."""
    from recycle.errors import ConfigError
    from recycle.runtime.worker.nccl_env import apply_nccl_environment, check_nccl_version, nccl_version

    if backend != "nccl":
        return {"nccl_version": None, "gate": "not nccl", "env_set": []}
    version = nccl_version()
    gate = "ok"
    if version is None:
        gate = "torch reports no NCCL version"
    else:
        try:
            check_nccl_version(version)
        except ConfigError as exc:
            gate = str(exc)  # measured anyway: the numbers tell whether the rule is still needed
    changed = apply_nccl_environment(os.environ, timeout_s, version)
    keys = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_USE_COMM_NONBLOCKING", "TORCH_NCCL_NONBLOCKING_TIMEOUT",
            "TORCH_NCCL_ENABLE_MONITORING", "NCCL_NVLS_ENABLE")
    return {"nccl_version": list(version) if version else None, "gate": gate, "env_set": changed,
            "env": {k: os.environ.get(k) for k in keys}}


def check_cycles(backend: str = "nccl", device: str = "cuda:0", cycles: int = 5, timeout_s: float = 20.0,
                 nonblocking: str | None = None) -> dict[str, Any]:
    """World size 1: init (eager, device_id) -> all-reduce on the world and on a new_group -> _abort_process_group
    -> the next generation on a fresh PrefixStore of the same TCPStore, `cycles` times."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    from recycle.runtime.worker.nccl_env import init_kwargs

    if nonblocking is not None:
        os.environ["TORCH_NCCL_USE_COMM_NONBLOCKING"] = nonblocking  # a user's value: kept by apply_nccl_environment
    out: dict[str, Any] = {"backend": backend, "device": device, **_prepare_env(backend, timeout_s)}
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(STORE_HOST, 0, 1, is_master=True, wait_for_workers=False, timeout=timeout)
    records = []
    for k in range(cycles):
        record: dict[str, Any] = {"cycle": k}
        try:
            t0 = time.perf_counter()
            dist.init_process_group(backend, store=dist.PrefixStore(f"gpu-check/gen{k}/", store), rank=0,
                                    world_size=1, timeout=timeout, **init_kwargs(dev, backend))
            t1 = time.perf_counter()
            group = dist.new_group([0], timeout=timeout)  # as Transport makes its stage groups
            tensor = torch.full((1 << 20,), float(k + 1), device=dev)
            dist.all_reduce(tensor)
            dist.all_reduce(tensor, group=group)
            _sync(dev)
            t2 = time.perf_counter()
            if not bool((tensor == float(k + 1)).all()):
                raise RuntimeError(f"all-reduce at world size 1 changed the tensor in cycle {k}")
            _abort_process_group()
            t3 = time.perf_counter()
            record.update(init_s=round(t1 - t0, 4), group_and_collectives_s=round(t2 - t1, 4),
                          abort_s=round(t3 - t2, 4), initialized_after_abort=dist.is_initialized())
            if dist.is_initialized():
                dist.destroy_process_group()
        except BaseException as exc:
            record.update(_error(exc))
            records.append(record)
            break
        records.append(record)
    out["cycles"] = records
    out["all_cycles_ok"] = len(records) == cycles and not any("error" in r for r in records)
    if out["all_cycles_ok"]:
        for field in ("init_s", "group_and_collectives_s", "abort_s"):
            out[f"median_{field}"] = round(statistics.median(r[field] for r in records), 4)
    return out


# -- (e) a SIGKILLed peer: the survivor aborts from its watcher thread -----------------------------------------------
def kill_worker(rank: int, port: int, backend: str, device: str, timeout_s: float, release_wait_s: float) -> None:
    """One of the two ranks of check_kill; rank 0 prints its result (MARK line) and exits with os._exit."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _abort_process_group

    from recycle.runtime.worker.nccl_env import init_kwargs

    env = _prepare_env(backend, timeout_s)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(STORE_HOST, port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=dist.PrefixStore("gpu-check/kill/gen0/", store), rank=rank,
                            world_size=2, timeout=timeout, **init_kwargs(dev, backend))
    tensor = torch.ones(1 << 22, device=dev)
    dist.all_reduce(tensor)
    _sync(dev)
    store.set(f"ready/{rank}", "1")
    if rank == 1:
        while True:  # until SIGKILLed
            dist.all_reduce(tensor)
            _sync(dev)
    state: dict[str, Any] = {"env": env}
    released, aborted = threading.Event(), threading.Event()

    def report_and_exit(code: int) -> None:
        print(MARK + json.dumps(dict(state), default=str), flush=True)
        os._exit(code)

    def give_up() -> None:  # the abort call itself did not return, or did not release the main thread
        state.setdefault("error", f"{'main thread not released' if 't_abort_done' in state else 'abort did not return'}"
                                  f" {release_wait_s:.0f} s after the abort started")
        report_and_exit(3)

    def watcher() -> None:
        while not store.check(["abort"]):
            time.sleep(0.005)
        state["t_abort_seen"] = time.time()
        deadline = threading.Timer(release_wait_s, give_up)
        deadline.daemon = True
        deadline.start()
        try:
            _abort_process_group()  # every group of this generation, from this thread, as recovery must
        except BaseException as exc:
            state["abort_error"] = f"{type(exc).__name__}: {exc}"[:500]
        state["t_abort_done"] = time.time()
        aborted.set()
        if released.wait(release_wait_s):
            deadline.cancel()

    threading.Thread(target=watcher, daemon=True).start()
    ops = 0
    try:
        while True:
            dist.all_reduce(tensor)
            _sync(dev)  # the main thread blocks here (GIL released) once the peer is gone
            ops += 1
            if aborted.is_set():
                state["released_by"] = "returned after the abort"
                break
    except BaseException as exc:
        state["released_by"] = f"{type(exc).__name__}: {exc}"[:500]
    state["t_released"] = time.time()
    state["ops_before_release"] = ops
    released.set()
    if not aborted.wait(release_wait_s):  # gloo may raise before the abort key arrives: let the watcher finish
        state["error"] = "the watcher thread did not finish its abort"
        report_and_exit(4)
    try:  # the next generation: a world of the survivor alone, on a fresh prefix (pitfall: pytorch#151159)
        t0 = time.perf_counter()
        dist.init_process_group(backend, store=dist.PrefixStore("gpu-check/kill/gen1/", store), rank=0,
                                world_size=1, timeout=timeout, **init_kwargs(dev, backend))
        again = torch.ones(4, device=dev)
        dist.all_reduce(again)
        _sync(dev)
        state["reinit_s"] = round(time.perf_counter() - t0, 4)
        state["reinit_ok"] = bool((again == 1).all())
        _abort_process_group()
    except BaseException as exc:
        state["reinit_ok"] = False
        state["reinit_error"] = f"{type(exc).__name__}: {exc}"[:500]
    report_and_exit(0)


def check_kill(backend: str = "nccl", devices: tuple[str, str] = ("cuda:0", "cuda:1"), timeout_s: float = 20.0,
               release_wait_s: float = 15.0, start_wait_s: float = 50.0) -> dict[str, Any]:
    """Two ranks all-reduce; rank 1 is SIGKILLed and the abort key set at once (a coordinator's detection is not
    measured here); rank 0's watcher thread aborts its groups; reports the kill -> release time."""
    import tempfile

    import torch.distributed as dist

    store = dist.TCPStore(STORE_HOST, 0, 3, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=start_wait_s))
    with tempfile.TemporaryDirectory(prefix="gpu-check-kill-") as tmp:
        logs = [(open(Path(tmp) / f"rank{r}.out", "w+"), open(Path(tmp) / f"rank{r}.err", "w+")) for r in (0, 1)]
        procs = [subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--kill-worker", str(rank),
                                   "--port", str(store.port), "--backend", backend, "--device", devices[rank],
                                   "--timeout-s", str(timeout_s), "--release-wait-s", str(release_wait_s)],
                                  stdout=logs[rank][0], stderr=logs[rank][1], text=True)
                 for rank in (0, 1)]
        try:
            deadline = time.monotonic() + start_wait_s
            while not store.check(["ready/0", "ready/1"]):
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError("the two ranks did not both start: " + "; ".join(
                        f"rank {r} rc={p.poll()}" for r, p in enumerate(procs)))
                time.sleep(0.05)
            time.sleep(0.5)  # both ranks inside their all-reduce loops
            t_kill = time.time()
            procs[1].send_signal(signal.SIGKILL)
            store.set("abort", str(t_kill))
            procs[0].wait(release_wait_s + timeout_s + 10)
            procs[1].wait(10)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(10)
            texts = []
            for out_file, err_file in logs:
                out_file.seek(0)
                err_file.seek(0)
                texts.append((out_file.read(), err_file.read()))
                out_file.close()
                err_file.close()
    out, err = texts[0]
    sys.stderr.write(err)
    lines = [line[len(MARK):] for line in out.splitlines() if line.startswith(MARK)]
    if not lines:
        return {"error": f"rank 0 exited with {procs[0].returncode} and no result", "stderr_tail": err[-1500:]}
    state = json.loads(lines[-1])
    result: dict[str, Any] = {"backend": backend, "survivor_rc": procs[0].returncode,
                              "killed_rc": procs[1].returncode, **state}
    if "t_released" in state:
        result["kill_to_release_s"] = round(state["t_released"] - t_kill, 4)
    if "t_abort_done" in state and "t_abort_seen" in state:
        result["abort_call_s"] = round(state["t_abort_done"] - state["t_abort_seen"], 4)
    result["survivor_stack_trace_on_stderr"] = "Traceback" in err
    return result


# -- the driver ------------------------------------------------------------------------------------------------------
def _parts(device: str, gpus: int) -> list[tuple[str, float, Callable[[], dict[str, Any]]]]:
    """(name, timeout s, call) of every part, in the order they run: the NCCL unknowns first."""
    if device == "cpu":  # the dry run: gloo on CPU, small sizes
        return [
            ("nccl_cycles", 60, lambda: check_cycles("gloo", "cpu", cycles=5)),
            ("kill", 90, lambda: check_kill("gloo", ("cpu", "cpu"))),
            ("executor", 90, lambda: check_executor("cpu", steps=2)),
            ("bf16", 60, lambda: check_bf16("cpu", preset="tiny", batch=2, seq=32)),
            ("decoupled", 60, lambda: check_decoupled("cpu", widths=(64,), batch=2, seq=32, repeats=3, warmup=1,
                                                      recipes=("float32",), head_dim=32)),
            ("nccl_cycles_blocking", 10, lambda: {"skipped": "gloo has no non-blocking init mode"}),
        ]
    return [
        ("nccl_cycles", 60, lambda: check_cycles("nccl", "cuda:0")),
        ("kill", 90, (lambda: check_kill("nccl", ("cuda:0", "cuda:1"))) if gpus >= 2 else
         (lambda: {"skipped": f"needs 2 GPUs, found {gpus}"})),
        ("executor", 75, lambda: check_executor("cuda:0")),
        ("bf16", 45, lambda: check_bf16("cuda:0", preset="gpt2", batch=8, seq=512)),
        ("decoupled", 90, lambda: check_decoupled("cuda:0")),
        ("nccl_cycles_blocking", 45, lambda: check_cycles("nccl", "cuda:0", nonblocking="0")),
    ]


# The field of each part's result that says it passed (a part without one passes when it has no "error").
_PASS = {"nccl_cycles": "all_cycles_ok", "nccl_cycles_blocking": "all_cycles_ok", "kill": "reinit_ok",
         "executor": "matches_reference", "bf16": "ok"}


def _run_part(name: str, device: str, timeout_s: float) -> dict[str, Any]:
    """Run one part in its own process group under a hard timeout; its result, or {"error": ...}."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", name, "--device", device]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the part and anything it started (the kill part's ranks)
        out, err = proc.communicate()
        sys.stderr.write(err)
        return {"error": f"timed out after {timeout_s:.0f} s (killed)", "stderr_tail": err[-1500:]}
    sys.stderr.write(err)
    lines = [line[len(MARK):] for line in out.splitlines() if line.startswith(MARK)]
    if not lines:
        return {"error": f"exited with {proc.returncode} and no result", "stderr_tail": err[-1500:]}
    return json.loads(lines[-1])


def _environment() -> dict[str, Any]:
    from recycle.errors import ConfigError
    from recycle.runtime.worker.nccl_env import check_nccl_version, nccl_version

    version = nccl_version()
    info: dict[str, Any] = {"torch": torch.__version__, "cuda_build": torch.version.cuda,
                            "nccl": list(version) if version else None}
    if version is not None:
        try:
            check_nccl_version(version)
            info["nccl_gate"] = "ok"
        except ConfigError as exc:
            info["nccl_gate"] = str(exc)
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--budget-s", type=float, default=280.0, help="wall-clock budget for all parts")
    parser.add_argument("--part", help=argparse.SUPPRESS)
    parser.add_argument("--kill-worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="nccl", help=argparse.SUPPRESS)
    parser.add_argument("--timeout-s", type=float, default=20.0, help=argparse.SUPPRESS)
    parser.add_argument("--release-wait-s", type=float, default=15.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.kill_worker is not None:  # a rank of the kill part
        kill_worker(args.kill_worker, args.port, args.backend, args.device, args.timeout_s, args.release_wait_s)
        return 0
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.part is not None:  # one part, in its own process: one MARK line, then exit without destructors
        table = {name: call for name, _, call in _parts(args.device, gpus)}
        try:
            result = table[args.part]()
        except BaseException as exc:
            result = _error(exc)
        print(MARK + json.dumps(result, default=str), flush=True)
        sys.stderr.flush()
        os._exit(0)

    if args.device == "cuda" and gpus == 0:
        print(json.dumps({"skipped": "no CUDA device", **_environment()}))
        return 0
    start = time.monotonic()
    summary: dict[str, Any] = {"gpu_check": 1, "device": args.device, **_environment(), "parts": {}}
    for name, timeout_s, _ in _parts(args.device, gpus):
        left = args.budget_s - (time.monotonic() - start)
        if left < 10:
            summary["parts"][name] = {"error": f"not run: the {args.budget_s:.0f} s budget was used up"}
            continue
        _log(f"{name}: running (hard timeout {min(timeout_s, left):.0f} s)")
        t0 = time.monotonic()
        result = _run_part(name, args.device, min(timeout_s, left))
        result.setdefault("part_s", round(time.monotonic() - t0, 2))
        summary["parts"][name] = result
        _log(f"{name}: {'ERROR ' + result['error'][:200] if 'error' in result else 'done'} in {result['part_s']} s")
    summary["wall_s"] = round(time.monotonic() - start, 2)
    summary["failed"] = sorted(name for name, part in summary["parts"].items()
                               if "error" in part or ("skipped" not in part and name in _PASS
                                                      and part.get(_PASS[name]) is not True))
    summary["ok"] = not summary["failed"]
    print(json.dumps(summary, default=str))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
