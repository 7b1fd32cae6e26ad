"""A split plan's micro-batch pieces on a worker: the samples a piece loads, the shape of the tensors it receives."""

from __future__ import annotations

from typing import Callable

import torch

from recycle.ir import Plan

__all__ = ["load_piece", "piece_shape"]


def load_piece(load: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], plan: Plan, iteration: int,
               mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets) of micro-batch id `mb`: its data micro-batch, or that micro-batch's samples [start, stop)
    for a piece of a split plan (the data source stays a function of whole micro-batches)."""
    if not plan.pieces:
        return load(iteration, mb)
    piece = plan.pieces[mb]
    inputs, targets = load(iteration, piece.source)
    if inputs.shape[0] != plan.microbatch_size or targets.shape[0] != plan.microbatch_size:
        raise RuntimeError(f"the plan splits micro-batches of {plan.microbatch_size} samples, but the data source's "
                           f"micro-batch {piece.source} has {inputs.shape[0]} (targets: {targets.shape[0]}) along its "
                           "first dimension; make the plan from the config the data was made for")
    return inputs[piece.start:piece.stop], targets[piece.start:piece.stop]


def piece_shape(plan: Plan, mb: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of a tensor of micro-batch id `mb` whose whole micro-batch's is `shape` (batch first)."""
    if not plan.pieces:
        return shape
    if not shape or shape[0] != plan.microbatch_size:
        raise RuntimeError(f"a split plan needs stage boundaries whose first dimension is the micro-batch's "
                           f"{plan.microbatch_size} samples, not {shape}; run this model with an unsplit plan")
    return (plan.pieces[mb].samples, *shape[1:])
