"""Hugging Face causal LMs built from a config JSON (random init from the run's seed, nothing downloaded) and split
into S stages by decoder layers: embeddings with stage 0, final norm and lm_head with the last.

GPT-2-shaped models (`model_type` gpt2) are supported. Word embeddings are untied (`tie_word_embeddings = false`):
stage 0 holds the input embedding and the last stage the output head, and a weight shared across two stages would
need a gradient exchange between them that the pipeline does not make. The single-process reference builds the same
untied model, so the exactness guarantee (float64, 1e-9) compares like with like.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recycle.errors import ConfigError
from recycle.models.gpt import stage_layers

__all__ = ["HF_EXTRA", "SUPPORTED", "load_hf_config", "build_hf_model", "hf_stages", "HFCausalLM",
           "resolve_hf_path", "num_hf_layers"]

HF_EXTRA = "pip install 'recycle[hf]' (transformers==5.23.0)"
SUPPORTED = ("gpt2",)
MIN_VOCAB = 256  # the data is byte-level


def _transformers() -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be fetched at run time (from_config needs nothing)
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"Hugging Face models (--hf, [model] hf_config) need the optional extra 'hf': {HF_EXTRA}") \
            from None
    return transformers


def resolve_hf_path(path: str, base_dir: str | None = None) -> Path:
    """`path` as given, else relative to the config file's folder (like [training] dataset)."""
    p = Path(path)
    if not p.is_absolute() and not p.exists() and base_dir:
        p = Path(base_dir) / p
    if not p.is_file():
        raise ConfigError(f"[model] hf_config = {path!r} is not a file; give the path of a Hugging Face config JSON "
                          "(e.g. examples/hf-tiny-gpt2.json)")
    return p


def load_hf_config(path: str | Path, seq_len: int) -> Any:
    """The transformers config of a JSON file, checked against the runtime: a supported model_type, a byte-level
    vocabulary (>= 256), context >= seq_len; embeddings untied, no KV cache."""
    from recycle.inputs import MIB, read_input_text, strict_json_loads

    text = read_input_text(path, f"Hugging Face config {str(path)!r}", 16 * MIB,
                           "give the path of a Hugging Face config JSON (e.g. examples/hf-tiny-gpt2.json)")
    try:
        raw = strict_json_loads(text)
    except ValueError as exc:  # json.JSONDecodeError and inputs.UnsafeJSON
        raise ConfigError(f"Hugging Face config {str(path)!r} is not a readable JSON file ({exc})") from None
    if not isinstance(raw, dict) or raw.get("model_type") not in SUPPORTED:
        got = raw.get("model_type") if isinstance(raw, dict) else raw
        raise ConfigError(f"Hugging Face config {str(path)!r}: model_type {got!r} is not supported; supported: "
                          f"{', '.join(SUPPORTED)} (a decoder-only causal LM split by decoder layers)")
    transformers = _transformers()
    raw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "transformers_version")}
    raw.update(tie_word_embeddings=False, use_cache=False)
    config = transformers.AutoConfig.for_model("gpt2", **raw)
    if config.vocab_size < MIN_VOCAB:
        raise ConfigError(f"Hugging Face config {str(path)!r}: vocab_size = {config.vocab_size} is below {MIN_VOCAB}; "
                          f"the data is byte-level, so use vocab_size >= {MIN_VOCAB}")
    if config.n_positions < seq_len:
        raise ConfigError(f"Hugging Face config {str(path)!r}: n_positions = {config.n_positions} is below [workload] "
                          f"seq_len = {seq_len}; raise n_positions or shorten seq_len")
    return config


def num_hf_layers(config: Any) -> int:
    return int(config.num_hidden_layers)


def build_hf_model(path: str | Path, seq_len: int, seed: int, dtype: torch.dtype) -> HFCausalLM:
    """The whole model, randomly initialised from `seed` (the global RNG is left as it was), in `dtype`."""
    transformers = _transformers()
    config = load_hf_config(path, seq_len)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
    return HFCausalLM(model.to(dtype))


class HFCausalLM(nn.Module):
    """The whole HF model as the runtime sees it: token ids in, logits out (the single-process reference)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits


class _GPT2Stage(nn.Module):
    """Decoder layers [first, last) of a GPT-2 LM, with wte/wpe if first == 0 and ln_f + lm_head if it is the last.
    Submodules keep the whole model's names ("model.transformer.h.3.attn..."), so the stages' state dicts together
    are the HFCausalLM's."""

    def __init__(self, whole: HFCausalLM, first: int, last: int) -> None:
        super().__init__()
        lm = whole.model
        self.hf_config = lm.config
        self.first_layer, self.end_layer = first, last  # the checkpoint layout
        self.first_stage, self.last_stage = first == 0, last == lm.config.num_hidden_layers
        self.model = nn.Module()
        self.model.transformer = nn.Module()
        body = self.model.transformer
        if self.first_stage:
            body.wte, body.wpe, body.drop = lm.transformer.wte, lm.transformer.wpe, lm.transformer.drop
        body.h = nn.ModuleDict({str(i): lm.transformer.h[i] for i in range(first, last)})
        if self.last_stage:
            body.ln_f = lm.transformer.ln_f
            self.model.lm_head = lm.lm_head

    def boundary_shape(self, batch: int, seq: int) -> tuple[int, ...]:
        # Known without a run (transformers' mask builder reads values, which the meta device cannot give).
        return (batch, seq, int(self.hf_config.n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        body = self.model.transformer
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        if self.first_stage:
            x = body.drop(body.wte(x) + body.wpe(positions))
        # The mask GPT2Model.forward builds for a batch without padding (None where attention is causal by itself).
        mask = create_causal_mask(config=self.hf_config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=positions)
        for block in body.h.values():
            x = block(x, None, mask, None, use_cache=False, position_ids=positions)
        if self.last_stage:
            x = self.model.lm_head(body.ln_f(x))
        return x


def hf_stages(path: str | Path, num_stages: int, seq_len: int, seed: int, dtype: torch.dtype) -> list[_GPT2Stage]:
    """The S stage modules of the model, sliced by decoder layers as evenly as possible (earlier stages get the
    extra layer), with exactly the weights of build_hf_model(path, seq_len, seed, dtype)."""
    whole = build_hf_model(path, seq_len, seed, dtype)
    bounds = stage_layers(num_hf_layers(whole.model.config), num_stages)
    return [_GPT2Stage(whole, first, last) for first, last in bounds]
