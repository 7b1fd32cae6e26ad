"""The pre-step snapshot that makes recovery exact: a stage's state just before its optimizer step, kept until the
next step, so a stage that already stepped an iteration that must be redone can return to the state every other
stage still has."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from recycle.runtime.state.live_sources import LiveSources
from recycle.runtime.state.stage_state import StageState, copy_state

__all__ = ["StageSnapshot"]


class StageSnapshot:
    """Holds at most one snapshot: the state before the optimizer step of iteration `position.snapshot`.

    Why one is enough: a stage can only step iteration i+1 after the whole pipeline has run iteration i+1's
    forward, so at any failure every surviving stage has applied either iteration r-1 or r, never r+1; the oldest
    unapplied iteration r is redone by all, and only the stages that applied r need their snapshot of it.
    """

    def __init__(self, state: StageState) -> None:
        self.state = state
        self._saved: dict[str, Any] | None = None  # its tensors are reused by the next take
        self._copy: LiveSources | None = None  # how the last take copied the state, for a state of its layout

    def take(self, iteration: int) -> None:
        copy, saved = self._copy, self._saved
        if saved is not None and copy is not None and copy.intact():
            # The state holds the same entries as at the last walk (every step but the first two and the one after
            # a restore or a load): copied from them without walking the state dict (~0.3 ms of a small-preset
            # stage's step; docs/runtime-performance.md). The values are the same.
            copy.copy(saved)
        else:
            live = self.state.state_dict()
            if saved is not None and copy is not None and copy.fits(live):
                # The layout of the last walk: copied without copy_state's checks per key. Each step where no watch
                # can tell (an optimizer that is not a TrainingOptimizer, a state dict hook), or the first after a
                # restore or a load (the optimizer adopted other tensors: watched from now on).
                copy.copy_from(live, saved)
                if copy.watch is not None:
                    self._copy = LiveSources.of(self.state, live, saved)
            else:
                saved = self._saved = copy_state(live, saved)
                self._copy = LiveSources.of(self.state, live, saved)
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
