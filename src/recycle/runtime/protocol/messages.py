"""Point-to-point messages implied by a plan: who sends what to whom, their tags, and the per-pair order.

Every message is an activation (F of `mb` at stage s -> host[s+1][mb]) or an input-gradient (B/BW of `mb` at
stage s -> host[s-1][mb]); in a chunked plan s is a chunk and the peer is the worker holding chunk s+1 (or s-1),
which may be the sender itself (the V layout's turn: a local hand-off, never sent). Both ends derive the per-pair
order from the sender's action list, so the receiver can take messages from one peer strictly in the order they were
sent. That makes the runtime correct on transports without tags (NCCL) too: tags are only a second safety net on
gloo.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from recycle.ir import Action, Kind, Plan
from recycle.ir.dependencies import input_stage, output_stage
from recycle.ir.validate import check_plan_matches  # re-exported: the runtime's check before it runs a plan

__all__ = ["Channel", "Message", "outgoing", "incoming", "send_order", "message_tag", "check_plan_matches"]


class Channel(IntEnum):
    ACTIVATION = 1  # forward output, sent downstream
    GRADIENT = 2  # input-gradient, sent upstream
    EVAL = 3  # an evaluation's forward output (worker.evaluation), sent downstream; mb: batch * D * M + micro-batch


@dataclass(frozen=True, slots=True)
class Message:
    channel: Channel
    mb: int
    src: int  # topology rank
    dst: int  # topology rank
    # The chunk boundary it crosses (the lower chunk's index) in a chunked plan, 0 otherwise: one pair of workers
    # exchanges the same micro-batch once per boundary between their chunks (interleaved: 0->1 and 2->3).
    boundary: int = 0


_BOUNDARY_BITS = 5  # gloo tags are C ints: bits 26..30 hold the boundary (mod 32); the send order is what matters


def message_tag(channel: Channel, mb: int, boundary: int = 0) -> int:
    """A tag unique per (channel, micro-batch, chunk boundary mod 32) between one pair within an iteration."""
    return ((boundary % (1 << _BOUNDARY_BITS)) << 26) | (int(channel) << 24) | mb


def outgoing(plan: Plan, rank: int, action: Action) -> Message | None:
    """The message `action` on `rank` sends when it finishes, if any."""
    if plan.chunks > 1:
        return _chunk_outgoing(plan, rank, action)
    dst = output_stage(action.kind, action.stage, plan.num_stages)
    if dst is None:
        return None
    return Message(_channel(action.kind), action.mb, rank, plan.rank(plan.host[dst][action.mb], dst))


def incoming(plan: Plan, rank: int, action: Action) -> Message | None:
    """The message `action` on `rank` must receive before it can run, if any."""
    if plan.chunks > 1:
        return _chunk_incoming(plan, rank, action)
    src = input_stage(action.kind, action.stage, plan.num_stages)
    if src is None:
        return None
    return Message(_channel(action.kind), action.mb, plan.rank(plan.host[src][action.mb], src), rank)


def _chunk_outgoing(plan: Plan, rank: int, action: Action) -> Message | None:
    """outgoing() of a chunked plan: to the worker of host[chunk +- 1][mb] that holds that chunk."""
    dst = output_stage(action.kind, action.stage, plan.num_chunks)
    if dst is None:
        return None
    return Message(_channel(action.kind), action.mb, rank, plan.chunk_rank(plan.host[dst][action.mb], dst),
                   min(dst, action.stage))


def _chunk_incoming(plan: Plan, rank: int, action: Action) -> Message | None:
    """incoming() of a chunked plan: from the worker of host[chunk -+ 1][mb] that holds that chunk."""
    src = input_stage(action.kind, action.stage, plan.num_chunks)
    if src is None:
        return None
    return Message(_channel(action.kind), action.mb, plan.chunk_rank(plan.host[src][action.mb], src), rank,
                   min(src, action.stage))


def _channel(kind: Kind) -> Channel:
    """Forward actions exchange activations; backward ones input-gradients."""
    return Channel.ACTIVATION if kind is Kind.F else Channel.GRADIENT


def send_order(plan: Plan, src: int, dst: int) -> list[Message]:
    """All messages `src` sends to `dst` in one iteration, in the order `src` sends them (its action order)."""
    out = []
    for action in plan.actions[src]:
        message = outgoing(plan, src, action)
        if message is not None and message.dst == dst:
            out.append(message)
    return out
