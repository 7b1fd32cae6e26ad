"""The pre-step snapshot that makes recovery exact: a stage's state just before its optimizer step, kept until the
next step, so a stage that already stepped an iteration that must be redone can return to the state every other
stage still has."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from recycle.runtime.state.live_sources import LiveSources
from recycle.runtime.state.stage_state import PLAIN_TENSORS as _PLAIN
from recycle.runtime.state.stage_state import StageState, copy_state

__all__ = ["StageSnapshot"]


@dataclass(frozen=True)
class _Reuse:
    """The layout of a take whose plain tensors all went to saved tensors of their shape, dtype and device: the keys in
    order, those of the plain tensors (`fused`) with their targets and (shape, dtype, device), and the rest."""

    keys: tuple[str, ...]
    fused: tuple[str, ...]
    targets: list[torch.Tensor]
    layout: list[tuple[torch.Size, torch.dtype, torch.device]]
    others: tuple[str, ...]

    @staticmethod
    def of(live: dict[str, Any], saved: dict[str, Any]) -> _Reuse:
        fused = tuple(key for key, value in live.items() if type(value) in _PLAIN)
        others = tuple(key for key, value in live.items() if type(value) not in _PLAIN)
        targets = [saved[key] for key in fused]
        return _Reuse(tuple(live), fused, targets, [(t.shape, t.dtype, t.device) for t in targets], others)

    def sources(self, live: dict[str, Any]) -> list[torch.Tensor]:
        return [live[key] for key in self.fused]

    def fits(self, live: dict[str, Any]) -> bool:
        """The same keys in the same order, and each plain tensor of the same type, shape, dtype and device."""
        if tuple(live) != self.keys:
            return False
        sources = self.sources(live)
        return set(map(type, sources)) <= _PLAIN and [(t.shape, t.dtype, t.device) for t in sources] == self.layout


class StageSnapshot:
    """Holds at most one snapshot: the state before the optimizer step of iteration `position.snapshot`.

    Why one is enough: a stage can only step iteration i+1 after the whole pipeline has run iteration i+1's
    forward, so at any failure every surviving stage has applied either iteration r-1 or r, never r+1; the oldest
    unapplied iteration r is redone by all, and only the stages that applied r need their snapshot of it.
    """

    def __init__(self, state: StageState) -> None:
        self.state = state
        self._saved: dict[str, Any] | None = None  # its tensors are reused by the next take
        self._reuse: _Reuse | None = None
        self._sources: LiveSources | None = None  # the state's tensors as the last walk found them

    def take(self, iteration: int) -> None:
        sources, saved = self._sources, self._saved
        if saved is not None and sources is not None and sources.intact():
            # The state holds the same tensors as at the last take (every step but the first two and the one after
            # a restore or a load): copied from them in one call, without walking the state dict (~0.3 ms of a
            # small-preset stage's step; docs/runtime-performance.md). The values are the same.
            sources.copy()
            self.state.position.snapshot = iteration
            return
        live = self.state.state_dict()
        reuse = self._reuse
        if saved is not None and reuse is not None and reuse.fits(live):
            # The same layout as the last take: the in-place copies in one call, without copy_state's checks per
            # key. The values are the same.
            with torch.no_grad():  # the sources are parameters: a copy must not be recorded by autograd
                torch._foreach_copy_(reuse.targets, reuse.sources(live))
            saved.update(copy_state({key: live[key] for key in reuse.others}, saved))
        else:
            saved = self._saved = copy_state(live, saved)
            self._reuse = _Reuse.of(live, saved)
        self._sources = LiveSources.of(self.state, live, saved)
        self.state.position.snapshot = iteration

    def restore(self, iteration: int) -> None:
        """Put back the state from before the step of `iteration` (which must be the one snapshotted)."""
        saved = self._held(iteration)
        # A copy: the optimizer adopts the tensors it loads, and the saved ones are overwritten by the next take.
        self.state.load_state_dict(copy_state(saved))

    @contextmanager
    def weights_before_step(self, iteration: int) -> Iterator[None]:
        """The module's tensors as they were before the step of `iteration`, for the duration: a stage that stepped
        an interrupted iteration computes a lost micro-batch's forward and input-gradient again with the weights
        that iteration used (ir.completion). The graphs made inside must be used up inside."""
        saved = self._held(iteration)
        live = self.state.module_entries()
        now = {key: tensor.detach().clone() for key, tensor in live.items()}
        with torch.no_grad():
            for key, tensor in live.items():
                tensor.copy_(saved[key])
        try:
            yield
        finally:
            with torch.no_grad():
                for key, tensor in live.items():
                    tensor.copy_(now[key])

    def _held(self, iteration: int) -> dict[str, Any]:
        saved = self._saved
        held = self.state.position.snapshot if saved is not None else None
        if saved is None or held != iteration:
            raise RuntimeError(f"the state from before the step of iteration {iteration} is needed, but the snapshot "
                               f"held is of iteration {held}")
        return saved
