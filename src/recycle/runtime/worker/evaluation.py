"""The evaluation loss on the held-out split, run through the pipeline: forward-only work of every live worker,
stage by stage over the generation's transport, routed by the current plan; no gradient, no weight changes."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from recycle.data.source import DataSource
from recycle.ir import Plan
from recycle.models.chunk_set import ChunkSet
from recycle.runtime.protocol.messages import Channel, Message
from recycle.runtime.state.precision import autocast
from recycle.runtime.worker.executor import Comm

__all__ = ["evaluate", "MAX_EVAL_MICROBATCHES"]

MAX_EVAL_MICROBATCHES = 1 << 24  # an evaluation's micro-batches are numbered in the message tag's 24 bits


def evaluate(plan: Plan, rank: int, module: nn.Module, comm: Comm, load: DataSource | None, batches: int,
             input_shape: tuple[int, ...] | None, dtype: torch.dtype, device: torch.device, precision: str,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
             before_forward: Callable[[], None], counts: bool = True) -> float:
    """The mean loss over `batches` global batches of the held-out split (`load`: its DataSource; micro-batch mb of
    batch b is load(b, mb)), which every live worker returns. Each worker forwards the micro-batches the plan's
    routing gives its stage, in one global order (batch, then micro-batch), so that every pair of workers sends and
    receives in the same order and the forward-only flow (stage s to s + 1 only) cannot deadlock. The last stage
    sums its micro-batches' losses in float64; one world all-reduce adds the hosts' sums. A chunked plan's worker
    (`module` is its ChunkSet) forwards its chunks the same way (_chunk_losses).

    Deterministic: the same batches every time, no dropout (eval mode), and the sum does not depend on who hosted
    what beyond float64 rounding. `before_forward` runs before each forward (the abort check and the heartbeat's
    progress, as before an action). `counts`: whether this process's losses enter the sum (a tensor-parallel
    worker's ranks all hold the same loss: only its rank 0 counts)."""
    total = plan.total_microbatches
    if batches * total > MAX_EVAL_MICROBATCHES:
        raise ValueError(f"an evaluation of {batches} x {total} micro-batches exceeds {MAX_EVAL_MICROBATCHES:,}")
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            if plan.chunks > 1:
                if not isinstance(module, ChunkSet):
                    raise TypeError(f"a chunked plan evaluates a ChunkSet, not a {type(module).__name__}")
                loss_sum = _chunk_losses(plan, rank, module, comm, load, batches, input_shape, dtype, device,
                                         precision, before_forward)
            else:
                loss_sum = _stage_losses(plan, rank, module, comm, load, batches, input_shape, dtype, device,
                                         precision, loss_fn, before_forward)
            comm.flush()
    finally:
        module.train(training)
    total_loss = torch.tensor([loss_sum if counts else 0.0], dtype=torch.float64, device=device)
    comm.world_allreduce_sum(total_loss)
    return float(total_loss[0]) / (batches * total)


def _stage_losses(plan: Plan, rank: int, module: nn.Module, comm: Comm, load: DataSource | None, batches: int,
                  input_shape: tuple[int, ...] | None, dtype: torch.dtype, device: torch.device, precision: str,
                  loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None,
                  before_forward: Callable[[], None]) -> float:
    """This worker's part of evaluate() with one stage per worker: its losses' sum (0 but on the last stage)."""
    replica, stage = plan.worker(rank)
    is_first, is_last = stage == 0, stage == plan.num_stages - 1
    total = plan.total_microbatches
    if (is_first or is_last) and load is None:
        raise RuntimeError(f"worker {replica}:{stage} evaluates without the held-out split's data source")
    loss_sum = 0.0
    for batch in range(batches):
        for mb in range(total):
            if plan.host[stage][mb] != replica:
                continue
            before_forward()
            number = batch * total + mb
            tokens, targets = load(batch, mb) if load is not None else (None, None)
            if is_first:
                assert tokens is not None
                x = tokens.to(device)
            else:
                src = plan.rank(plan.host[stage - 1][mb], stage - 1)
                if input_shape is None:
                    raise RuntimeError(f"worker {replica}:{stage} has no input shape to receive with")
                x = comm.recv(Message(Channel.EVAL, number, src, rank), input_shape, dtype)
            with autocast(precision, device):
                if is_last:
                    assert targets is not None
                    targets = targets.to(device)
                    loss = loss_fn(module(x), targets) if loss_fn else module(x, targets)
                    loss_sum += float(loss.detach().double())
                    continue
                out = module(x)
            dst = plan.rank(plan.host[stage + 1][mb], stage + 1)
            comm.send(Message(Channel.EVAL, number, rank, dst), out.to(dtype))
    return loss_sum


def _chunk_losses(plan: Plan, rank: int, module: ChunkSet, comm: Comm, load: DataSource | None, batches: int,
                  input_shape: tuple[int, ...] | None, dtype: torch.dtype, device: torch.device, precision: str,
                  before_forward: Callable[[], None]) -> float:
    """This worker's part of evaluate() with several chunks per worker: each worker forwards its chunks'
    micro-batches in one global order (micro-batch number, then chunk), so that the unfinished item lowest in that
    order can always run and every pair sends and receives in the same order; chunk v's output goes to the worker of
    host[v+1][mb] that holds chunk v+1 (kept here when that is this worker: the V's turn)."""
    replica, stage = plan.worker(rank)
    total, last = plan.total_microbatches, plan.num_chunks - 1
    held = module.chunk_ids
    if (0 in held or last in held) and load is None:
        raise RuntimeError(f"worker {replica}:{stage} evaluates without the held-out split's data source")
    if input_shape is None:
        raise RuntimeError(f"worker {replica}:{stage} has no input shape to receive with")
    loss_sum = 0.0
    for batch in range(batches):
        for mb in range(total):
            number = batch * total + mb
            handed: torch.Tensor | None = None  # this micro-batch's output of a chunk kept on this worker
            for v in held:
                if plan.host[v][mb] != replica:
                    continue
                before_forward()
                tokens, targets = load(batch, mb) if load is not None and v in (0, last) else (None, None)
                src = plan.chunk_rank(plan.host[v - 1][mb], v - 1) if v > 0 else -1
                if v == 0:
                    assert tokens is not None
                    x = tokens.to(device)
                elif src == rank:
                    assert handed is not None, f"chunk {v - 1}'s output of micro-batch {mb} is not here"
                    x = handed
                else:
                    x = comm.recv(Message(Channel.EVAL, number, src, rank, v - 1), input_shape, dtype)
                with autocast(precision, device):
                    if v == last:
                        assert targets is not None
                        loss_sum += float(module.chunk(v)(x, targets.to(device)).detach().double())
                        continue
                    out = module.chunk(v)(x).to(dtype)
                dst = plan.chunk_rank(plan.host[v + 1][mb], v + 1)
                if dst == rank:
                    handed = out
                else:
                    comm.send(Message(Channel.EVAL, number, rank, dst, v), out)
    return loss_sum
