"""Profiler: measures the real model's per-stage action times, memory and message sizes, and gloo p2p/all-reduce
costs on this machine, and writes them as a complete microsecond config that the planner and simulator read."""

from __future__ import annotations

import datetime
import math
import multiprocessing as mp
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from recycle.config import Config, parse_config
from recycle.errors import ConfigError
from recycle.fileio import atomic_write_text
from recycle.ir import Action, Kind, Plan
from recycle.models.checkpointing import mode_of, regions, set_mode
from recycle.models.gpt import build_stages
from recycle.models.split import boundary_shapes
from recycle.runtime.protocol.messages import Channel
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.precision import weights_dtype
from recycle.runtime.tools.fakes import LoneComm
from recycle.runtime.worker.data import BUILTIN, data_source
from recycle.runtime.worker.executor import StageExecutor

__all__ = ["StageProfile", "CommProfile", "Profile", "DEFAULT_COMM", "profile_stages", "measure_comm",
           "profile_config", "profiled_config_dict", "to_toml", "write_profile"]


@dataclass(frozen=True)
class StageProfile:
    """One stage's measured costs: medians in microseconds, sizes in bytes."""

    forward_us: float
    backward_input_us: float  # B as the executor runs it (stage 0 only takes delivery of the output-gradient)
    backward_weight_us: float  # W after B (the graph is kept between them)
    backward_fused_us: float  # BW: input- and weight-gradient in one pass
    optimizer_us: float  # the executor's OPT without the all-reduce's transfer (measured separately): flatten the
    # gradients, the norm (or clipping), the roll-back snapshot, the optimizer step, zero the gradients
    activation_bytes: int  # what a micro-batch holds from F to W: saved tensors, stage input/output, output-grad
    # (with activation checkpointing: only what the checkpointed regions keep, their inputs)
    message_bytes: int  # the stage output sent downstream (0 on the last stage)
    parameter_bytes: int
    optimizer_state_bytes: int
    recompute_bytes: int = 0  # with activation checkpointing: the largest region's activations, rebuilt in B and W


@dataclass(frozen=True)
class CommProfile:
    """Linear cost models in microseconds and bytes per microsecond (0 bandwidth = free transfer)."""

    p2p_latency_us: float
    p2p_bandwidth: float  # bytes per us
    allreduce_latency_us: float  # per ring step
    allreduce_bandwidth: float  # bytes per us
    source: str  # "measured (2 gloo processes, loopback)" or "defaults"


# From /work/shared/reference/measured-here.md section 1: 1 MB one-way in about 0.9 ms over gloo loopback
# (about 1.1 GB/s); the latency is an order of magnitude for a small loopback message.
DEFAULT_COMM = CommProfile(p2p_latency_us=50.0, p2p_bandwidth=1100.0, allreduce_latency_us=50.0,
                           allreduce_bandwidth=1100.0, source="defaults (measured-here.md: ~1.1 GB/s loopback)")


@dataclass(frozen=True)
class Profile:
    stages: tuple[StageProfile, ...]
    comm: CommProfile
    repeats: int
    warmup: int
    threads: int


def _median_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


# What one profiling iteration runs on every stage: micro-batch 0 as B then W (the graph kept between them),
# micro-batch 1 as a fused BW, then the optimizer step.
_ACTIONS = ((Kind.F, 0), (Kind.B, 0), (Kind.W, 0), (Kind.F, 1), (Kind.BW, 1), (Kind.OPT, -1))


def _profiling_plan(num_stages: int) -> Plan:
    """One pipeline whose every stage runs _ACTIONS: each stage's executor finds the messages it expects."""
    actions = [[Action(kind, s, mb) for kind, mb in _ACTIONS] for s in range(num_stages)]
    return Plan.from_worker_lists(1, num_stages, 2, actions, staggered=True)


def _activation_bytes(executor: StageExecutor, comm: LoneComm, parameters: list[torch.nn.Parameter]) -> int:
    """Bytes a micro-batch keeps alive between F and W, from one F the executor runs: the tensors autograd saves
    (not the parameters), the stage input and output, and the output-gradient kept from B to W (the size of the
    output)."""
    parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage_key(t)
        if ptr not in parameter_storages and ptr != 0:
            saved[ptr] = nbytes
        return t

    executor.abort_iteration()
    comm.last_received = comm.last_sent = None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        executor.run_action(Action(Kind.F, executor.stage, 0))
    executor.abort_iteration()  # drops the micro-batch's graph
    for t in (comm.last_received, comm.last_sent):
        if t is not None:
            ptr, nbytes = _storage_key(t)
            saved[ptr] = nbytes
    grad_out = _nbytes(comm.last_sent)
    return sum(saved.values()) + grad_out


def _recompute_bytes(executor: StageExecutor, parameters: list[torch.nn.Parameter]) -> int:
    """Bytes the largest checkpointed region of the stage rebuilds inside a B or W (0 without checkpointing): the
    tensors autograd saves in that region (not the parameters), from one F run without checkpointing, which saves
    exactly what the recompute does."""
    module = executor.module
    mode = mode_of(module)
    parts = regions(module, mode)
    if not parts:
        return 0
    parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
    per_region: dict[int, dict[int, int]] = {i: {} for i in range(len(parts))}
    current: list[int] = []  # the region whose forward is running (nested calls: the innermost)

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr, nbytes = _storage_key(t)
        if current and ptr not in parameter_storages and ptr != 0:
            per_region[current[-1]][ptr] = nbytes
        return t

    def enter(index: int) -> Any:
        def hook(*_: Any) -> None:
            current.append(index)
        return hook

    def leave(*_: Any) -> None:  # returns None: a forward hook's result would replace the module's output
        current.pop()

    handles = [h for i, part in enumerate(parts)
               for h in (part.register_forward_pre_hook(enter(i)), part.register_forward_hook(leave))]
    set_mode(module, "none")
    executor.abort_iteration()
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            executor.run_action(Action(Kind.F, executor.stage, 0))
    finally:
        executor.abort_iteration()
        set_mode(module, mode)
        for handle in handles:
            handle.remove()
    return max(sum(saved.values()) for saved in per_region.values())


def profile_stages(config: Config, repeats: int = 10, warmup: int = 3,
                   model_factory: str = "") -> tuple[StageProfile, ...]:
    """Time every stage's F, B, W, BW and optimizer step in this process (one thread, like a worker), as the
    runtime's StageExecutor runs them: each repeat is one executor iteration of _ACTIONS, timed per action. The
    model is the one `recycle train` would train: the built-in GPT, [model] hf_config, or `model_factory`."""
    from recycle.runtime.worker.stage import all_stages

    if repeats < 1 or warmup < 0:
        raise ConfigError(f"--repeats {repeats} must be >= 1 and --warmup {warmup} >= 0")
    training, workload = config.training, config.workload
    S = config.num_stages
    dtype = weights_dtype(training.dtype)
    model, _ = all_stages(config, model_factory)
    stages = list(model.stages)
    shapes = boundary_shapes(stages, workload.microbatch_size, workload.seq_len)
    load = data_source(config)
    plan = _profiling_plan(S)

    out_profiles = []
    for s, module in enumerate(stages):
        module.train()
        is_first, is_last = s == 0, s == S - 1
        params = [p for p in module.parameters() if p.requires_grad]
        input_shape = None if is_first else shapes[s - 1]
        output_shape = None if is_last else shapes[s]
        generator = torch.Generator().manual_seed(s)
        upstream = None if input_shape is None else torch.randn(input_shape, generator=generator, dtype=dtype)
        grad_seed = None if output_shape is None else \
            torch.randn(output_shape, generator=generator, dtype=dtype) * 1e-3
        # Alone: sends and collectives cost nothing here (measure_comm measures them).
        comm = LoneComm({Channel.ACTIVATION: upstream, Channel.GRADIENT: grad_seed})
        optimizer = make_optimizer(module, training)
        executor = StageExecutor(plan, s, module, optimizer, comm, load, input_shape, output_shape, dtype,
                                 grad_clip=training.grad_clip, seed=training.seed, record_timings=True,
                                 precision=training.dtype, loss_fn=model.loss_fn if is_last else None)
        times: dict[Kind, list[float]] = {kind: [] for kind, _ in _ACTIONS}
        for i in range(warmup + repeats):
            result = executor.run_iteration(i)
            if i >= warmup:
                for (kind, _), timing in zip(_ACTIONS, result.timings):
                    times[kind].append(timing.end - timing.start)
        activation = _activation_bytes(executor, comm, params)
        recompute = _recompute_bytes(executor, params)
        parameter_bytes = sum(p.numel() * p.element_size() for p in params)
        # The optimizer's per-parameter state after the steps above (the step counters are not memory that matters).
        state_bytes = sum(t.numel() * t.element_size() for per_param in optimizer.optimizer.state.values()
                          for key, t in per_param.items() if isinstance(t, torch.Tensor) and key != "step")
        out_profiles.append(StageProfile(
            forward_us=_median_us(times[Kind.F]), backward_input_us=_median_us(times[Kind.B]),
            backward_weight_us=_median_us(times[Kind.W]), backward_fused_us=_median_us(times[Kind.BW]),
            optimizer_us=_median_us(times[Kind.OPT]), activation_bytes=activation,
            message_bytes=0 if is_last else _nbytes(comm.last_sent),
            parameter_bytes=parameter_bytes, optimizer_state_bytes=state_bytes, recompute_bytes=recompute))
    return tuple(out_profiles)


# -- communication ------------------------------------------------------------------------------------------------
_SMALL_BYTES = 8
_LARGE_BYTES = 4 << 20


def _comm_worker(rank: int, port: int, token: str, rounds: int, results: Any) -> None:
    """One of two gloo processes: ping-pong and all-reduce at a small and a large size; rank 0 reports medians."""
    from recycle.runtime.protocol.channels import connect_store, new_incarnation, worker_identity

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = connect_store("127.0.0.1", port, token, worker_identity(rank, new_incarnation()), 60.0)
    dist.init_process_group("gloo", store=dist.PrefixStore("profile", store), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    out: dict[str, float] = {}
    for size in (_SMALL_BYTES, _LARGE_BYTES):
        buf = torch.zeros(size // 4, dtype=torch.float32)
        pingpong, reduce = [], []
        for i in range(rounds + 2):  # two warm-up rounds
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
                dist.recv(buf, 1)
            else:
                dist.recv(buf, 0)
                dist.send(buf, 0)
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            dist.all_reduce(buf)
            t3 = time.perf_counter()
            if i >= 2:
                pingpong.append((t1 - t0) / 2)
                reduce.append(t3 - t2)
        out[f"p2p_{size}"] = statistics.median(pingpong) * 1e6
        out[f"allreduce_{size}"] = statistics.median(reduce) * 1e6
    if rank == 0:
        results.put(out)
    dist.destroy_process_group()


def _fit(small_us: float, large_us: float) -> tuple[float, float]:
    """(fixed cost us, bandwidth bytes/us) of a line through the small and large measurements."""
    if large_us <= small_us:
        return max(small_us, 0.0), 0.0
    bandwidth = (_LARGE_BYTES - _SMALL_BYTES) / (large_us - small_us)
    return max(small_us - _SMALL_BYTES / bandwidth, 0.0), bandwidth


def measure_comm(rounds: int = 10, timeout_s: float = 120.0) -> CommProfile:
    """p2p and all-reduce cost between 2 gloo processes on loopback (a few seconds: two interpreters start)."""
    from recycle.runtime.protocol.channels import host_store, new_token

    token = new_token()  # the same authenticated store as a training run's: no other process can disturb it
    store = host_store("127.0.0.1", 0, token)
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [context.Process(target=_comm_worker, args=(r, store.port, token, rounds, results), daemon=True)
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        measured = results.get(timeout=timeout_s)
    except Exception as exc:
        raise ConfigError(f"the communication measurement between 2 gloo processes gave no result in {timeout_s:g} s "
                          f"({type(exc).__name__}); rerun, or pass --comm defaults to use documented "
                          "loopback costs") from None
    finally:
        for p in procs:
            p.join(10)
            if p.exitcode is None:
                p.kill()
                p.join(1)
        store.close()
    p2p_latency, p2p_bandwidth = _fit(measured[f"p2p_{_SMALL_BYTES}"], measured[f"p2p_{_LARGE_BYTES}"])
    # Two processes: a ring all-reduce is 2 steps, each moving half the buffer: T = 2 * latency + size / bandwidth.
    fixed, allreduce_bandwidth = _fit(measured[f"allreduce_{_SMALL_BYTES}"], measured[f"allreduce_{_LARGE_BYTES}"])
    return CommProfile(p2p_latency, p2p_bandwidth, fixed / 2, allreduce_bandwidth,
                       source="measured (2 gloo processes, loopback)")


def profile_config(config: Config, repeats: int = 10, warmup: int = 3, comm: str = "measure",
                   model_factory: str = "") -> Profile:
    """Measure `config`'s model (or `model_factory`'s) on this machine (one thread per worker, as the runtime runs
    it)."""
    if comm not in ("measure", "defaults"):
        raise ConfigError(f"--comm {comm!r} must be 'measure' (2 gloo processes) or 'defaults'")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # workers run with one thread each
    try:
        stages = profile_stages(config, repeats, warmup, model_factory)
    finally:
        torch.set_num_threads(threads)
    comm_profile = measure_comm() if comm == "measure" else DEFAULT_COMM
    return Profile(stages, comm_profile, repeats, warmup, threads=1)


# -- output -------------------------------------------------------------------------------------------------------
def _us(value: float) -> int:
    return int(round(value))


def profiled_config_dict(config: Config, profile: Profile) -> dict[str, Any]:
    """The input config with time_unit "us" and the measured [costs], [memory] and [communication]."""
    raw = config.to_dict()
    st = profile.stages
    raw["time_unit"] = "us"
    raw["name"] = f"{config.name}-profiled"
    raw["costs"] = {
        # A forward must take positive time (the config rule); a sub-microsecond B (stage 0) may round to 0.
        "forward": [max(1, _us(p.forward_us)) for p in st],
        "backward_input": [_us(p.backward_input_us) for p in st],
        "backward_weight": [max(1, _us(p.backward_weight_us)) for p in st],
        "backward_fused": [max(1, _us(p.backward_fused_us)) for p in st],
        "optimizer": [_us(p.optimizer_us) for p in st],
    }
    raw["memory"] = {
        "activation_bytes": [p.activation_bytes for p in st],
        "capacity_bytes": config.memory.capacity_bytes,
        "parameter_bytes": [p.parameter_bytes for p in st],
        "optimizer_state_bytes": [p.optimizer_state_bytes for p in st],
        "recompute_bytes": [p.recompute_bytes for p in st],
    }
    c = profile.comm
    raw["communication"] = {
        "p2p_latency": round(c.p2p_latency_us, 3),
        "p2p_bandwidth": round(c.p2p_bandwidth, 3),
        "activation_message_bytes": [p.message_bytes for p in st],
        "allreduce_latency": round(c.allreduce_latency_us, 3),
        "allreduce_bandwidth": round(c.allreduce_bandwidth, 3),
        "gradient_bytes": [p.parameter_bytes for p in st],  # the flat gradient the OPT all-reduces
    }
    for section, key in (("training", "dataset"), ("training", "tokenizer"), ("model", "hf_config")):
        name = raw[section].get(key, "")
        if name and name != BUILTIN and not os.path.isabs(name) and config.source:
            # The output may live elsewhere: keep a relative path pointing at the same file.
            raw[section][key] = str(_beside_config(config, name).resolve())
    return raw


def _beside_config(config: Config, name: str) -> Path:
    """Where a relative path of the config points: the working directory's file if there is one (as the loaders
    look first), else the config file's folder."""
    return Path(name) if Path(name).exists() else Path(config.source).parent / name


def _toml_value(value: Any, where: str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{where} = {value!r} cannot be written to TOML")
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, where) for v in value) + "]"
    raise TypeError(f"{where}: {type(value).__name__} is not supported in this TOML writer")


def to_toml(raw: dict[str, Any], header: str = "") -> str:
    """A config mapping (top-level scalars, then one table per section) as TOML text."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    tables = [(k, v) for k, v in raw.items() if isinstance(v, dict)]
    for key, value in raw.items():
        if not isinstance(value, dict):
            lines.append(f"{key} = {_toml_value(value, key)}")
    for name, table in tables:
        lines.append("")
        lines.append(f"[{name}]")
        for key, value in table.items():
            lines.append(f"{key} = {_toml_value(value, f'[{name}] {key}')}")
    return "\n".join(lines) + "\n"


def write_profile(config: Config, profile: Profile, out: str | Path) -> tuple[Path, Config]:
    """Write the profiled config atomically after checking that it parses; return its path and the Config."""
    raw = profiled_config_dict(config, profile)
    profiled = parse_config(raw, name=raw["name"], source=str(out))  # a bad result fails here, before writing
    header = (f"Written by `recycle profile` from {config.source or config.name} on {platform.node()} at "
              f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC.\n"
              f"Durations: median of {profile.repeats} repeats after {profile.warmup} warm-up, "
              f"{profile.threads} thread, in microseconds.\n"
              f"Communication: {profile.comm.source}.")
    path = atomic_write_text(out, to_toml(raw, header))
    return path, profiled
