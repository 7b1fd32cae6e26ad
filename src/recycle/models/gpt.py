"""The built-in nanoGPT-like model, its presets and its partitioning into pipeline stages by layers.

A stage is built alone (build_stage): only its tensors are allocated and initialised, each module from a generator
seeded by (seed, its name in the whole model), so a worker's memory is its stage's and a stage built alone equals the
same stage of the whole model (full_model, which the single-process reference trains).

Stage call contract (the runtime relies on nothing else, so any list of S modules that keeps it can be trained --
"bring your own model"):
  * stage 0 takes a LongTensor of token ids [batch, seq]; every other stage takes the previous stage's output;
  * every stage but the last returns one floating tensor whose shape is `boundary_shape(batch, seq)`;
  * the last stage is called as `stage(x, targets)` and returns the scalar mean loss of the micro-batch;
  * with one stage, stage 0 is also the last: `stage(tokens, targets)`.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from recycle.config import ModelSpec
from recycle.errors import ConfigError
from recycle.models.checkpointing import run_region, run_stage

__all__ = ["PRESETS", "GPTShape", "resolve_shape", "GPTStage", "full_model", "build_stages", "build_stage",
           "stage_layers", "init_seed", "DTYPES"]

DTYPES = {"float32": torch.float32, "float64": torch.float64}
INIT_CHUNK = 1 << 20  # elements drawn at once by the initialisation (8 MiB in float64)


@dataclass(frozen=True)
class GPTShape:
    """The architecture actually built: a ModelSpec resolved against its preset, plus the context length."""

    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int
    dropout: float = 0.0

    @property
    def num_parameters(self) -> int:
        return self.stage_parameters(0, self.n_layer)

    def stage_parameters(self, first: int, last: int) -> int:
        """The parameters of the stage holding layers [first, last) (GPTStage: embeddings on the first, head on the
        last)."""
        per_layer = 12 * self.n_embd * self.n_embd + 13 * self.n_embd
        embed = self.vocab_size * self.n_embd + self.block_size * self.n_embd if first == 0 else 0
        head = 2 * self.n_embd + self.vocab_size * self.n_embd + self.vocab_size if last == self.n_layer else 0
        return (last - first) * per_layer + embed + head


# Byte-level vocabulary everywhere: the built-in data and user text files are UTF-8 bytes.
PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(preset="tiny", vocab_size=256, n_layer=4, n_head=2, n_embd=32),
    "small": ModelSpec(preset="small", vocab_size=256, n_layer=8, n_head=4, n_embd=128),
    "medium": ModelSpec(preset="medium", vocab_size=256, n_layer=12, n_head=8, n_embd=256),
    "gpt2": ModelSpec(preset="gpt2", vocab_size=256, n_layer=12, n_head=12, n_embd=768),
}


def resolve_shape(spec: ModelSpec, seq_len: int) -> GPTShape:
    """Apply the preset; a field that differs from ModelSpec's default overrides the preset's value."""
    if spec.preset not in PRESETS and spec.preset != "custom":
        raise ConfigError(f"[model] preset = {spec.preset!r} is unknown; choose one of {sorted(PRESETS)} or "
                          "'custom' (then n_layer, n_head, n_embd, vocab_size are used as given)")
    default = ModelSpec()
    base = spec if spec.preset == "custom" else PRESETS[spec.preset]
    fields = {}
    for name in ("vocab_size", "n_layer", "n_head", "n_embd", "dropout"):
        value = getattr(spec, name)
        # The config cannot tell "unset" from "set to the default", so only a non-default value overrides.
        fields[name] = value if value != getattr(default, name) else getattr(base, name)
    shape = GPTShape(block_size=seq_len, **fields)
    if shape.vocab_size < 256:
        raise ConfigError(f"[model] vocab_size = {shape.vocab_size} is below 256; the data is byte-level, so use "
                          "vocab_size >= 256")
    if shape.n_embd % shape.n_head != 0:
        raise ConfigError(f"[model] n_embd = {shape.n_embd} is not divisible by n_head = {shape.n_head}; pick "
                          "n_head dividing n_embd")
    return shape


class CausalSelfAttention(nn.Module):
    def __init__(self, shape: GPTShape, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.n_head = shape.n_head
        self.c_attn = nn.Linear(shape.n_embd, 3 * shape.n_embd, dtype=dtype)
        self.c_proj = nn.Linear(shape.n_embd, shape.n_embd, dtype=dtype)
        self.dropout = shape.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.c_attn(x)
        # Under tensor parallelism c_attn is column-sharded by heads (models.tensor_parallel): this rank holds the
        # q, k and v of n_head * width / C heads; unsharded, width = C.
        width = qkv.shape[-1] // 3
        heads = self.n_head * width // C
        q, k, v = (t.view(B, T, heads, width // heads).transpose(1, 2) for t in qkv.split(width, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, width))


class Block(nn.Module):
    def __init__(self, shape: GPTShape, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(shape.n_embd, dtype=dtype)
        self.attn = CausalSelfAttention(shape, dtype)
        self.ln_2 = nn.LayerNorm(shape.n_embd, dtype=dtype)
        self.mlp = nn.Sequential(nn.Linear(shape.n_embd, 4 * shape.n_embd, dtype=dtype), nn.GELU(),
                                 nn.Linear(4 * shape.n_embd, shape.n_embd, dtype=dtype), nn.Dropout(shape.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPTStage(nn.Module):
    """Layers [first, last) of the GPT, with the embedding if first == 0 and the head + loss if last == n_layer.

    Blocks are kept under their global index ("blocks.5.attn...") so the state dicts of all stages partition the
    whole model's state dict: the union of the stage state dicts loads into `full_model` as is.
    """

    activation_checkpointing = "none"  # models.checkpointing.MODES; set by models.checkpointing.set_mode

    def __init__(self, shape: GPTShape, first: int, last: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.shape = shape
        self.first, self.last = first, last
        self.has_embedding = first == 0
        self.has_head = last == shape.n_layer
        if self.has_embedding:
            self.wte = nn.Embedding(shape.vocab_size, shape.n_embd, dtype=dtype)
            self.wpe = nn.Embedding(shape.block_size, shape.n_embd, dtype=dtype)
            self.drop = nn.Dropout(shape.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(shape, dtype) for i in range(first, last)})
        if self.has_head:
            self.ln_f = nn.LayerNorm(shape.n_embd, dtype=dtype)
            self.lm_head = nn.Linear(shape.n_embd, shape.vocab_size, dtype=dtype)

    def boundary_shape(self, batch: int, seq: int) -> tuple[int, ...]:
        """Shape of the activation this stage sends downstream (and of the gradient it receives back)."""
        return (batch, seq, self.shape.n_embd)

    def checkpoint_layers(self) -> list[nn.Module]:
        """The regions "per_layer" checkpointing recomputes: the transformer blocks."""
        return list(self.blocks.values())

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return run_stage(self.activation_checkpointing, self._forward, x)
        return run_stage(self.activation_checkpointing, self._forward, x, targets)

    def _forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if self.has_embedding:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(positions))
        for block in self.blocks.values():
            x = run_region(self.activation_checkpointing, block, x)
        if not self.has_head:
            return x
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def init_seed(seed: int, name: str) -> int:
    """The seed of the module `name` (its name in the whole model, which a stage keeps) in a run seeded `seed`."""
    digest = hashlib.sha256(f"recycle-gpt-init:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@torch.no_grad()
def _init_weights(model: nn.Module, seed: int, n_layer: int) -> None:
    """nanoGPT's init (normal 0.02, scaled residual projections, zero biases, LayerNorm ones and zeros), each
    module's draw from a generator seeded by (seed, its name in the whole model): a module's initial weights are the
    same whichever other modules the process builds, so a stage built alone equals that stage of the whole model."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if name.endswith("c_proj") or name.endswith("mlp.2"):
                std = 0.02 / math.sqrt(2 * n_layer)
            generator = torch.Generator().manual_seed(init_seed(seed, name))
            # Drawn in float64 and rounded to the weights' dtype (float32 weights are the float64 ones rounded), in
            # fixed-size pieces, so the float64 draw adds at most INIT_CHUNK elements to the stage's memory.
            flat = module.weight.view(-1)
            for start in range(0, flat.numel(), INIT_CHUNK):
                piece = flat[start:start + INIT_CHUNK]
                piece.copy_(torch.randn(piece.numel(), generator=generator, dtype=torch.float64).mul_(std))
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.reset_parameters()


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of {sorted(DTYPES)}")
    return DTYPES[dtype]


def _built(shape: GPTShape, first: int, last: int, seed: int, dtype: str | torch.dtype) -> GPTStage:
    """Layers [first, last) alone, allocated in `dtype` and initialised: no other layer's tensor is ever made.
    Allocated on the CPU rather than laid out on the meta device first: torch's default init of a meta tensor (the
    modules' constructors run it) imports torch._dynamo, seconds per worker, for nothing it saves here."""
    with torch.random.fork_rng(devices=[]):  # the constructors' default init draws from the global RNG: left as it was
        stage = GPTStage(shape, first, last, _dtype(dtype))
    _init_weights(stage, seed, shape.n_layer)
    return stage


def full_model(spec: ModelSpec, seq_len: int, seed: int, dtype: str | torch.dtype = "float32") -> GPTStage:
    """The whole model as one module (the reference); initialised from `seed` independently of the global RNG."""
    shape = resolve_shape(spec, seq_len)
    return _built(shape, 0, shape.n_layer, seed, dtype)


def stage_layers(n_layer: int, num_stages: int) -> list[tuple[int, int]]:
    """[first, last) layers per stage, as even as possible (earlier stages get the extra layer: they also embed,
    but the last stage holds the head, which for a byte vocabulary is small)."""
    if num_stages < 1:
        raise ConfigError(f"num_stages = {num_stages} must be >= 1")
    if n_layer < num_stages:
        raise ConfigError(f"the model has n_layer = {n_layer} layers but num_stages = {num_stages}; every stage "
                          f"needs at least one layer: use n_layer >= {num_stages} or fewer stages")
    base, extra = divmod(n_layer, num_stages)
    bounds, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def build_stage(spec: ModelSpec, num_stages: int, stage: int, seed: int, dtype: str | torch.dtype = "float32",
                seq_len: int = 64, bounds: list[tuple[int, int]] | None = None) -> GPTStage:
    """Stage `stage` of build_stages(...) built alone: only its tensors are allocated, so a worker's memory is its
    stage's, and its weights equal that stage of the whole model (initialisation depends on the seed and each
    module's name only)."""
    shape = resolve_shape(spec, seq_len)
    first, last = (bounds or stage_layers(shape.n_layer, num_stages))[stage]
    return _built(shape, first, last, seed, dtype)


def build_stages(spec: ModelSpec, num_stages: int, seed: int, dtype: str | torch.dtype = "float32",
                 seq_len: int = 64, bounds: list[tuple[int, int]] | None = None) -> list[GPTStage]:
    """The S stage modules, with exactly the weights of `full_model(spec, seq_len, seed, dtype)` sliced by layers
    (`bounds`: [first, last) per stage; default the even split of `stage_layers`), each built alone."""
    shape = resolve_shape(spec, seq_len)
    layout = bounds or stage_layers(shape.n_layer, num_stages)
    return [_built(shape, first, last, seed, dtype) for first, last in layout]
