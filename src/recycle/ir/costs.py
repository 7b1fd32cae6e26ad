"""Durations of actions on a config's cost model: the one definition the simulator, planners and emulation share."""

from __future__ import annotations

from recycle.config import Config
from recycle.ir.actions import Kind

__all__ = ["action_duration", "opt_duration"]


def action_duration(config: Config, kind: Kind, stage: int, num_live: int) -> float:
    """Duration of one action on the config's cost model (OPT = the stage's all-reduce plus its optimizer step)."""
    c = config.costs
    if kind is Kind.F:
        return c.forward[stage]
    if kind is Kind.B:
        return c.backward_input[stage]
    if kind is Kind.W:
        return c.backward_weight[stage]
    if kind is Kind.BW:
        return c.backward_fused[stage]
    return opt_duration(config, stage, num_live)


def opt_duration(config: Config, stage: int, num_live: int) -> float:
    """A stage's OPT: the gradient all-reduce over its `num_live` live replicas, then its optimizer step."""
    return config.communication.allreduce_time(stage, num_live) + config.costs.optimizer[stage]
