"""A chunked run's worker stage: the chunks its position holds (built-in GPT), and which workers load data."""

from __future__ import annotations

from recycle.config import Config
from recycle.ir.chunks import chunk_worker
from recycle.models.checkpointing import set_mode
from recycle.models.chunk_set import gpt_chunk_set
from recycle.runtime.state.precision import weights_dtype
from recycle.runtime.worker.stage import BuiltStage

__all__ = ["chunked_built_stage", "data_stages"]


def chunked_built_stage(config: Config, stage: int) -> BuiltStage:
    """The ChunkSet of worker position `stage` under [topology] chunks_per_worker and chunk_layout; every chunk
    boundary carries the same hidden-state shape, so one receive shape serves every chunk."""
    topology, workload = config.topology, config.workload
    chunks = gpt_chunk_set(config.model, topology.num_stages, topology.chunks_per_worker, topology.chunk_layout,
                           stage, config.training.seed, weights_dtype(config.training.dtype), workload.seq_len)
    for v in chunks.chunk_ids:
        set_mode(chunks.chunk(v), config.model.activation_checkpointing, f"chunk {v}")
    boundary = tuple(chunks.chunk(chunks.chunk_ids[0]).boundary_shape(workload.microbatch_size, workload.seq_len))
    return BuiltStage(chunks, chunks.layers(), boundary, boundary)


def data_stages(config: Config) -> tuple[int, ...]:
    """The worker positions that load micro-batches: the holders of the first chunk (token ids) and of the last
    (targets); one stage per worker: stages 0 and S-1."""
    topology = config.topology
    S, C = topology.num_stages, topology.chunks_per_worker
    if C == 1:
        return (0, S - 1)
    return tuple(sorted({chunk_worker(0, S, C, topology.chunk_layout),
                         chunk_worker(S * C - 1, S, C, topology.chunk_layout)}))

