"""Micro-batches split into pieces: the global-token loss rule (a piece's gradients are its share of the whole
micro-batch's), the IR field that carries pieces, their validation, costs and data."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from recycle.ir.pieces import Piece, loss_weight
from recycle.models.gpt import full_model
from recycle.runtime.worker.data import data_source


def _grads(model: torch.nn.Module, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def test_whole_microbatch_weight_is_bitwise_one_over_the_global_count() -> None:
    for m in (1, 2, 3, 4, 7, 8):
        for total in (1, 3, 6, 12, 35, 1000):
            assert loss_weight(m, m, total) == 1.0 / total


@pytest.mark.parametrize("cuts", [(0, 1, 4), (0, 2, 4), (0, 1, 2, 4), (0, 3, 4)])
def test_gradients_of_the_pieces_sum_to_the_whole_microbatch(tiny_config, cuts: tuple[int, ...]) -> None:
    config = tiny_config(D=2, M=3)
    config = replace(config, workload=replace(config.workload, microbatch_size=4))
    m, total = 4, config.num_replicas * config.num_microbatches
    model = full_model(config.model, config.workload.seq_len, config.training.seed, "float64")
    tokens, targets = data_source(config)(1, 4)
    assert tokens.shape[0] == m
    whole = _grads(model, model(tokens, targets) * loss_weight(m, m, total))
    summed: dict[str, torch.Tensor] = {}
    for start, stop in zip(cuts, cuts[1:]):
        piece = Piece(4, start, stop)
        loss = model(tokens[start:stop], targets[start:stop]) * loss_weight(piece.samples, m, total)
        for name, grad in _grads(model, loss).items():
            summed[name] = summed[name] + grad if name in summed else grad
    assert summed.keys() == whole.keys()
    worst = max(float((summed[k] - whole[k]).abs().max()) for k in whole)
    assert worst <= 1e-12
    # the pieces' own gradients differ from the whole one's: the sum is what makes them equal (the test can fail)
    single = _grads(model, model(tokens[:cuts[1]], targets[:cuts[1]]) * loss_weight(cuts[1], m, total))
    assert max(float((single[k] - whole[k]).abs().max()) for k in whole) > 1e-6
