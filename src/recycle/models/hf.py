"""Hugging Face causal LMs built from a config JSON (random init from the run's seed, nothing downloaded), split into
S stages by decoder layers: embeddings with stage 0, final norm and lm_head with the last.

Families (`model_type`): gpt2, and the rotary decoders llama, mistral and qwen2 (RMSNorm, rotary positions, grouped
key/value heads, sliding-window attention where the config asks for it).

What crosses a stage boundary is one tensor, the hidden states [batch, seq, hidden]. Everything else a decoder layer
needs is recomputed inside each stage from that tensor's shape and the config, exactly as the family's own
`*Model.forward` computes it for a batch without padding or cache: the position ids 0..seq-1 (every micro-batch is a
contiguous window of the data, so positions are a function of the shape), the rotary cos/sin from those positions
(each stage holds the model's parameter-free rotary module), and each layer's attention mask (causal, or causal
within `sliding_window` for the layers the config marks "sliding_attention"). Nothing is traced, so nothing crosses a
boundary by luck; tests/unit/test_hf_families.py checks the chained stages against the whole model's logits.

A worker builds only its own stage: the model is laid out on the meta device and just that stage's tensors are
allocated and initialised (hf_stage). Initialisation is a pure function of the seed: each module runs the family's
own `_init_weights` from a generator seeded by (seed, its name in the whole model), so a stage built alone equals the
same stage of the whole model (build_hf_model, which the single-process reference trains). With pretrained weights
(a save_pretrained folder as hf_config, or hf_weights) the stage is initialised, then every state-dict tensor is read
from the safetensors files by its whole-model name, only this stage's (recycle.models.hf_weights).

Tied word embeddings (`tie_word_embeddings: true`, gpt2's default when the key is absent) are kept tied, as
Megatron keeps them: stage 0 holds the input embedding, and the last stage holds its own copy as the lm_head weight
(the same seeded init, or the same pretrained tensor, so the copies start equal). Each stage lists that copy in its
`tied_weights`; the runtime sums the copies' gradients over every live worker of both stages before the optimizer
step (runtime.worker.executor), so the copies stay equal and training equals the tied model trained whole. With one
stage the module is simply the tied model. The parameter count is HF's (the shared weight counted once), and saving
or exporting keeps one copy (`lm_head.weight` left out, as save_pretrained writes a tied model). The single-process
reference builds the same model, so the exactness guarantee (float64, 1e-9) compares like with like.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from recycle.errors import ConfigError
from recycle.models.checkpointing import run_region, run_stage
from recycle.models.gpt import stage_layers
from recycle.models.hf_weights import Pretrained, check_pretrained, load_pretrained, open_pretrained

__all__ = ["HF_EXTRA", "SUPPORTED", "load_hf_config", "build_hf_model", "hf_stages", "HFCausalLM",
           "resolve_hf_path", "num_hf_layers", "hf_dropouts", "describe_hf_model", "hf_stage", "check_hf_model",
           "init_seed", "hf_meta_stages", "resolve_hf_weights", "CONFIG_FILE", "meta_model", "TIED_HEAD",
           "tied_embedding", "tied_copies"]

HF_EXTRA = "pip install 'recycle[hf]' (transformers==5.23.0)"
ROTARY_FAMILIES = ("llama", "mistral", "qwen2")
SUPPORTED = ("gpt2", *ROTARY_FAMILIES)
MIN_VOCAB = 256  # the data is byte-level
CONFIG_FILE = "config.json"  # save_pretrained's
HEAD_MODULE = "lm_head"  # every supported family's output projection
TIED_HEAD = f"{HEAD_MODULE}.weight"  # the output weight a tied model shares with its input embedding
# The input embedding (its whole-model name) of each family: the module whose weight a tied lm_head shares.
EMBEDDING = {"gpt2": "transformer.wte", **{family: "model.embed_tokens" for family in ROTARY_FAMILIES}}
# The dropout probabilities of the supported families' configs (the reference needs them all at 0).
DROPOUT_KEYS = ("embd_pdrop", "resid_pdrop", "attn_pdrop", "attention_dropout")


def _transformers() -> Any:
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing may be fetched at run time (from_config needs nothing)
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"Hugging Face models (--hf, [model] hf_config) need the optional extra 'hf': {HF_EXTRA}") \
            from None
    return transformers


def resolve_hf_path(path: str, base_dir: str | None = None) -> Path:
    """The config JSON `path` names, as given, else relative to the config file's folder (like [training] dataset);
    a folder (save_pretrained's layout) names its config.json."""
    p = _resolve(path, base_dir)
    if p.is_dir():
        if not (p / CONFIG_FILE).is_file():
            raise ConfigError(f"[model] hf_config = {path!r} is a folder without {CONFIG_FILE}; give a Hugging Face "
                              "config JSON or a folder saved by save_pretrained")
        return p / CONFIG_FILE
    if not p.is_file():
        raise ConfigError(f"[model] hf_config = {path!r} is not a file; give the path of a Hugging Face config JSON "
                          "(e.g. examples/hf-tiny-gpt2.json) or of a folder saved by save_pretrained")
    return p


def resolve_hf_weights(hf_config: str, hf_weights: str, base_dir: str | None = None) -> Path | None:
    """Where the run's initial weights come from: [model] hf_weights (a .safetensors file or a save_pretrained
    folder), else the folder [model] hf_config names (from_pretrained's layout), else None (random init)."""
    if hf_weights:
        p = _resolve(hf_weights, base_dir)
        if not p.exists():
            raise ConfigError(f"[model] hf_weights = {hf_weights!r} does not exist; give a .safetensors file or a "
                              "folder saved by save_pretrained")
        return p
    p = _resolve(hf_config, base_dir)
    return p if p.is_dir() else None


def _resolve(path: str, base_dir: str | None) -> Path:
    p = Path(path)
    if not p.is_absolute() and not p.exists() and base_dir:
        p = Path(base_dir) / p
    return p


def load_hf_config(path: str | Path, seq_len: int) -> Any:
    """The transformers config of a JSON file, checked against the runtime: a supported model_type, a byte-level
    vocabulary (>= 256), context >= seq_len, whole groups of key/value heads; no KV cache."""
    from recycle.inputs import MIB, read_input_text, strict_json_loads

    where = f"Hugging Face config {str(path)!r}"
    text = read_input_text(path, where, 16 * MIB,
                           "give the path of a Hugging Face config JSON (e.g. examples/hf-tiny-gpt2.json)")
    try:
        raw = strict_json_loads(text)
    except ValueError as exc:  # json.JSONDecodeError and inputs.UnsafeJSON
        raise ConfigError(f"{where} is not a readable JSON file ({exc})") from None
    model_type = raw.get("model_type") if isinstance(raw, dict) else raw
    if not isinstance(raw, dict) or model_type not in SUPPORTED:
        raise ConfigError(f"{where}: model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED)} "
                          "(a decoder-only causal LM split by decoder layers)")
    transformers = _transformers()
    settings = {k: v for k, v in raw.items()
                if k not in ("model_type", "architectures", "transformers_version", "use_cache")}
    try:
        config = transformers.AutoConfig.for_model(model_type, **settings, use_cache=False)
    except (ValueError, TypeError, KeyError) as exc:  # transformers' own validation of the values
        raise ConfigError(f"{where}: transformers refuses it as a {model_type} config ({exc}); fix that key") from None
    if config.vocab_size < MIN_VOCAB:
        raise ConfigError(f"{where}: vocab_size = {config.vocab_size} is below {MIN_VOCAB}; the data is byte-level, "
                          f"so use vocab_size >= {MIN_VOCAB}")
    positions_key = "n_positions" if model_type == "gpt2" else "max_position_embeddings"
    if config.max_position_embeddings < seq_len:
        raise ConfigError(f"{where}: {positions_key} = {config.max_position_embeddings} is below [workload] seq_len = "
                          f"{seq_len}; raise {positions_key} or shorten seq_len")
    if model_type in ROTARY_FAMILIES:
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        if kv_heads < 1 or heads % kv_heads:
            raise ConfigError(f"{where}: num_attention_heads = {heads} is not a multiple of num_key_value_heads = "
                              f"{kv_heads}; grouped-query attention shares each key/value head by a whole group of "
                              "query heads, so use a divisor (e.g. num_key_value_heads = 1)")
        _attention_kinds(config, where)
    return config


def _attention_kinds(config: Any, where: str = "the Hugging Face config") -> list[str]:
    """The attention each decoder layer of a rotary family uses, as its *Model.forward chooses the mask: qwen2 by
    `layer_types`, mistral sliding-window on every layer when `sliding_window` is set, llama full."""
    n = int(config.num_hidden_layers)
    kinds = getattr(config, "layer_types", None)
    if kinds is None:
        sliding = config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None
        kinds = ["sliding_attention" if sliding else "full_attention"] * n
    unknown = sorted({k for k in kinds if k not in ("full_attention", "sliding_attention")})
    if unknown or len(kinds) < n:
        raise ConfigError(f"{where}: layer_types {list(kinds)!r} must name 'full_attention' or 'sliding_attention' "
                          f"for each of the {n} layers")
    return list(kinds[:n])


def num_hf_layers(config: Any) -> int:
    return int(config.num_hidden_layers)


def hf_dropouts(config: Any) -> dict[str, float]:
    """The config's non-zero dropout probabilities (a whole-model reference cannot reproduce per-stage dropout)."""
    return {k: float(v) for k in DROPOUT_KEYS if (v := getattr(config, k, 0.0))}


def describe_hf_model(path: str | Path, seq_len: int) -> str:
    """One line naming the model a config builds: family, layers, width, parameters (counted on the meta device)."""
    config = load_hf_config(path, seq_len)
    params = sum(p.numel() for p in meta_model(config).parameters())
    return (f"the Hugging Face {config.model_type} model of {str(path)!r} ({config.num_hidden_layers} layers, hidden "
            f"{config.hidden_size}, {params:,} parameters)")


def tied_embedding(config: Any) -> str | None:
    """The input embedding (its whole-model name) whose weight the lm_head shares, or None: untied embeddings."""
    return EMBEDDING[config.model_type] if config.tie_word_embeddings else None


def tied_copies(config: Any) -> dict[str, str]:
    """The whole-model state-dict names that only repeat another tensor (a tied model's lm_head weight), each with
    the name of the tensor it repeats: what is left out where the model is written once (--save, --export-hf, the
    pretrained files' check)."""
    embedding = tied_embedding(config)
    return {} if embedding is None else {TIED_HEAD: f"{embedding}.weight"}


def meta_model(config: Any) -> nn.Module:
    """The whole HF model on the meta device: its structure and tensor shapes, no memory."""
    transformers = _transformers()
    with torch.device("meta"):
        lm = transformers.AutoModelForCausalLM.from_config(config)
    embedding = tied_embedding(config)
    if embedding is not None and lm.get_submodule(HEAD_MODULE).weight is not \
            lm.get_submodule(embedding).weight:  # a family (or transformers version) that ties another way
        raise ConfigError(f"tie_word_embeddings is true, but this {config.model_type} model does not share "
                          f"{embedding}.weight as its {TIED_HEAD} the way recycle splits it; set "
                          "\"tie_word_embeddings\": false (a separate lm_head) or use transformers==5.23.0")
    return lm


def _stage_parts(config: Any, first: int, last: int) -> list[str]:
    """The names (in the HF model) of the submodules a stage holding decoder layers [first, last) needs."""
    if config.model_type == "gpt2":
        embeddings, layers, shared, head = ["transformer.wte", "transformer.wpe"], "transformer.h", [], \
            ["transformer.ln_f", "lm_head"]
    else:  # the rotary families: every stage recomputes cos/sin, so every stage has the rotary module
        embeddings, layers, shared, head = ["model.embed_tokens"], "model.layers", ["model.rotary_emb"], \
            ["model.norm", "lm_head"]
    tied = tied_embedding(config)
    if tied is not None:  # the lm_head's weight is the input embedding's (_tie): never allocated on its own
        head = [part for part in head if part != HEAD_MODULE] + ([tied] if first > 0 else [])
    return [*(embeddings if first == 0 else []), *(f"{layers}.{i}" for i in range(first, last)), *shared,
            *(head if last == num_hf_layers(config) else [])]


def _tie(lm: nn.Module, config: Any) -> None:
    """Share the materialised input embedding's weight as the lm_head's (what tie_weights did on the meta device,
    undone by allocating the two modules one by one): one tensor, initialised or loaded under the embedding's name."""
    embedding = tied_embedding(config)
    if embedding is not None and not lm.get_submodule(embedding).weight.is_meta:
        lm.get_submodule(HEAD_MODULE).weight = lm.get_submodule(embedding).weight


def init_seed(seed: int, name: str) -> int:
    """The seed of the module `name` (its name in the whole HF model) in a run seeded `seed`."""
    digest = hashlib.sha256(f"recycle-hf-init:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _materialise(lm: nn.Module, parts: list[str], seed: int, dtype: torch.dtype) -> None:
    """Allocate the tensors of the submodules `parts` of a meta-device HF model and initialise them with the model's
    own `_init_weights`, module by module, children before parents (as transformers does), each from a generator
    seeded by (seed, the module's whole-model name): so a module's initial weights are the same whichever other
    modules this process builds, and the global RNG is left as it was."""
    init_weights = lm._init_weights  # type: ignore[attr-defined]
    for part in parts:
        root = lm.get_submodule(part)
        root.to_empty(device="cpu")
        modules = [(f"{part}.{name}" if name else part, m) for name, m in root.named_modules()]
        for module in (m for _, m in modules):  # transformers skips what it marked as initialised (e.g. loaded)
            module.__dict__.pop("_is_hf_initialized", None)
            for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                t.__dict__.pop("_is_hf_initialized", None)
        for name, module in reversed(modules):  # named_modules is parents first: reversed, children first
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(init_seed(seed, name))
                init_weights(module)
        root.to(dtype)


def _check_materialised(module: nn.Module, what: str) -> None:
    left = [name for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_meta]
    if left:  # a family whose stage needs a tensor outside _stage_parts: a bug here, not the user's
        raise RuntimeError(f"{what}: tensors {left[:3]} were not materialised")


def _open_weights(config: Any, config_path: str | Path, weights: str | Path | None, seq_len: int) -> Pretrained | None:
    """The pretrained weights at `weights` for the model of `config` (None: random init). A folder's own
    config.json, when it is not the run's config file itself, must describe the same model."""
    if weights is None:
        return None
    weights = Path(weights)
    beside = weights / CONFIG_FILE
    if weights.is_dir() and beside.is_file() and beside.resolve() != Path(config_path).resolve():
        theirs = load_hf_config(beside, seq_len)
        ours_dict, theirs_dict = _model_settings(config), _model_settings(theirs)
        differ = sorted(k for k in {*ours_dict, *theirs_dict} if ours_dict.get(k) != theirs_dict.get(k))
        if differ:
            shown = ", ".join(f"{k} = {theirs_dict.get(k)!r} there, {ours_dict.get(k)!r} in the run's"
                              for k in differ[:3])
            more = f" and {len(differ) - 3} more" if len(differ) > 3 else ""
            raise ConfigError(f"the pretrained weights {str(weights)!r} come with a {CONFIG_FILE} that disagrees with "
                              f"the run's Hugging Face config {str(config_path)!r}: {shown}{more}; train with the "
                              f"folder's config (--hf {str(weights)!r}) or give weights of the run's model")
    return open_pretrained(weights)


# Keys of a saved config.json that say how it was saved, not what the model is.
NOT_THE_MODEL = ("transformers_version", "architectures", "dtype", "torch_dtype", "_name_or_path", "use_cache")


def _model_settings(config: Any) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k not in NOT_THE_MODEL}


def _whole_model_tensors(lm: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(name, tuple(t.shape)) for name, t in lm.state_dict().items()]


def _load_parts(lm: nn.Module, parts: list[str], weights: Pretrained) -> None:
    """Overwrite the state-dict tensors of the submodules `parts` (materialised) with the pretrained ones; the
    non-persistent buffers (rotary frequencies) keep their computed values."""
    tensors = {f"{part}.{key}": t for part in parts for key, t in lm.get_submodule(part).state_dict().items()}
    load_pretrained(weights, tensors, str(lm.base_model_prefix))


def _build(config: Any, config_path: str | Path, parts: list[str], seed: int, dtype: torch.dtype,
           weights: str | Path | None, seq_len: int) -> nn.Module:
    """The HF model on the meta device with the submodules `parts` materialised: initialised from the seed, then,
    with `weights`, their tensors read from the pretrained files."""
    pretrained = _open_weights(config, config_path, weights, seq_len)
    lm = meta_model(config)
    _materialise(lm, parts, seed, dtype)
    if pretrained is not None:
        _load_parts(lm, parts, pretrained)
    _tie(lm, config)
    return lm


def build_hf_model(path: str | Path, seq_len: int, seed: int, dtype: torch.dtype,
                   weights: str | Path | None = None) -> HFCausalLM:
    """The whole model in `dtype`, each module initialised from (seed, its name) (see _materialise), or with the
    pretrained `weights` (a .safetensors file or a save_pretrained folder)."""
    config = load_hf_config(path, seq_len)
    lm = _build(config, path, _stage_parts(config, 0, num_hf_layers(config)), seed, dtype, weights, seq_len)
    whole = HFCausalLM(lm)
    _check_materialised(whole, "the whole model")
    return whole


class HFCausalLM(nn.Module):
    """The whole HF model as the runtime sees it: token ids in, logits out (the single-process reference)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits


class _HFStage(nn.Module):
    """Decoder layers [first, last) of an HF causal LM. Submodules keep the whole model's names (e.g.
    "model.model.layers.3.self_attn..."), so the stages' state dicts together are the HFCausalLM's."""

    activation_checkpointing = "none"  # models.checkpointing.MODES; set by models.checkpointing.set_mode

    def __init__(self, config: Any, first: int, last: int) -> None:
        super().__init__()
        self.hf_config = config
        self.first_layer, self.end_layer = first, last  # the checkpoint layout
        self.first_stage, self.last_stage = first == 0, last == config.num_hidden_layers
        # The parameters this stage shares with another (runtime.worker.executor sums their gradients across both):
        # a tied model's input embedding on stage 0 and its copy as the last stage's lm_head weight.
        embedding = tied_embedding(config)
        self.tied_weights: tuple[str, ...] = ()
        if embedding is not None and self.first_stage != self.last_stage:
            self.tied_weights = (f"model.{embedding}.weight" if self.first_stage else f"model.{TIED_HEAD}",)

    def checkpoint_layers(self) -> list[nn.Module]:
        """The regions "per_layer" checkpointing recomputes: the decoder layers."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return run_stage(self.activation_checkpointing, self._forward, x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def boundary_shape(self, batch: int, seq: int) -> tuple[int, ...]:
        # The hidden states. Known without a run (transformers' mask builders read values, which the meta device
        # cannot give).
        return (batch, seq, int(self.hf_config.hidden_size))


class _GPT2Stage(_HFStage):
    """A GPT-2 stage: wte/wpe if first, blocks h[first:last], ln_f + lm_head if last."""

    def __init__(self, lm: nn.Module, first: int, last: int) -> None:
        super().__init__(lm.config, first, last)
        self.model = nn.Module()
        self.model.transformer = nn.Module()
        body = self.model.transformer
        if self.first_stage:
            body.wte, body.wpe, body.drop = lm.transformer.wte, lm.transformer.wpe, lm.transformer.drop
        body.h = nn.ModuleDict({str(i): lm.transformer.h[i] for i in range(first, last)})
        if self.last_stage:
            body.ln_f = lm.transformer.ln_f
            self.model.lm_head = lm.lm_head

    def checkpoint_layers(self) -> list[nn.Module]:
        return list(self.model.transformer.h.values())

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        body = self.model.transformer
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        if self.first_stage:
            x = body.drop(body.wte(x) + body.wpe(positions))
        # The mask GPT2Model.forward builds for a batch without padding (None where attention is causal by itself).
        mask = create_causal_mask(config=self.hf_config, inputs_embeds=x, attention_mask=None, past_key_values=None,
                                  position_ids=positions)
        for block in body.h.values():
            x = run_region(self.activation_checkpointing, block, x, None, mask, None, use_cache=False,
                           position_ids=positions)
        if self.last_stage:
            x = self.model.lm_head(body.ln_f(x))
        return x


class _RotaryStage(_HFStage):
    """A llama / mistral / qwen2 stage: embed_tokens if first, layers[first:last], norm + lm_head if last, and the
    (parameter-free) rotary module on every stage, which recomputes cos/sin from the positions."""

    def __init__(self, lm: nn.Module, first: int, last: int) -> None:
        super().__init__(lm.config, first, last)
        self.attention_kinds = _attention_kinds(lm.config)[first:last]
        self.model = nn.Module()
        self.model.model = nn.Module()
        body = self.model.model
        if self.first_stage:
            body.embed_tokens = lm.model.embed_tokens
        body.layers = nn.ModuleDict({str(i): lm.model.layers[i] for i in range(first, last)})
        body.rotary_emb = lm.model.rotary_emb  # its buffers are not persistent: no state-dict key
        if self.last_stage:
            body.norm = lm.model.norm
            self.model.lm_head = lm.lm_head

    def checkpoint_layers(self) -> list[nn.Module]:
        return list(self.model.model.layers.values())

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        body = self.model.model
        if self.first_stage:
            x = body.embed_tokens(x)
        positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        # The masks the family's *Model.forward builds for a batch without padding or cache (None where attention
        # is causal by itself), one per kind of attention this stage's layers use.
        builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        masks = {kind: builders[kind](config=self.hf_config, inputs_embeds=x, attention_mask=None,
                                      past_key_values=None, position_ids=positions)
                 for kind in dict.fromkeys(self.attention_kinds)}
        position_embeddings = body.rotary_emb(x, position_ids=positions)
        for kind, layer in zip(self.attention_kinds, body.layers.values()):
            x = run_region(self.activation_checkpointing, layer, x, attention_mask=masks[kind], position_ids=positions,
                           past_key_values=None, use_cache=False, position_embeddings=position_embeddings)
        if self.last_stage:
            x = self.model.lm_head(body.norm(x))
        return x


def _bounds(config: Any, num_stages: int) -> list[tuple[int, int]]:
    """[first, last) decoder layers per stage (stage_layers), with the HF config's name for the layer count."""
    n = num_hf_layers(config)
    if 1 <= num_stages <= n:
        return stage_layers(n, num_stages)
    raise ConfigError(f"the Hugging Face config has num_hidden_layers = {n} (n_layer for gpt2) but num_stages = "
                      f"{num_stages}; every stage needs at least one decoder layer: use num_stages <= {n} or a "
                      "deeper model")


def _stage_class(config: Any) -> type[_GPT2Stage] | type[_RotaryStage]:
    return _GPT2Stage if config.model_type == "gpt2" else _RotaryStage


def hf_stages(path: str | Path, num_stages: int, seq_len: int, seed: int, dtype: torch.dtype,
              weights: str | Path | None = None) -> list[_HFStage]:
    """The S stage modules of the model, sliced by decoder layers as evenly as possible (earlier stages get the
    extra layer), with exactly the weights of build_hf_model(path, seq_len, seed, dtype, weights)."""
    whole = build_hf_model(path, seq_len, seed, dtype, weights)
    bounds = _bounds(whole.model.config, num_stages)
    stages = [_stage_class(whole.model.config)(whole.model, first, last) for first, last in bounds]
    if num_stages > 1 and stages[-1].tied_weights:  # the last stage's own copy, as a worker building it alone has
        head = stages[-1].model.lm_head
        head.weight = nn.Parameter(head.weight.detach().clone())
    return stages


def hf_stage(path: str | Path, num_stages: int, stage: int, seq_len: int, seed: int,
             dtype: torch.dtype, weights: str | Path | None = None) -> _HFStage:
    """Stage `stage` of hf_stages(...) built alone: the model is laid out on the meta device and only this stage's
    tensors are allocated and initialised, so its memory is the stage's, not the model's; its weights equal that
    stage of the whole model (each module's initialisation depends only on the seed and its name). With `weights`,
    only this stage's tensors are read from the files."""
    config = load_hf_config(path, seq_len)
    first, last = _bounds(config, num_stages)[stage]
    lm = _build(config, path, _stage_parts(config, first, last), seed, dtype, weights, seq_len)
    module = _stage_class(config)(lm, first, last)
    _check_materialised(module, f"stage {stage}")
    return module


def hf_meta_stages(path: str | Path, num_stages: int, seq_len: int, dtype: torch.dtype) -> list[_HFStage]:
    """The S stage modules of hf_stages(...) on the meta device: their tensors' names, shapes and dtypes, no
    memory (what a resume checks a checkpoint against)."""
    config = load_hf_config(path, seq_len)
    lm = meta_model(config).to(dtype)
    return [_stage_class(config)(lm, first, last) for first, last in _bounds(config, num_stages)]


def check_hf_model(path: str | Path, num_stages: int, seq_len: int, weights: str | Path | None = None) -> None:
    """The checks a run needs before any worker starts, without allocating the model: the config, enough decoder
    layers for the stages, and pretrained weights that hold exactly the model's tensors (names and shapes, from the
    files' headers)."""
    config = load_hf_config(path, seq_len)
    _bounds(config, num_stages)
    lm = meta_model(config)
    pretrained = _open_weights(config, path, weights, seq_len)
    if pretrained is not None:
        copies = tied_copies(config)  # a tied model's files need no lm_head weight, and one there is not read
        check_pretrained(pretrained, [(n, s) for n, s in _whole_model_tensors(lm) if n not in copies],
                         str(lm.base_model_prefix),
                         [*(getattr(lm, "_keys_to_ignore_on_load_unexpected", None) or ()),
                          *(f"^{re.escape(name)}$" for name in copies)])
