"""The executor of a worker that holds several model chunks: F, B and W run on the action's chunk, messages cross
chunk boundaries (a local hand-off where both chunks are this worker's), OPT steps every chunk at once."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recycle.ir import Action, Plan
from recycle.ir.completion import Completion
from recycle.models.chunk_set import ChunkSet
from recycle.runtime.protocol.messages import Message
from recycle.runtime.worker.executor import Comm, IterationResult, StageExecutor

__all__ = ["ChunkedStageExecutor"]


class ChunkedStageExecutor(StageExecutor):
    """StageExecutor for a chunked plan (plan.chunks > 1): `module` is the worker's ChunkSet.

    An action's `stage` is its chunk. The first chunk loads token ids, the last computes the loss (under the V
    layout both are on worker position 0). A message to the worker itself (the V's turn, chunk S-1 -> S and back)
    is parked where the receive finds it, never sent. OPT is the base class's: the worker's chunks share its live
    replicas (a worker dies whole), so one all-reduce over the worker's stage group and one optimizer step cover
    every chunk. Completions of an interrupted iteration (ir.completion) know one stage per worker: a recovery of a
    chunked run redoes the whole iteration.
    """

    def __init__(self, plan: Plan, rank: int, module: nn.Module, *args: Any, **kwargs: Any) -> None:
        if not isinstance(module, ChunkSet):
            raise TypeError(f"a chunked executor runs a ChunkSet (the worker's chunks), not a {type(module).__name__}")
        self.chunk_set = module
        self.chunk_params = {v: [p for p in module.chunk(v).parameters() if p.requires_grad]
                             for v in module.chunk_ids}
        super().__init__(plan, rank, module, *args, **kwargs)

    def set_plan(self, plan: Plan, comm: Comm | None = None) -> None:
        if plan.chunks < 2:
            raise ValueError(f"a chunked executor runs chunked plans; this one has {plan.chunks} chunk per worker")
        if plan.pieces:
            raise ValueError("a chunked plan cannot split micro-batches into pieces yet; plan without "
                             "--split-microbatches")
        super().set_plan(plan, comm)
        held = set(self.chunk_set.chunk_ids)
        planned = {a.stage for a in self.actions if a.stage >= 0 and a.mb >= 0}
        if not planned <= held:
            raise ValueError(f"worker {self.replica}:{self.stage} holds chunks {sorted(held)} but its plan runs "
                             f"chunks {sorted(planned - held)} too")
        self.last_chunk = plan.num_chunks - 1
        self.is_first = 0 in held  # loads token ids
        self.is_last = self.last_chunk in held  # computes the loss: reported, and summed in its OPT
        self.total = plan.total_microbatches

    def keep_for_completion(self, iteration: int) -> None:
        raise RuntimeError("a chunked plan's recovery redoes the whole iteration; no completion is made for it")

    def run_completion(self, completion: Completion) -> IterationResult:
        raise RuntimeError("a chunked plan's recovery redoes the whole iteration; no completion is made for it")

    def _key(self, action: Action) -> int:
        """The stash key of (chunk, micro-batch)."""
        return action.stage * self.total + action.mb

    def _deliver(self, message: Message, tensor: torch.Tensor) -> None:
        """Send `message`, or hand it to this worker's own next chunk (detached: the receiver's own leaf)."""
        if message.dst == self.rank:
            self._parked[message] = tensor.detach()
        else:
            self.comm.send(message, tensor)

    # -- compute, one method per kind ------------------------------------------------------------------------------
    def forward(self, action: Action) -> None:
        chunk = action.stage
        self._forward(action, self.chunk_set.chunk(chunk), chunk, self._key(action), chunk == 0,
                      chunk == self.last_chunk)

    def _send_activation(self, action: Action, out: torch.Tensor) -> None:
        """Send the chunk's output to the next chunk's worker, or hand it to this worker's own next chunk (no
        completions run on a chunked plan: nothing is logged for re-sends)."""
        message = self._outgoing(action)
        assert message is not None, f"{action} sends its activation downstream"
        self._deliver(message, out)

    def backward_input(self, action: Action) -> None:
        """B: the input-gradient only (sent upstream, or handed to the previous chunk here); the graph is kept."""
        stash = self._stash[self._key(action)]
        stash.grad_out = self._chunk_output_grad(action)
        if action.stage == 0:
            return  # token ids have no gradient
        assert stash.inp is not None
        message = self._outgoing(action)
        assert message is not None, f"{action} sends its input-gradient upstream"
        (grad_in,) = torch.autograd.grad(stash.out, [stash.inp], stash.grad_out, retain_graph=True)
        self._deliver(message, grad_in)

    def backward_weight(self, action: Action) -> None:
        """W: the chunk's weight-gradient, accumulated into .grad; frees the micro-batch's graph."""
        stash = self._stash.pop(self._key(action))
        self._backward_into_grad(stash.out, stash.grad_out, self.chunk_params[action.stage])

    def backward_fused(self, action: Action) -> None:
        """BW: input- and weight-gradient of the chunk in one backward pass."""
        grad_out = self._chunk_output_grad(action)
        stash = self._stash.pop(self._key(action))
        params = self.chunk_params[action.stage]
        if action.stage == 0:
            self._backward_into_grad(stash.out, grad_out, params)
            return
        assert stash.inp is not None
        self._backward_into_grad(stash.out, grad_out, [stash.inp, *params])
        self.progress.weighed = True
        assert stash.inp.grad is not None
        message = self._outgoing(action)
        assert message is not None, f"{action} sends its input-gradient upstream"
        self._deliver(message, stash.inp.grad)

    def _chunk_output_grad(self, action: Action) -> torch.Tensor | None:
        if action.stage == self.last_chunk:
            return None  # the scaled loss is a scalar: autograd seeds it with 1
        return self._receive(self._incoming(action))
