"""recycle.models.split: boundary shapes from one micro-batch on the meta device, pipelining splits, and clear
errors for stages the runtime cannot chain."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recycle.config import parse_config
from recycle.errors import ConfigError
from recycle.models.split import StageModel, as_stage_model, boundary_shapes, causal_lm_loss, split_model
from recycle.runtime.worker.stage import build_stage, check_model


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 12)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb(tokens)


class _Widen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(12, 20)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def plain_modules(config, num_stages: int) -> list[nn.Module]:
    torch.manual_seed(config.training.seed)
    return [_Embed(), _Widen(), nn.Linear(20, 256)]


def returns_a_tuple(config, num_stages: int) -> StageModel:
    return StageModel((_Embed(), _Pair(), nn.Linear(12, 256)), causal_lm_loss)


def _config():
    return parse_config({"topology": {"num_replicas": 1, "num_stages": 3},
                         "workload": {"num_microbatches": 3, "microbatch_size": 2, "seq_len": 5},
                         "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
                         "training": {"dtype": "float64"}})


def test_boundary_shapes_come_from_a_meta_run_without_touching_the_weights() -> None:
    stages = plain_modules(_config(), 3)
    before = stages[1].lin.weight.clone()
    assert boundary_shapes(stages, 2, 5) == [(2, 5, 12), (2, 5, 20)]
    assert stages[1].lin.weight.device.type == "cpu" and torch.equal(stages[1].lin.weight, before)


def test_build_stage_needs_no_boundary_shape_method_and_keeps_the_dtype() -> None:
    factory = f"{__name__}:plain_modules"
    check_model(_config(), factory)
    built = build_stage(_config(), 1, factory)
    assert built.input_shape == (2, 5, 12) and built.output_shape == (2, 5, 20) and built.loss_fn is None
    assert built.module.lin.weight.dtype == torch.float64


def test_a_stage_that_returns_several_tensors_is_named() -> None:
    with pytest.raises(ConfigError, match=r"stage 1 returns a tuple of 2 values; the runtime sends one tensor"):
        check_model(_config(), f"{__name__}:returns_a_tuple")


def test_a_factory_with_the_wrong_stage_count_or_type_is_named() -> None:
    with pytest.raises(ConfigError, match=r"returned 2 stages but num_stages = 3"):
        as_stage_model([_Embed(), _Widen()], 3, "model factory 'x:y'")
    with pytest.raises(ConfigError, match=r"returned dict"):
        as_stage_model({}, 3, "model factory 'x:y'")


@pytest.mark.timeout(120)
def test_pipelining_stages_chain_to_the_whole_model_and_their_shapes_are_found() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(256, 8), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 256))
    tokens = torch.randint(0, 256, (2, 6))
    stages = split_model(model, ["1", "3"], tokens)
    assert len(stages) == 3
    assert boundary_shapes(stages, 2, 6) == [(2, 6, 8), (2, 6, 8)]
    out = tokens
    for stage in stages:
        out = stage(out)
    assert torch.equal(out, model(tokens))
    names = {k for s in stages for k in s.state_dict()}
    assert names == set(model.state_dict())  # the stages partition the model's own parameter names
