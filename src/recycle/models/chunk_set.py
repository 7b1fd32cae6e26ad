"""A worker's model chunks (virtual stages of a chunked plan) as one module under the whole model's parameter names."""

from __future__ import annotations

import torch
from torch import nn

from recycle.config import ModelSpec
from recycle.errors import ConfigError
from recycle.ir.chunks import worker_chunks
from recycle.models.gpt import GPTStage, build_stage, resolve_shape, stage_layers

__all__ = ["ChunkSet", "gpt_chunk_set", "chunk_layers"]


class ChunkSet(nn.Module):
    """The chunks one worker holds (built-in GPT chunks, e.g. layers [0, 1) and [3, 4) of the V layout's worker 0).

    `chunk(v)` is the module that runs chunk v. The set registers the chunks' submodules themselves (the embedding,
    the blocks by their global layer index, the head) and not the chunk modules, so its parameters are the chunks'
    parameters, each once, under the whole model's names: one optimizer, one checkpoint shard and one --save part
    per worker, keyed like an unchunked stage's (a checkpoint moves between chunked and unchunked runs).
    """

    def __init__(self, chunks: dict[int, GPTStage]) -> None:
        super().__init__()
        ordered = sorted(chunks.items())
        for _, module in ordered:  # the embedding parts, in the whole model's order
            for name in ("wte", "wpe", "drop"):
                if hasattr(module, name):
                    self.add_module(name, getattr(module, name))
        self.blocks = nn.ModuleDict({key: block for _, module in ordered for key, block in module.blocks.items()})
        for _, module in ordered:
            for name in ("ln_f", "lm_head"):
                if hasattr(module, name):
                    self.add_module(name, getattr(module, name))
        # Kept outside the module tree (plain attribute): registering them would name every parameter twice.
        object.__setattr__(self, "_chunks", dict(ordered))

    @property
    def chunk_ids(self) -> tuple[int, ...]:
        """The chunks held, in model order."""
        return tuple(self._chunks)

    def chunk(self, chunk: int) -> GPTStage:
        """The module of `chunk` (sharing the set's parameters)."""
        return self._chunks[chunk]

    def layers(self) -> tuple[int, int]:
        """[first, last) over the chunks' layers (informative: a chunk set's layers need not be contiguous)."""
        return min(m.first for m in self._chunks.values()), max(m.last for m in self._chunks.values())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover -- the executor runs chunks one by one
        raise RuntimeError("a ChunkSet runs chunk by chunk: call chunk(v)(x)")


def chunk_layers(spec: ModelSpec, seq_len: int, num_stages: int, chunks: int) -> list[tuple[int, int]]:
    """[first, last) layers of each of the num_stages x chunks chunks, as even as possible."""
    shape = resolve_shape(spec, seq_len)
    total = num_stages * chunks
    if shape.n_layer < total:
        raise ConfigError(f"the model has n_layer = {shape.n_layer} layers but num_stages x chunks_per_worker = "
                          f"{num_stages} x {chunks} = {total} chunks; every chunk needs at least one layer: use "
                          f"n_layer >= {total}, fewer chunks per worker or fewer stages")
    return stage_layers(shape.n_layer, total)


def gpt_chunk_set(spec: ModelSpec, num_stages: int, chunks: int, layout: str, stage: int, seed: int,
                  dtype: str | torch.dtype, seq_len: int) -> ChunkSet:
    """The chunks worker position `stage` holds under `layout` (ir.chunks), each built alone with exactly the whole
    model's weights for its layers."""
    bounds = chunk_layers(spec, seq_len, num_stages, chunks)
    mine = worker_chunks(stage, num_stages, chunks, layout)
    return ChunkSet({v: build_stage(spec, num_stages * chunks, v, seed, dtype, seq_len, bounds) for v in mine})
