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


@pytest.mark.parametrize("num_stages", [2, 3])
def test_a_stage_built_alone_equals_that_stage_of_the_whole_model(num_stages: int) -> None:
    """Per-stage construction: only the stage's tensors are allocated and initialised, each module from
    (seed, its name), so it equals the whole model's same tensors, and the global RNG is untouched."""
    from recycle.models.gpt import build_stage

    spec = ModelSpec(preset="custom", vocab_size=256, n_layer=5, n_head=2, n_embd=16)
    whole = full_model(spec, seq_len=8, seed=4, dtype="float64").state_dict()
    rng = torch.get_rng_state()
    bounds = stage_layers(5, num_stages)
    for s in range(num_stages):
        alone = build_stage(spec, num_stages, s, seed=4, dtype="float64", seq_len=8)
        assert (alone.first, alone.last) == bounds[s]
        own = alone.state_dict()
        assert own and all(torch.equal(own[k], whole[k]) for k in own), s
        assert not any(t.is_meta for t in own.values())
    assert torch.equal(torch.get_rng_state(), rng)
    # nanoGPT's scheme: LayerNorm ones and zeros, zero biases, normal(0, 0.02) weights, each module its own draw.
    assert torch.equal(whole["ln_f.weight"], torch.ones(16, dtype=torch.float64))
    assert torch.equal(whole["blocks.0.ln_1.bias"], torch.zeros(16, dtype=torch.float64))
    assert torch.equal(whole["blocks.2.attn.c_attn.bias"], torch.zeros(48, dtype=torch.float64))
    assert abs(float(whole["wte.weight"].std()) / 0.02 - 1) < 0.1
    assert not torch.equal(whole["blocks.0.mlp.0.weight"], whole["blocks.1.mlp.0.weight"])
    # A layer moved to another stage keeps its initial weights (its name is the whole model's).
    moved = build_stage(spec, 2, 0, seed=4, dtype="float64", seq_len=8, bounds=[(0, 4), (4, 5)])
    assert torch.equal(moved.state_dict()["blocks.3.attn.c_proj.weight"], whole["blocks.3.attn.c_proj.weight"])
