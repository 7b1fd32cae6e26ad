"""The worker executor: runs one worker's action list of a plan, one method per action kind, for one iteration."""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable, Protocol, Sequence

import torch
from torch import nn

from recycle.ir import Action, Kind, Plan
from recycle.ir.completion import SEND_ACTIVATION, SEND_GRADIENT, Completion, Step
from recycle.ir.worker import Worker
from recycle.models.tensor_parallel import is_sharded, local_tensor
from recycle.runtime.protocol.messages import Channel, Message, incoming, outgoing, send_order
from recycle.runtime.state.optim import StageOptimizer, allreduce_grads, fill_missing_grads, learning_rate
from recycle.runtime.state.precision import autocast
from recycle.runtime.state.rollback import StageSnapshot
from recycle.runtime.state.stage_state import IterationPosition, StageState
from recycle.runtime.worker.backward import backward_into_grad
from recycle.runtime.worker.pieces import load_piece, piece_shape

__all__ = ["StageExecutor", "IterationProgress", "IterationResult", "Comm", "Pacing", "ActionTiming", "dropout_seed"]


class Comm(Protocol):
    """What the executor needs from a transport (see runtime.transport.Transport)."""

    def send(self, message: Message, tensor: torch.Tensor) -> None: ...
    def recv(self, message: Message, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor: ...
    def flush(self) -> None: ...
    def stage_allreduce_sum(self, stage: int, tensor: torch.Tensor) -> None: ...
    def tied_allreduce_sum(self, tensor: torch.Tensor) -> None: ...
    def world_allreduce_sum(self, tensor: torch.Tensor) -> None: ...
    def barrier(self) -> None: ...


class Pacing(Protocol):
    """A hook around every action (runtime.emulate.CostPacer pads each to an emulated cost): the executor talks
    through the transport `wrap` returns, tells it each new plan, and lets it run each action."""

    def wrap(self, comm: Comm) -> Comm: ...
    def set_plan(self, plan: Plan) -> None: ...
    def run(self, action: Action, work: Callable[[Action], None]) -> None: ...
    def run_untimed(self, work: Callable[[], None]) -> None: ...


@dataclass
class IterationProgress:
    """Where a worker is: the iteration and the index of the next action in its list. Kept explicit so that a
    coordinator can abort an iteration after a failure and resume from a known point."""

    iteration: int = 0
    index: int = 0
    finished: bool = False
    busy_s: float = 0.0  # time spent in this iteration's finished actions
    weighed: bool = False  # the running action is a BW whose weight-gradient is already in .grad
    reducing: bool = False  # the running OPT has put the all-reduced sums into .grad (its own work is not there alone)
    completing: bool = False  # running the completion of an interrupted iteration (ir.completion), not the plan
    # The running F, B or BW has its results in the stash and the sent-log: only its send remains. (A tensor-parallel
    # worker's ranks may stop on either side of it: worker.tp_agreement counts such a rank as done with the action.)
    sending: bool = False


@dataclass(frozen=True)
class ActionTiming:
    action: str
    start: float  # time.perf_counter() seconds
    end: float


@dataclass
class IterationResult:
    iteration: int
    start: float  # wall clock (time.time())
    end: float
    loss_sum: float | None  # sum of this worker's scaled micro-batch losses (last stage only)
    grad_norm: float | None  # global gradient norm before clipping (only computed when clipping)
    timings: list[ActionTiming] = field(default_factory=list)
    stage_loss: float | None = None  # the whole batch's loss, summed over the last stage's replicas in its OPT
    grad_sq: float | None = None  # this stage's squared gradient norm after its all-reduce (when not clipping)
    lr: float | None = None  # the learning rate this stage's optimizer step applied


# The method that runs each kind of action (looked up by name, so a subclass's or a test's override is the one run).
_HANDLERS = {Kind.F: "forward", Kind.B: "backward_input", Kind.W: "backward_weight", Kind.BW: "backward_fused",
             Kind.OPT: "optimizer_step"}


def _step_channel(kind: str) -> Channel:
    """What a completion's step (ir.completion) carries: a forward or its re-send activations, the rest gradients."""
    return Channel.ACTIVATION if kind in ("F", SEND_ACTIVATION) else Channel.GRADIENT


def dropout_seed(seed: int, iteration: int, mb: int, stage: int) -> int:
    """The RNG seed for a forward: a function of (iteration, mb, stage) only, so a re-routed micro-batch draws the
    same dropout masks whichever replica runs it."""
    return (seed * 1_000_003 + iteration * 7_919 + mb * 104_729 + stage * 15_485_863) % (2 ** 63 - 1)


@dataclass
class _Stash:
    """What a micro-batch keeps on its host between F and W."""

    inp: torch.Tensor | None  # the stage input (requires grad), None on stage 0 (token ids)
    out: torch.Tensor  # the stage output (the scaled loss on the last stage)
    grad_out: torch.Tensor | None = None  # the output-gradient, kept from B for W (None on the last stage)


class StageExecutor:
    """Executes `plan.actions[rank]` for one worker each iteration.

    Message order: a worker takes messages from each peer in the order that peer sends them (derived from the
    peer's action list); a message that arrives before it is needed is parked. On gloo every message also carries
    a (channel, micro-batch) tag.
    """

    def __init__(self, plan: Plan, rank: int, module: nn.Module, optimizer: StageOptimizer, comm: Comm | None,
                 load_microbatch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
                 input_shape: tuple[int, ...] | None, output_shape: tuple[int, ...] | None, dtype: torch.dtype,
                 grad_clip: float = 0.0, seed: int = 0,
                 device: torch.device | None = None, record_timings: bool = False,
                 before_action: Callable[[Action], None] | None = None,
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 precision: str = "", pacing: Pacing | None = None,
                 position: IterationPosition | None = None, tp_rank: int = 0,
                 tp_allreduce: Callable[[torch.Tensor], None] | None = None, grad_norm_metric: bool = True) -> None:
        self.rank = rank
        self.module = module
        self.loss_fn = loss_fn  # last stage: loss_fn(module(x), targets); None: module(x, targets) is the loss
        self.params = [p for p in module.parameters() if p.requires_grad]
        # A tied weight's copy (models.hf: the first stage's input embedding, the last stage's lm_head weight): its
        # gradient is summed over the workers of both stages, not only over this stage's replicas.
        tied = set(getattr(module, "tied_weights", ()))
        named = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
        self.tied_params = [p for name, p in named if name in tied]
        self.stage_params = [p for name, p in named if name not in tied]
        if len(self.tied_params) != len(tied):
            raise ValueError(f"tied_weights {sorted(tied)} are not all trainable parameters of the stage module")
        self.optimizer = optimizer
        self._comm: Comm | None = None  # None between generations (built before the next one formed)
        self.load_microbatch = load_microbatch
        # Received activations have the previous stage's output shape; received gradients our own output's.
        self.receive_shapes = {Channel.ACTIVATION: input_shape, Channel.GRADIENT: output_shape}
        self.dtype = dtype  # of the weights and of every tensor sent between stages
        self.precision = precision  # [training] dtype: "bfloat16" runs the forward under bf16 autocast
        self.grad_clip = grad_clip
        # Without clipping, whether to compute the stage's squared gradient norm for the metric (grad_sq) at all.
        self.grad_norm_metric = grad_norm_metric
        # Tensor parallelism inside the worker: this process's rank, and the SUM over the worker's ranks (None: one
        # rank). Only gradient norms need it; the stage module's own collectives go through its DeviceMesh.
        self.tp_rank = tp_rank
        self.tp_allreduce = tp_allreduce
        self.seed = seed
        self.device = device or torch.device("cpu")
        self.record_timings = record_timings
        self.progress = IterationProgress()
        # The last iteration whose optimizer step this worker applied (the worker's, kept across executors), and how
        # much work that iteration took (a recovery that rolls it back reports it as redone).
        self.position = position if position is not None else IterationPosition()
        self.completed = IterationProgress(finished=True)
        self.snapshot = StageSnapshot(StageState(module, optimizer, plan.worker(rank)[1], self.position))
        self.before_action = before_action  # e.g. the check that the generation was aborted
        self.pacing = pacing  # runs each action (after before_action) and wraps every transport set_plan is given
        self._stage_loss: float | None = None
        self._next_from: dict[int, int] = defaultdict(int)
        self._parked: dict[Message, torch.Tensor] = {}
        self._stash: dict[int, _Stash] = {}
        # The tensors sent in the two newest iterations, by (channel, micro-batch): after a failure a survivor
        # re-sends from here what a re-routed micro-batch needs instead of anyone recomputing it (ir.completion).
        self._sent: dict[int, dict[tuple[Channel, int], torch.Tensor]] = {}
        # A completion's routes, by (kind, micro-batch): (message received first, message sent after); None: the
        # plan's own routing.
        self._routes: dict[tuple[Kind, int], tuple[Message | None, Message | None]] | None = None
        self.last_result: IterationResult | None = None  # the newest iteration this worker finished
        self._loss_sum = 0.0
        self._losses_in: set[int] = set()  # micro-batches whose loss _loss_sum holds
        self._grad_norm: float | None = None
        self._grad_sq: float | None = None
        self._lr: float | None = None
        self.set_plan(plan, comm)

    def set_plan(self, plan: Plan, comm: Comm | None = None) -> None:
        """Run `plan` (and talk over `comm`) from the next iteration on: the switch a coordinator makes after a
        failure. The worker keeps its rank, weights and optimizer state; the plan must keep it live."""
        replica, stage = plan.worker(self.rank)
        if (replica, stage) in plan.failed:
            raise ValueError(f"worker {Worker(replica, stage)} is failed in the new plan; a failed worker cannot run it")
        self.plan = plan
        if comm is not None:
            self._comm = self.pacing.wrap(comm) if self.pacing is not None else comm
        if self.pacing is not None:
            self.pacing.set_plan(plan)
        self.replica, self.stage = replica, stage
        self.is_first = stage == 0
        self.is_last = stage == plan.num_stages - 1
        self.actions = plan.actions[self.rank]
        # Expected arrival order from each peer (its send order), for the in-order receive.
        self._expected: dict[int, list[Message]] = {}
        received = [incoming(plan, self.rank, action) for action in self.actions]
        for message in received:
            if message is not None and message.src not in self._expected:
                self._expected[message.src] = send_order(plan, message.src, self.rank)
        # Each action's (message received, message sent), found once per plan rather than per action run; a received
        # one is the very object of its sender's order, so the receive matches it by identity.
        same = {m: m for order in self._expected.values() for m in order}
        self._messages: dict[Action, tuple[Message | None, Message | None]] = {
            action: (same.get(message, message) if message is not None else None,
                     outgoing(plan, self.rank, action)) for action, message in zip(self.actions, received)}

    def drop_comm(self) -> None:
        """Let go of a broken generation's transport (set_plan gives the next one)."""
        self._comm = None

    @property
    def comm(self) -> Comm:
        """This generation's transport (paced when costs are emulated)."""
        if self._comm is None:
            raise RuntimeError(f"worker {self.replica}:{self.stage} has no transport: it is between generations")
        return self._comm

    def abort_iteration(self) -> None:
        """Forget the current iteration's partial work (stashed graphs, parked messages, accumulated gradients) so
        the iteration can be re-run from its first action, e.g. under a new plan after a peer failed. Only valid
        before this worker's OPT of the iteration ran: after it, the weights already moved on."""
        self._stash.clear()
        self._parked.clear()
        self._next_from.clear()
        self._routes = None
        self.optimizer.zero_grad(set_to_none=True)
        self.progress = IterationProgress(self.progress.iteration, 0)

    def keep_for_completion(self, iteration: int) -> None:
        """After a failure, before `iteration`'s completion (run_completion): keep this iteration's work (stashed
        graphs, accumulated gradients, the loss so far, the log of sent tensors). A worker already in the next
        iteration (it had stepped `iteration`) drops that one's partial work; it only re-sends from its log. One
        stopped inside its OPT drops its gradients (the all-reduce may have summed them in part): the completion
        computes its micro-batches' weight-gradients again."""
        self._parked.clear()  # messages of the broken generation: the completion has them sent again if needed
        self._next_from.clear()
        self._routes = None
        past = self.progress.iteration > iteration
        if past:
            self._sent.pop(self.progress.iteration, None)
        if past or (self.progress.reducing and not self.progress.finished):
            self._stash.clear()
            self.optimizer.zero_grad(set_to_none=True)
            self._loss_sum = 0.0
            self._losses_in = set()

    # -- one iteration --------------------------------------------------------------------------------------------
    def run_iteration(self, iteration: int) -> IterationResult:
        self.progress = IterationProgress(iteration, 0)
        self._loss_sum = 0.0
        self._losses_in = set()
        self._grad_norm = None
        self._grad_sq = None
        self._lr = None
        self._stage_loss = None
        self._next_from.clear()
        self._sent = {i: log for i, log in self._sent.items() if i == iteration - 1}
        self._sent[iteration] = {}
        timings: list[ActionTiming] = []
        start = time.time()
        for index, action in enumerate(self.actions):
            self._run_one(index, action, None, timings)
        self.comm.flush()
        self.progress.index = len(self.actions)
        self.progress.finished = True
        self.completed = self.progress
        if self._stash or self._parked:
            raise RuntimeError(f"worker {self.replica}:{self.stage} ended iteration {iteration} with unfinished "
                               f"micro-batches {sorted(self._stash)} or unread messages; the plan is inconsistent")
        self.last_result = IterationResult(iteration, start, time.time(), self._loss_sum if self.is_last else None,
                                           self._grad_norm, timings=timings, stage_loss=self._stage_loss,
                                           grad_sq=self._grad_sq, lr=self._lr)
        return self.last_result

    def run_completion(self, completion: Completion) -> IterationResult:
        """Finish `completion.iteration` with this worker's steps of it (after keep_for_completion): the work it
        kept stands, the steps add the rest. A stage that had stepped the iteration only re-sends from its log and
        returns the result it had."""
        iteration = completion.iteration
        steps = completion.steps[self.rank]
        stepped = self.stage in completion.applied_stages
        self.progress = IterationProgress(iteration, 0, completing=True)
        if not stepped:
            self._grad_norm = self._grad_sq = self._lr = self._stage_loss = None
        self._routes = {}
        for step in steps:
            if step.kind in ("F", "B"):
                received = Message(_step_channel(step.kind), step.mb, step.src, self.rank) if step.src >= 0 else None
                self._routes[(Kind(step.kind), step.mb)] = (received, self._sent_by(self.rank, step))
        self._expected = {}
        for src, their_steps in enumerate(completion.steps):
            sent = [m for m in (self._sent_by(src, s) for s in their_steps) if m is not None and m.dst == self.rank]
            if sent:
                self._expected[src] = sent
        self._next_from.clear()
        timings: list[ActionTiming] = []
        start = time.time()
        # A stage that stepped the iteration computes lost forwards and input-gradients again with its weights from
        # before that step (it runs no W and no OPT of it).
        recomputes = stepped and any(step.kind in ("F", "B") for step in steps)
        with self.snapshot.weights_before_step(iteration) if recomputes else contextlib.nullcontext():
            for index, step in enumerate(steps):
                action = Action(Kind.OPT, step.stage) if step.kind == "OPT" else \
                    Action(Kind(step.kind) if step.kind in ("F", "B", "W") else
                           (Kind.F if step.kind == SEND_ACTIVATION else Kind.B), step.stage, step.mb)
                resend = functools.partial(self._resend, iteration, step) \
                    if step.kind in (SEND_ACTIVATION, SEND_GRADIENT) else None
                self._run_one(index, action, str(step), timings, resend)
            self._stash.clear()  # graphs of forwards run again only to send an input-gradient on: used up here
        if self._parked:
            raise RuntimeError(f"worker {self.replica}:{self.stage} ended the completion of iteration {iteration} "
                               "with unread messages; the completion is inconsistent")
        self._routes = None
        self.set_plan(self.plan)  # the plan's own message order from the next iteration on
        self.progress.index = len(steps)
        self.progress.finished = True
        self.completed = self.progress
        if stepped and self.last_result is not None and self.last_result.iteration == iteration:
            return replace(self.last_result, timings=timings)
        self.last_result = IterationResult(iteration, start, time.time(), self._loss_sum if self.is_last else None,
                                           self._grad_norm, timings=timings, stage_loss=self._stage_loss,
                                           grad_sq=self._grad_sq, lr=self._lr)
        return self.last_result

    def _run_one(self, index: int, action: Action, label: str | None, timings: list[ActionTiming],
                 work: Callable[[], None] | None = None) -> None:
        """Run `action` (or, for a completion's re-send, `work`, announced to the hooks as `action`) with what goes
        around every action: the progress, before_action, the pacing, its busy time and timing record (labelled
        `label`, or `action` when None: formatted only when timings are recorded)."""
        self.progress.index = index
        self.progress.weighed = self.progress.reducing = self.progress.sending = False
        if self.before_action is not None:
            self.before_action(action)
        t0 = time.perf_counter()
        if work is not None:
            work() if self.pacing is None else self.pacing.run_untimed(work)
        elif self.pacing is None:
            self.run_action(action)
        else:
            self.pacing.run(action, self.run_action)
        t1 = time.perf_counter()
        self.progress.busy_s += t1 - t0
        if self.record_timings:
            timings.append(ActionTiming(str(action) if label is None else label, t0, t1))

    @staticmethod
    def _sent_by(src: int, step: Step) -> Message | None:
        """The message rank `src`'s completion step sends, if any."""
        return Message(_step_channel(step.kind), step.mb, src, step.dst) if step.dst >= 0 else None

    def _resend(self, iteration: int, step: Step) -> None:
        """Send a tensor this worker sent in the broken generation again, from its log."""
        channel = _step_channel(step.kind)
        tensor = self._sent.get(iteration, {}).get((channel, step.mb))
        if tensor is None:
            raise RuntimeError(f"worker {self.replica}:{self.stage} has no logged {channel.name.lower()} of "
                               f"micro-batch {step.mb} in iteration {iteration} to send again")
        self.comm.send(Message(channel, step.mb, self.rank, step.dst), tensor)

    def _log_sent(self, channel: Channel, mb: int, tensor: torch.Tensor) -> None:
        log = self._sent.setdefault(self.progress.iteration, {})
        log[(channel, mb)] = tensor.detach()

    def run_action(self, action: Action) -> None:
        getattr(self, _HANDLERS[action.kind])(action)

    # -- compute, one method per kind (easy to time or pad) -------------------------------------------------------
    def forward(self, action: Action) -> None:
        self._forward(action, self.module, self.stage, action.mb, self.is_first, self.is_last)

    def _forward(self, action: Action, module: nn.Module, stage: int, key: int, first: bool, last: bool) -> None:
        """F of `action` on `module`, which holds stage (or, on a chunked worker, chunk) `stage` of the model: the
        input received (or, where `first`, the token ids loaded), dropout seeded by (iteration, mb, stage), the
        forward under the run's autocast, on the `last` the weighted loss (counted once per micro-batch); the output
        cast to the boundary dtype, stashed under `key` and sent (_send_activation)."""
        mb = action.mb
        tokens, targets = load_piece(self.load_microbatch, self.plan, self.progress.iteration, mb) \
            if (first or last) else (None, None)
        inp: torch.Tensor | None = None
        if first:
            assert tokens is not None
            x = tokens.to(self.device)
        else:
            inp = self._receive(self._incoming(action)).requires_grad_()
            x = inp
        self._seed_dropout(dropout_seed(self.seed, self.progress.iteration, mb, stage))
        with autocast(self.precision, self.device):
            if last:
                assert targets is not None
                targets = targets.to(self.device)
                loss = self.loss_fn(module(x), targets) if self.loss_fn else module(x, targets)
                out = loss * self.plan.loss_weight(mb)  # the global-token rule (recycle.ir.pieces)
            else:
                out = module(x)
        if last:
            if mb not in self._losses_in:  # a completion may run a forward again only to send its gradient on
                self._losses_in.add(mb)
                self._loss_sum += float(out.detach())
            self._stash[key] = _Stash(inp, out)
            return
        if out.dtype != self.dtype:  # a stage whose output autocast left in bf16: the boundary is float32
            out = out.to(self.dtype)
        self._stash[key] = _Stash(inp, out)
        self._send_activation(action, out)

    def _send_activation(self, action: Action, out: torch.Tensor) -> None:
        """Send a forward's output downstream (logged for re-sends); a completion's forward may send nothing."""
        outgoing = self._outgoing(action)
        if outgoing is None:
            return
        self._log_sent(Channel.ACTIVATION, action.mb, out)
        self.progress.sending = True
        self.comm.send(outgoing, out)

    def backward_input(self, action: Action) -> None:
        """B: the input-gradient only (sent upstream at once); the graph is kept for W."""
        stash = self._stash[action.mb]
        stash.grad_out = self._output_grad(action)
        if self.is_first:
            return  # token ids have no gradient: stage 0's B only takes delivery of the output-gradient
        assert stash.inp is not None  # every stage but the first receives its input
        outgoing = self._outgoing(action)
        if outgoing is None:
            return  # a completion's B only for its own W: nobody upstream needs the input-gradient
        (grad_in,) = torch.autograd.grad(stash.out, [stash.inp], stash.grad_out, retain_graph=True)
        self._log_sent(Channel.GRADIENT, action.mb, grad_in)
        self.progress.sending = True
        self.comm.send(outgoing, grad_in)

    def backward_weight(self, action: Action) -> None:
        """W: the weight-gradient, accumulated into .grad; frees the micro-batch's graph."""
        stash = self._stash[action.mb]
        self._backward(stash.out, stash.grad_out, self.params)
        del self._stash[action.mb]

    def backward_fused(self, action: Action) -> None:
        """BW: input- and weight-gradient in one backward pass."""
        grad_out = self._output_grad(action)
        # Dropped once the backward is done: a failure before (the receive; a TP collective inside the backward)
        # leaves the graph for a completion.
        stash = self._stash[action.mb]
        if self.is_first:
            self._backward(stash.out, grad_out, self.params)
            del self._stash[action.mb]
            return
        assert stash.inp is not None  # every stage but the first receives its input
        self._backward(stash.out, grad_out, [stash.inp, *self.params])
        del self._stash[action.mb]
        self.progress.weighed = True  # a failure in the send below: the weight-gradient is kept, the rest redone
        # stash.inp is this micro-batch's own leaf (a fresh receive buffer): its .grad is exactly the input-gradient.
        assert stash.inp.grad is not None
        outgoing = self._outgoing(action)
        assert outgoing is not None, f"{action} sends its input-gradient upstream"
        self._log_sent(Channel.GRADIENT, action.mb, stash.inp.grad)
        self.progress.sending = True
        self.comm.send(outgoing, stash.inp.grad)

    def optimizer_step(self, action: Action) -> None:
        """OPT: SUM all-reduce of the stage's gradients over its live replicas, optional clipping, AdamW step."""
        if not self.plan.staggered:
            self.comm.barrier()  # coupled: no stage steps before every worker has finished its backward work
        # The last stage's losses ride along in the same all-reduce, so every replica knows the batch's loss.
        loss = torch.tensor([self._loss_sum], dtype=self.params[0].dtype, device=self.device) if self.is_last \
            else None
        if len(self.plan.live_replicas(self.stage)) > 1:
            allreduce_grads(self.stage_params, lambda flat: self.comm.stage_allreduce_sum(self.stage, flat),
                            extra=loss)
        else:
            # A one-member SUM leaves every value as it is: skip the flat copy there and back (about 0.5 ms of a
            # small GPT stage's ~70 ms step; docs/runtime-performance.md), keep the zeros it gives unused parameters.
            fill_missing_grads(self.stage_params)
        # The sums are in .grad now (the all-reduce ran on a flat copy until here): a failure from here on leaves
        # gradients that a completion cannot keep.
        self.progress.reducing = True
        if self.tied_params:  # after the stage's own: every tied stage's worker makes the two in the same order
            allreduce_grads(self.tied_params, self.comm.tied_allreduce_sum)
        if loss is not None:
            self._stage_loss = float(loss[0])
        if self.grad_clip > 0:
            self._clip_global_norm()
        elif self.grad_norm_metric:
            # For the grad-norm metric: the launcher sums the stages' squares, so no cross-stage collective is needed.
            self._grad_sq = self._squared_norm()
        self.snapshot.take(self.progress.iteration)
        self._lr = learning_rate(self.optimizer)
        self.optimizer.step()
        self.position.applied = self.progress.iteration
        self.optimizer.zero_grad(set_to_none=True)

    def roll_back(self, redo_iteration: int) -> bool:
        """Return to the state before the optimizer step of `redo_iteration` if this worker already applied it;
        forget any partial iteration. Returns whether weights were rolled back."""
        self.abort_iteration()
        if self.position.applied >= redo_iteration:
            self.snapshot.restore(redo_iteration)  # the position then holds redo_iteration - 1
            return True
        return False

    # -- helpers --------------------------------------------------------------------------------------------------
    def _clip_global_norm(self) -> None:
        """Exact global-norm clipping: every stage's squared norm is summed over all stages before any step.

        This is a world all-reduce, so with clipping even the staggered optimizer waits for the slowest stage's
        reduce (a cross-stage sync point per iteration); without clipping no such point exists.
        """
        squares = torch.zeros(self.plan.num_stages, dtype=torch.float64, device=self.device)
        # Only the lowest live replica of each stage contributes, so the world sum counts each stage once.
        if self.replica == self.plan.live_replicas(self.stage)[0]:
            # Every TP rank's shards, a replicated tensor from TP rank 0 only: the world sum counts each once.
            sharded, whole = self._squared_norms()
            squares[self.stage] = sharded + (whole if self.tp_rank == 0 else 0.0)
        self.comm.world_allreduce_sum(squares)
        total = float(squares.sum()) ** 0.5
        self._grad_norm = total
        coefficient = self.grad_clip / (total + 1e-6)  # the same formula as torch.nn.utils.clip_grad_norm_
        if coefficient < 1.0:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(coefficient)

    def _squared_norm(self) -> float:
        """The squared norm of this stage's gradients, a tied weight counted once in the model: on the first stage
        (the last stage's copy holds the same summed gradient). With tensor parallelism, of the whole stage: the
        shards' squares summed over the worker's ranks."""
        sharded, whole = self._squared_norms()
        if self.tp_allreduce is not None:
            summed = torch.tensor([sharded], dtype=torch.float64, device=self.device)
            self.tp_allreduce(summed)
            sharded = float(summed[0])
        return sharded + whole

    def _squared_norms(self) -> tuple[float, float]:
        """This rank's squared gradient norm (see _squared_norm), split: (its shards of tensor-parallel gradients,
        the gradients it holds whole)."""
        counted = self.params if self.is_first else self.stage_params
        shards: list[torch.Tensor] = []
        whole: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in counted:
            grad = p.grad
            if grad is None:
                continue
            # A DTensor is this rank's shard (a plain tensor is whole: the test by type skips two calls per parameter
            # on the per-step path).
            if type(grad) is not torch.Tensor and is_sharded(grad):
                shards.append(local_tensor(grad).detach())
            else:
                whole.setdefault(grad.dtype, []).append(local_tensor(grad).detach())
        return _sum_of_squares(shards), sum((_sum_of_squares(grads) for grads in whole.values()), 0.0)

    def _output_grad(self, action: Action) -> torch.Tensor | None:
        if self.is_last:
            return None  # the scaled loss is a scalar: autograd seeds it with 1
        return self._receive(self._incoming(action))

    def _incoming(self, action: Action) -> Message:
        if self._routes is not None:
            message = self._routes[(action.kind, action.mb)][0]
        else:
            planned = self._messages.get(action)
            message = planned[0] if planned is not None else incoming(self.plan, self.rank, action)
        if message is None:
            raise RuntimeError(f"worker {self.replica}:{self.stage}: {action} receives nothing in its plan")
        return message

    def _outgoing(self, action: Action) -> Message | None:
        """The message `action` sends: the plan's, or in a completion the step's (None: nobody needs it)."""
        if self._routes is not None:
            return self._routes[(action.kind, action.mb)][1]
        planned = self._messages.get(action)
        message = planned[1] if planned is not None else outgoing(self.plan, self.rank, action)
        if message is None:
            raise RuntimeError(f"worker {self.replica}:{self.stage}: {action} sends nothing in its plan")
        return message

    def _receive(self, wanted: Message) -> torch.Tensor:
        """Take messages from `wanted.src` in its send order until `wanted` arrives; park the earlier ones."""
        parked = self._parked
        if parked and wanted in parked:  # (a Message's hash is a Python call: none when nothing is parked)
            return parked.pop(wanted)
        src = wanted.src
        order = self._expected[src]
        while True:
            position = self._next_from[src]
            if position >= len(order):
                raise RuntimeError(f"worker {self.replica}:{self.stage} expected {wanted} but its sender has no "
                                   "such message in its plan")
            message = order[position]
            self._next_from[src] = position + 1
            shape = self.receive_shapes[message.channel]
            if shape is None:
                raise RuntimeError(f"worker {self.replica}:{self.stage} has no {message.channel.name} shape to "
                                   f"receive {message}")
            if self.plan.pieces:
                shape = piece_shape(self.plan, message.mb, shape)
            tensor = self.comm.recv(message, shape, self.dtype)
            if message is wanted or message == wanted:
                return tensor
            parked[message] = tensor

    def _seed_dropout(self, seed: int) -> None:
        """Seed the generators this stage's dropout draws from: the CPU one, and the device's on CUDA.

        Not torch.manual_seed: on a process whose CUDA (or XPU/MTIA) is not initialised that queues a lazy seeding
        call per backend and captures a formatted stack trace for each (traceback + linecache stat()s, ~0.1 ms per
        forward: measurably more CPU per step than the compute it seeds). The generators used are seeded the same.
        """
        torch.default_generator.manual_seed(seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(seed)  # the current device (worker_main sets it); CUDA is initialised there

    def _backward(self, out: torch.Tensor, grad_out: torch.Tensor | None, inputs: Sequence[torch.Tensor]) -> None:
        """The backward of a W or BW into the inputs' .grad: _backward_into_grad, or on a tensor-parallel stage
        _backward_kept. Why: a TP stage's backward holds TP collectives, which a failure elsewhere can cut midway;
        autograd.backward accumulates as it goes and frees the graph, so a cut one would leave part of the
        micro-batch's gradient in .grad and its graph half freed, which a completion could not run again."""
        if self.tp_allreduce is None:
            self._backward_into_grad(out, grad_out, inputs)
        else:
            self._backward_kept(out, grad_out, inputs)

    @staticmethod
    def _backward_into_grad(out: torch.Tensor, grad_out: torch.Tensor | None, inputs: Sequence[torch.Tensor]) -> None:
        """Accumulate d(out)/d(inputs) into the inputs' .grad, as loss.backward() would: autograd's AccumulateGrad
        adopts the first micro-batch's gradient and adds the later ones in place, in C++ (the same sums, in the same
        micro-batch order, as a Python clone-then-add_ loop over autograd.grad's results, without the copies and
        the per-parameter Python calls). Frees the graph. Inputs the graph does not reach keep their .grad."""
        backward_into_grad(out, grad_out, inputs)

    @staticmethod
    def _backward_kept(out: torch.Tensor, grad_out: torch.Tensor | None, inputs: Sequence[torch.Tensor]) -> None:
        """The same sums as _backward_into_grad, with the gradients taken whole first (the graph kept) and added to
        .grad only after: a backward that raises leaves .grad and the graph as they were."""
        grads = torch.autograd.grad(out, list(inputs), grad_out, retain_graph=True, allow_unused=True)
        for tensor, grad in zip(inputs, grads):
            if grad is not None:
                tensor.grad = grad if tensor.grad is None else tensor.grad.add_(grad)


def _sum_of_squares(tensors: list[torch.Tensor]) -> float:
    """The sum of every element's square, in float64: the tensors flattened into one float64 buffer and dotted with
    itself (three kernels and one host sync for a stage, where one square and one sum per tensor cost four kernels
    and a sync each: the grad-norm metric was ~2 % of a step). The clip coefficient needs it in float64."""
    if not tensors:
        return 0.0
    flat = torch.cat([t.reshape(-1) for t in tensors]).to(torch.float64)
    return float(torch.dot(flat, flat))
