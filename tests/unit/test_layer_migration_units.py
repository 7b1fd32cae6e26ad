"""Layer re-partitioning pieces without processes: which layers move, the exchange of parameters and optimizer
state through fake send/recv, and the rebuilt stages holding exactly the state they had between them."""

from __future__ import annotations

from collections import deque

import pytest
import torch

from recycle.config import parse_config
from recycle.errors import ConfigError
from recycle.models.gpt import build_stages
from recycle.runtime.state.migration import (LayerMove, bundles, exchange_layers, layer_bounds, layer_moves,
                                             plan_bounds, rebuild_stage)
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.stage_state import IterationPosition, StageState

CONFIG = parse_config({
    "topology": {"num_replicas": 2, "num_stages": 2}, "workload": {"num_microbatches": 2, "seq_len": 8},
    "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1}, "model": {"preset": "tiny"},
    "training": {"dtype": "float64", "lr": 0.01}})


def test_bounds_and_moves() -> None:
    assert layer_bounds([3, 1]) == [(0, 3), (3, 4)]
    assert plan_bounds(CONFIG, ()) == [(0, 2), (2, 4)] and plan_bounds(CONFIG, (1, 3)) == [(0, 1), (1, 4)]
    assert layer_moves([(0, 2), (2, 4)], [(0, 3), (3, 4)]) == [LayerMove(2, 1, 0)]
    moves = layer_moves([(0, 1), (1, 2), (2, 6)], [(0, 3), (3, 4), (4, 6)])
    assert moves == [LayerMove(1, 1, 0), LayerMove(2, 2, 0), LayerMove(3, 2, 1)]
    assert bundles(moves) == [(1, 0, (1,)), (2, 0, (2,)), (2, 1, (3,))]
    with pytest.raises(ConfigError, match="does not split the model's 4 layers"):
        plan_bounds(CONFIG, (2, 1))


def test_exchange_and_rebuild_keep_every_parameter_and_its_optimizer_state() -> None:
    stages = build_stages(CONFIG.model, 2, seed=0, dtype="float64", seq_len=8)
    optimizers = [make_optimizer(m, CONFIG.training) for m in stages]
    x = torch.randint(0, 256, (2, 8))
    for _ in range(2):  # two steps so that the optimizers hold state and a schedule position
        loss = stages[1](stages[0](x), x)
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    before = {**stages[0].state_dict(), **stages[1].state_dict()}
    state_before = {}
    for module, opt in zip(stages, optimizers):
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        for index, st in opt.state_dict()["optimizer"]["state"].items():
            state_before[names[index]] = st

    wire: deque[torch.Tensor] = deque()
    moves = layer_moves([(0, 2), (2, 4)], [(0, 3), (3, 4)])
    senders, receivers = {0: 0, 1: 1}, {0: [0], 1: [1]}  # one worker per stage: rank = stage
    positions = [IterationPosition(applied=1, snapshot=1) for _ in stages]
    states = [StageState(stages[s], optimizers[s], s, positions[s]) for s in range(2)]
    results = []
    for stage in (1, 0):  # the sender first: the fake wire is a queue
        results.append(exchange_layers(states[stage], moves, senders, receivers, stage,
                                       lambda t, r: wire.append(t.clone()), lambda t, r: t.copy_(wire.popleft()),
                                       torch.device("cpu")))
    (_, sent), (received, got) = results
    assert sent.layers_out == 1 and got.layers_in == 1 and sent.bytes == got.bytes > 0 and not wire
    assert {k for k in received if not k.startswith("optimizer.")} == {n for n in before if n.startswith("blocks.2.")}
    rebuilt = [rebuild_stage(states[0], (0, 3), received, lambda m: make_optimizer(m, CONFIG.training)),
               rebuild_stage(states[1], (3, 4), {}, lambda m: make_optimizer(m, CONFIG.training))]
    after = {**rebuilt[0].module.state_dict(), **rebuilt[1].module.state_dict()}
    assert sorted(after) == sorted(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    assert positions == [IterationPosition(applied=1)] * 2  # the steps done are kept; no snapshot survives
    for module, opt in ((state.module, state.optimizer) for state in rebuilt):
        assert opt.steps == 2
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        for index, st in opt.state_dict()["optimizer"]["state"].items():
            expected = state_before[names[index]]
            assert all(torch.equal(torch.as_tensor(st[k]), torch.as_tensor(expected[k])) for k in expected)
