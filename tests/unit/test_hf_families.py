"""Hugging Face families (gpt2, llama, mistral, qwen2) split by decoder layers: the chained stages compute the whole
model's logits (rotary positions, masks and sliding windows recomputed in each stage, nothing else crossing), the
stages hold exactly the whole model's parameters, and configs the runtime cannot train are refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from recycle.errors import ConfigError

pytest.importorskip("transformers")  # in requirements.txt; the optional extra 'hf' for users

from recycle.models.hf import SUPPORTED, build_hf_model, hf_stages, load_hf_config  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SEQ = 16


def _write(tmp_path: Path, family: str, **changes: object) -> Path:
    raw = json.loads((EXAMPLES / f"hf-tiny-{family}.json").read_text())
    raw.update(changes)
    path = tmp_path / f"{family}.json"
    path.write_text(json.dumps(raw))
    return path


def _chained_and_whole(path: Path, num_stages: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        x = tokens
        for stage in hf_stages(path, num_stages, SEQ, 5, torch.float64):
            x = stage(x)
        return x, build_hf_model(path, SEQ, 5, torch.float64)(tokens)


@pytest.mark.parametrize("family", SUPPORTED)
def test_every_family_has_an_example_whose_stages_compute_the_whole_model(family: str) -> None:
    import transformers

    path = EXAMPLES / f"hf-tiny-{family}.json"
    chained, whole = _chained_and_whole(path, 3)
    assert torch.equal(chained, whole)
    stages = hf_stages(path, 3, SEQ, 5, torch.float64)
    keys = [k for s in stages for k in s.state_dict()]
    assert len(keys) == len(set(keys))  # each parameter on one stage
    assert sorted(keys) == sorted(build_hf_model(path, SEQ, 5, torch.float64).state_dict())
    # The parameter count is the one transformers gives the same JSON (no embedding untied behind its back).
    raw = json.loads(path.read_text())
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**raw))
    assert sum(p.numel() for s in stages for p in s.parameters()) == sum(p.numel() for p in hf.parameters())


def test_the_rotary_examples_use_grouped_query_attention() -> None:
    for family in ("llama", "mistral", "qwen2"):
        config = load_hf_config(EXAMPLES / f"hf-tiny-{family}.json", SEQ)
        assert config.num_key_value_heads < config.num_attention_heads, family


@pytest.mark.parametrize("family,window,full", [
    ("mistral", {"sliding_window": 4}, {"sliding_window": None}),
    # qwen2: layers >= max_window_layers slide, the others attend fully: stages see both kinds.
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}, {}),
])
def test_sliding_window_layers_are_masked_in_every_stage(tmp_path, family: str, window: dict, full: dict) -> None:
    chained, whole = _chained_and_whole(_write(tmp_path, family, **window), 2)
    assert torch.equal(chained, whole)
    # The window is shorter than the sequence, so a stage that attended fully would compute other logits.
    (tmp_path / "full").mkdir()
    full_attention = build_hf_model(_write(tmp_path / "full", family, **full), SEQ, 5, torch.float64)
    tokens = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert float((full_attention(tokens) - whole).abs().max()) > 1e-6


@pytest.mark.parametrize("family", SUPPORTED)
def test_tied_embeddings_stay_tied_and_each_end_holds_the_shared_weight(tmp_path, family: str) -> None:
    """A tied model's stages compute its logits; stage 0 holds the input embedding, the last stage a copy as its
    lm_head weight, equal to it (built alone too), and the whole model ties them as transformers does."""
    from recycle.models.hf import hf_stage

    path = _write(tmp_path, family, tie_word_embeddings=True)
    chained, whole = _chained_and_whole(path, 3)
    assert torch.equal(chained, whole)
    lm = build_hf_model(path, SEQ, 5, torch.float64).model
    assert lm.lm_head.weight is lm.get_input_embeddings().weight  # one parameter in the whole model
    stages = hf_stages(path, 3, SEQ, 5, torch.float64)
    (embedding,), (), (head,) = [s.tied_weights for s in stages]
    assert head == "model.lm_head.weight"
    assert embedding.endswith("wte.weight" if family == "gpt2" else "embed_tokens.weight")
    first, last = stages[0].get_parameter(embedding), stages[2].get_parameter(head)
    assert first is not last and torch.equal(first, last)  # two copies (two workers), equal
    assert torch.equal(first, lm.get_input_embeddings().weight)
    alone = hf_stage(path, 3, 2, SEQ, 5, torch.float64)
    assert torch.equal(alone.get_parameter(head), first) and "model.lm_head.weight" in alone.state_dict()
    assert not any(".embed_tokens." in k or ".wte." in k for k in alone.state_dict())  # the copy is the lm_head's
    one = hf_stages(path, 1, SEQ, 5, torch.float64)[0]
    assert one.tied_weights == ()  # one stage: the tied model itself, nothing shared across stages


def test_a_tied_models_parameter_count_is_transformers_own(tmp_path) -> None:
    """gpt2's defaults (the key absent: tied): the count describe_hf_model reports is the one transformers gives the
    same config (124.4 M for GPT-2 small), the shared weight counted once."""
    import transformers

    from recycle.models.hf import describe_hf_model

    path = tmp_path / "gpt2-defaults.json"
    path.write_text(json.dumps({"model_type": "gpt2"}))
    config = load_hf_config(path, SEQ)
    assert config.tie_word_embeddings
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(config).num_parameters()
    untied = theirs + config.vocab_size * config.n_embd
    described = describe_hf_model(path, SEQ)
    assert f"{theirs:,} parameters" in described and f"{untied:,}" not in described


def test_a_family_that_ties_another_way_is_named(tmp_path, monkeypatch) -> None:
    from recycle.models import hf

    monkeypatch.setitem(hf.EMBEDDING, "llama", "model.norm")  # stands for a transformers that ties elsewhere
    with pytest.raises(ConfigError, match=r"tie_word_embeddings is true, but this llama model does not share "
                                          r"model.norm.weight .* set \"tie_word_embeddings\": false"):
        hf.meta_model(load_hf_config(_write(tmp_path, "llama", tie_word_embeddings=True), SEQ))


def test_configs_the_runtime_cannot_train_are_named(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"):
        load_hf_config(_write(tmp_path, "qwen2", num_key_value_heads=3), SEQ)
    with pytest.raises(ConfigError, match=r"max_position_embeddings = 8 is below \[workload\] seq_len = 16"):
        load_hf_config(_write(tmp_path, "mistral", max_position_embeddings=8), SEQ)
    with pytest.raises(ConfigError, match=r"vocab_size = 100 is below 256"):
        load_hf_config(_write(tmp_path, "llama", vocab_size=100), SEQ)


@pytest.mark.parametrize("family", SUPPORTED)
def test_a_stage_built_alone_equals_that_stage_of_the_whole_model(family: str) -> None:
    from recycle.models.hf import hf_stage

    path = EXAMPLES / f"hf-tiny-{family}.json"
    rng = torch.get_rng_state()
    sliced = hf_stages(path, 3, SEQ, 5, torch.float64)
    for s in range(3):
        alone = hf_stage(path, 3, s, SEQ, 5, torch.float64)
        mine, theirs = dict(alone.named_buffers()), dict(sliced[s].named_buffers())
        mine.update(alone.state_dict())
        theirs.update(sliced[s].state_dict())
        assert sorted(mine) == sorted(theirs)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), s
        assert all(t.dtype == torch.float64 for t in alone.state_dict().values())
    assert torch.equal(torch.get_rng_state(), rng)  # initialisation draws from its own generators
    # Another seed, other weights.
    other = hf_stage(path, 3, 1, SEQ, 6, torch.float64).state_dict()
    drawn = [k for k, v in sliced[1].state_dict().items() if float(v.std()) > 0]
    assert drawn and all(not torch.equal(other[k], sliced[1].state_dict()[k]) for k in drawn)


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_initialisation_is_transformers_own_scheme_per_module(family: str) -> None:
    """Each tensor is drawn by the family's _init_weights (a norm's ones, a bias's zeros, normal(0, 0.02) weights,
    GPT-2's residual projections at 0.02 / sqrt(2 n_layer)): only the random stream differs from from_config's."""
    import transformers

    path = EXAMPLES / f"hf-tiny-{family}.json"
    ours = {k.removeprefix("model."): v for k, v in build_hf_model(path, SEQ, 5, torch.float32).state_dict().items()}
    torch.manual_seed(5)
    hf = transformers.AutoModelForCausalLM.from_config(load_hf_config(path, SEQ)).state_dict()
    assert sorted(ours) == sorted(hf)
    for key, theirs in hf.items():
        if float(theirs.std()) == 0.0:  # ones and zeros: exactly transformers'
            assert torch.equal(ours[key], theirs), key
        else:  # the same distribution (sample std within 15 %), another draw
            assert abs(float(ours[key].std()) / float(theirs.std()) - 1) < 0.15, key
            assert abs(float(ours[key].mean())) < 0.2 * float(theirs.std()), key
            assert not torch.equal(ours[key], theirs), key
    layers = [k for k in ours if k.endswith("0.mlp.c_fc.weight" if family == "gpt2" else "0.mlp.up_proj.weight")]
    assert not torch.equal(ours[layers[0]], ours[layers[0].replace(".0.", ".1.")])  # each layer its own draw


def test_a_resume_checks_checkpoints_against_the_stages_laid_out_on_meta() -> None:
    from recycle.config import parse_config
    from recycle.runtime.control.preflight import expected_stages

    path = EXAMPLES / "hf-tiny-qwen2.json"
    config = parse_config({"topology": {"num_replicas": 1, "num_stages": 3},
                           "workload": {"num_microbatches": 3, "microbatch_size": 2, "seq_len": SEQ},
                           "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
                           "model": {"hf_config": str(path)}, "training": {"dtype": "float64", "seed": 5}})
    specs = expected_stages(config)
    real = hf_stages(path, 3, SEQ, 5, torch.float64)
    assert [spec.layers for spec in specs] == [(m.first_layer, m.end_layer) for m in real] == [(0, 2), (2, 3), (3, 4)]
    for spec, stage in zip(specs, real):
        assert spec.tensors == {k: (tuple(v.shape), v.dtype) for k, v in stage.state_dict().items()}
        assert spec.trainable == {k: tuple(p.shape) for k, p in stage.named_parameters()}


def test_more_stages_than_decoder_layers_is_named() -> None:
    from recycle.models.hf import check_hf_model

    with pytest.raises(ConfigError, match=r"num_hidden_layers = 4 .* but num_stages = 5; .* use num_stages <= 4"):
        check_hf_model(EXAMPLES / "hf-tiny-llama.json", 5, SEQ)
