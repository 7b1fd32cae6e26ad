"""The built-in GPT: presets, stage partitioning (same init as the whole model), the stage call contract."""

from __future__ import annotations

import pytest
import torch

from recycle.config import ModelSpec
from recycle.errors import ConfigError
from recycle.models.gpt import PRESETS, build_stages, full_model, resolve_shape, stage_layers


def test_stage_layers_split_evenly_and_cover_all_layers() -> None:
    assert stage_layers(4, 2) == [(0, 2), (2, 4)]
    assert stage_layers(5, 3) == [(0, 2), (2, 4), (4, 5)]
    assert stage_layers(3, 3) == [(0, 1), (1, 2), (2, 3)]


def test_more_stages_than_layers_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="n_layer = 4 .* num_stages = 5"):
        build_stages(ModelSpec(), 5, seed=0)


def test_presets_resolve_and_fields_override() -> None:
    assert resolve_shape(ModelSpec(preset="small"), 64).n_layer == PRESETS["small"].n_layer
    assert resolve_shape(ModelSpec(preset="small", n_layer=3), 64).n_layer == 3
    with pytest.raises(ConfigError, match="preset"):
        resolve_shape(ModelSpec(preset="huge"), 64)


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_stages_compose_to_the_whole_model(num_stages: int) -> None:
    """Chaining the stages gives the whole model's loss and gradients exactly: same init, same maths."""
    spec = ModelSpec()
    whole = full_model(spec, seq_len=16, seed=3, dtype="float64")
    stages = build_stages(spec, num_stages, seed=3, dtype="float64", seq_len=16)
    merged = {}
    for stage in stages:
        merged.update(stage.state_dict())
    assert merged.keys() == whole.state_dict().keys()
    for key, value in whole.state_dict().items():
        assert torch.equal(value, merged[key]), key

    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    targets = torch.roll(tokens, -1, dims=1)
    loss_whole = whole(tokens, targets)
    loss_whole.backward()
    x = tokens
    for stage in stages[:-1]:
        x = stage(x)
        assert x.shape == stage.boundary_shape(2, 16)
    loss_stages = stages[-1](x, targets)
    loss_stages.backward()
    assert torch.equal(loss_whole, loss_stages)
    grads = {n: p.grad for stage in stages for n, p in stage.named_parameters()}
    for name, p in whole.named_parameters():
        assert torch.allclose(p.grad, grads[name], rtol=0, atol=1e-14), name


def test_init_depends_on_seed_not_on_global_rng() -> None:
    torch.manual_seed(123)
    a = full_model(ModelSpec(), 8, seed=1).state_dict()
    torch.manual_seed(456)
    b = full_model(ModelSpec(), 8, seed=1).state_dict()
    c = full_model(ModelSpec(), 8, seed=2).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["wte.weight"], c["wte.weight"])


def test_float32_stages_are_the_float64_init_rounded() -> None:
    s32 = build_stages(ModelSpec(), 2, seed=0, dtype="float32", seq_len=8)[0].state_dict()
    s64 = build_stages(ModelSpec(), 2, seed=0, dtype="float64", seq_len=8)[0].state_dict()
    assert s32["wte.weight"].dtype == torch.float32
    assert torch.equal(s32["wte.weight"], s64["wte.weight"].float())
