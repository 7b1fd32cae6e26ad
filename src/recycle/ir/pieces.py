"""Pieces of micro-batches (a micro-batch id's source micro-batch and sample range) and the one loss rule: every
token of the global batch weighs the same, 1 / (tokens in the global batch)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Piece", "loss_weight"]


@dataclass(frozen=True)
class Piece:
    """Samples [start, stop) of data micro-batch `source` (0 .. D x M - 1), run as one micro-batch id of a plan."""

    source: int
    start: int
    stop: int

    @property
    def samples(self) -> int:
        return self.stop - self.start

    def to_list(self) -> list[int]:
        return [self.source, self.start, self.stop]


def loss_weight(samples: int, microbatch_size: int, total_microbatches: int) -> float:
    """The factor of a micro-batch's (or piece's) mean token loss under the global-token rule.

    The model returns the mean over the `samples` x seq_len tokens it was given; the step's loss is the sum of all
    token losses over the tokens of the global batch (total_microbatches x microbatch_size samples of seq_len), so a
    piece of n of a micro-batch's m samples weighs n / (m x D x M). For a whole micro-batch (n = m) this is exactly
    1.0 / (D x M): IEEE division rounds the same real number the same way, so whole-micro-batch plans keep their
    results bit for bit."""
    return samples / (microbatch_size * total_microbatches)
