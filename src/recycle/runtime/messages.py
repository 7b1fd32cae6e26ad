"""Point-to-point messages implied by a plan: who sends what to whom, their tags, and the per-pair order.

Every message is an activation (F of `mb` at stage s -> host[s+1][mb]) or an input-gradient (B/BW of `mb` at
stage s -> host[s-1][mb]). Both ends derive the per-pair order from the sender's action list, so the receiver can
take messages from one peer strictly in the order they were sent. That makes the runtime correct on transports
without tags (NCCL) too: tags are only a second safety net on gloo.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from recycle.errors import PlanError
from recycle.ir import Action, Kind, Plan

__all__ = ["Channel", "Message", "outgoing", "incoming", "send_order", "message_tag", "check_plan_matches"]


class Channel(IntEnum):
    ACTIVATION = 1  # forward output, sent downstream
    GRADIENT = 2  # input-gradient, sent upstream


@dataclass(frozen=True, slots=True)
class Message:
    channel: Channel
    mb: int
    src: int  # topology rank
    dst: int  # topology rank


def message_tag(channel: Channel, mb: int) -> int:
    """A tag unique per (channel, micro-batch) between one pair within an iteration."""
    return (int(channel) << 24) | mb


def outgoing(plan: Plan, rank: int, action: Action) -> Message | None:
    """The message `action` on `rank` sends when it finishes, if any."""
    s = action.stage
    if action.kind is Kind.F and s < plan.num_stages - 1:
        return Message(Channel.ACTIVATION, action.mb, rank, plan.rank(plan.host[s + 1][action.mb], s + 1))
    if action.kind in (Kind.B, Kind.BW) and s > 0:
        return Message(Channel.GRADIENT, action.mb, rank, plan.rank(plan.host[s - 1][action.mb], s - 1))
    return None


def incoming(plan: Plan, rank: int, action: Action) -> Message | None:
    """The message `action` on `rank` must receive before it can run, if any."""
    s = action.stage
    if action.kind is Kind.F and s > 0:
        return Message(Channel.ACTIVATION, action.mb, plan.rank(plan.host[s - 1][action.mb], s - 1), rank)
    if action.kind in (Kind.B, Kind.BW) and s < plan.num_stages - 1:
        return Message(Channel.GRADIENT, action.mb, plan.rank(plan.host[s + 1][action.mb], s + 1), rank)
    return None


def send_order(plan: Plan, src: int, dst: int) -> list[Message]:
    """All messages `src` sends to `dst` in one iteration, in the order `src` sends them (its action order)."""
    out = []
    for action in plan.actions[src]:
        message = outgoing(plan, src, action)
        if message is not None and message.dst == dst:
            out.append(message)
    return out


def check_plan_matches(plan: Plan, num_replicas: int, num_stages: int, num_microbatches: int,
                       source: str = "the plan") -> None:
    """Raise PlanError unless the plan was made for this D, S, M."""
    got = (plan.num_replicas, plan.num_stages, plan.num_microbatches)
    want = (num_replicas, num_stages, num_microbatches)
    if got != want:
        raise PlanError(f"{source} is for D={got[0]}, S={got[1]}, M={got[2]} but the config has D={want[0]}, "
                        f"S={want[1]}, M={want[2]}; make the plan from this config (recycle plan/schedule "
                        "--config ...) or pass the config the plan was made for")
