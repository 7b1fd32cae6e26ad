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


def test_tied_embeddings_are_refused_not_silently_untied(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"tie_word_embeddings is true, .* set \"tie_word_embeddings\": false"):
        load_hf_config(_write(tmp_path, "llama", tie_word_embeddings=True), SEQ)
    raw = json.loads((EXAMPLES / "hf-tiny-gpt2.json").read_text())
    del raw["tie_word_embeddings"]
    path = tmp_path / "gpt2-default.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"tie_word_embeddings is true \(the gpt2 default when the key is absent\)"):
        load_hf_config(path, SEQ)


def test_configs_the_runtime_cannot_train_are_named(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"num_attention_heads = 4 is not a multiple of num_key_value_heads = 3"):
        load_hf_config(_write(tmp_path, "qwen2", num_key_value_heads=3), SEQ)
    with pytest.raises(ConfigError, match=r"max_position_embeddings = 8 is below \[workload\] seq_len = 16"):
        load_hf_config(_write(tmp_path, "mistral", max_position_embeddings=8), SEQ)
    with pytest.raises(ConfigError, match=r"vocab_size = 100 is below 256"):
        load_hf_config(_write(tmp_path, "llama", vocab_size=100), SEQ)
