"""Pieces of micro-batches (a micro-batch id's source micro-batch and sample range) and the one loss rule: every
token of the global batch weighs the same, 1 / (tokens in the global batch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from recycle.errors import PlanError

__all__ = ["Piece", "loss_weight", "make_pieces", "check_pieces", "read_pieces"]

_FIX = "regenerate the plan with `recycle plan --split-microbatches`"


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


def make_pieces(total_microbatches: int, microbatch_size: int,
                sizes: Mapping[int, Sequence[int]]) -> tuple[Piece, ...]:
    """The pieces of a plan that cuts data micro-batch `source` into pieces of sizes[source] samples (in order; the
    rest stay whole): the first piece keeps the micro-batch's id, the others take ids from `total_microbatches` on,
    by source, then by position."""
    first = [Piece(mb, 0, microbatch_size) for mb in range(total_microbatches)]
    extra: list[Piece] = []
    for source in sorted(sizes):
        cuts = list(sizes[source])
        if len(cuts) < 2:
            continue
        start = 0
        for i, n in enumerate(cuts):
            piece = Piece(source, start, start + n)
            if i == 0:
                first[source] = piece
            else:
                extra.append(piece)
            start += n
    pieces = tuple(first + extra)
    check_pieces(pieces, microbatch_size, total_microbatches)
    return pieces


def check_pieces(pieces: Sequence[Piece], microbatch_size: int, total_microbatches: int) -> None:
    """PlanError unless the pieces tile every data micro-batch exactly: ids 0 .. D x M - 1 are (the first piece of)
    their own micro-batch, every piece holds at least one sample, and each micro-batch's pieces cover its samples
    [0, microbatch_size) once, without gap or overlap."""
    if not pieces:
        return
    if microbatch_size < 1:
        raise PlanError(f"plan field \"microbatch_size\" = {microbatch_size} must be a whole number >= 1 (the samples "
                        f"of a whole micro-batch) when the plan has pieces; {_FIX}")
    if len(pieces) < total_microbatches:
        raise PlanError(f"plan field \"pieces\" lists {len(pieces)} micro-batch ids but the plan has "
                        f"{total_microbatches} micro-batches; list one piece per id, the whole micro-batches included")
    by_source: dict[int, list[tuple[int, int, int]]] = {}
    for mb, p in enumerate(pieces):
        if not 0 <= p.source < total_microbatches:
            raise PlanError(f"pieces[{mb}] = {p.to_list()} names micro-batch {p.source}, outside [0, "
                            f"{total_microbatches}); {_FIX}")
        if mb < total_microbatches and p.source != mb:
            raise PlanError(f"pieces[{mb}] = {p.to_list()} belongs to micro-batch {p.source}, but ids below "
                            f"{total_microbatches} are (the first piece of) their own micro-batch; {_FIX}")
        if not 0 <= p.start < p.stop <= microbatch_size:
            raise PlanError(f"pieces[{mb}] = {p.to_list()} must cover samples [start, stop) with 0 <= start < stop <= "
                            f"{microbatch_size} (microbatch_size); an empty piece runs nothing: drop it")
        by_source.setdefault(p.source, []).append((p.start, p.stop, mb))
    for source, spans in by_source.items():
        spans.sort()
        edge = 0
        for start, stop, mb in spans:
            if start != edge:
                what = "overlaps the piece before it" if start < edge else f"leaves samples [{edge}, {start}) out"
                raise PlanError(f"pieces[{mb}] = {[source, start, stop]} {what}: the pieces of micro-batch {source} "
                                f"must tile its samples [0, {microbatch_size}) exactly once; {_FIX}")
            edge = stop
        if edge != microbatch_size:
            raise PlanError(f"the pieces of micro-batch {source} end at sample {edge}, not {microbatch_size}: they "
                            f"must tile its samples [0, {microbatch_size}) exactly once; {_FIX}")


def read_pieces(raw: Any, size: Any, total_microbatches: int) -> tuple[tuple[Piece, ...], int]:
    """The optional "pieces" ([[source, start, stop], ...]) and "microbatch_size" of a plan's JSON, checked."""
    def whole(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if not isinstance(raw, list) or not all(isinstance(e, list) and len(e) == 3 and all(whole(x) for x in e)
                                            for e in raw):
        shown = repr(raw) if len(repr(raw)) <= 40 else repr(raw)[:37] + "..."
        raise PlanError(f"plan field \"pieces\" = {shown} must be a list of [source, start, stop] (whole numbers), "
                        f"one per micro-batch id, or be left out for whole micro-batches")
    if not whole(size):
        raise PlanError(f"plan field \"microbatch_size\" = {size!r} must be a whole number (samples)")
    if not raw:
        if size:
            raise PlanError(f"plan field \"microbatch_size\" = {size} is set but the plan has no \"pieces\"; give "
                            "both or neither")
        return (), 0
    pieces = tuple(Piece(*e) for e in raw)
    check_pieces(pieces, size, total_microbatches)
    return pieces, size
