"""Where the model's chunks (virtual stages) live: the worker position of chunk v under a chunk layout, and back."""

from __future__ import annotations

from functools import lru_cache

__all__ = ["CHUNK_LAYOUTS", "MAX_CHUNKS", "chunk_worker", "worker_chunks", "chunk_workers"]

CHUNK_LAYOUTS = ("interleaved", "v")
MAX_CHUNKS = 8  # virtual stages per worker; Megatron's interleaved schedules use 2-4


def chunk_worker(chunk: int, num_stages: int, chunks: int, layout: str) -> int:
    """The pipeline position (stage index of the worker) that holds `chunk` of the num_stages x chunks chunks.

    interleaved: chunk v on worker v mod S (worker w holds w, w+S, w+2S, ...), Megatron's and torch's
    ScheduleInterleaved1F1B's placement. v (chunks = 2): chunk v < S on worker v and chunk v >= S on worker 2S-1-v,
    so the model goes down the workers and back up (ZBV, DualPipeV); worker S-1 holds the two middle chunks and the
    loss is computed on worker 0.
    """
    return chunk_workers(num_stages, chunks, layout)[chunk]


def worker_chunks(worker: int, num_stages: int, chunks: int, layout: str) -> tuple[int, ...]:
    """The chunks worker position `worker` holds, in model order."""
    table = chunk_workers(num_stages, chunks, layout)
    return tuple(v for v, w in enumerate(table) if w == worker)


@lru_cache(maxsize=256)
def chunk_workers(num_stages: int, chunks: int, layout: str) -> tuple[int, ...]:
    """chunk_worker for every chunk 0..num_stages*chunks-1 (the hot loops index this tuple)."""
    if layout not in CHUNK_LAYOUTS:
        raise ValueError(f"chunk layout {layout!r} is unknown; choose one of {list(CHUNK_LAYOUTS)}")
    if chunks < 1:
        raise ValueError(f"chunks per worker = {chunks} must be >= 1")
    if layout == "v" and chunks != 2:
        raise ValueError(f"the v layout needs 2 chunks per worker, not {chunks}")
    S = num_stages
    if layout == "v":
        return tuple(v if v < S else 2 * S - 1 - v for v in range(2 * S))
    return tuple(v % S for v in range(S * chunks))
