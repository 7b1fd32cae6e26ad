"""The pre-step snapshot that makes recovery exact: a stage's parameters and optimizer state just before its
optimizer step, kept until the next step, so a stage that already stepped an iteration that must be redone can
return to the state every other stage still has."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recycle.runtime.optim import StageOptimizer

__all__ = ["StageSnapshot", "copy_state"]


def copy_state(obj: Any) -> Any:
    """A deep copy of nested dicts/lists/tuples whose tensors are cloned (detached)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: copy_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(copy_state(v) for v in obj)
    return obj


class StageSnapshot:
    """Holds at most one snapshot: the state before the optimizer step of iteration `iteration`.

    Why one is enough: a stage can only step iteration i+1 after the whole pipeline has run iteration i+1's
    forward, so at any failure every surviving stage has applied either iteration r-1 or r, never r+1; the oldest
    unapplied iteration r is redone by all, and only the stages that applied r need their snapshot of it.
    """

    def __init__(self, module: nn.Module, optimizer: StageOptimizer) -> None:
        self.module = module
        self.optimizer = optimizer
        self.iteration: int | None = None
        self._params: list[torch.Tensor] = []
        self._optimizer_state: Any = None

    def take(self, iteration: int) -> None:
        tensors = list(self.module.state_dict().values())
        if len(self._params) != len(tensors):
            self._params = [t.detach().clone() for t in tensors]
        else:
            for saved, tensor in zip(self._params, tensors):
                saved.copy_(tensor)
        self._optimizer_state = copy_state(self.optimizer.state_dict())
        self.iteration = iteration

    def restore(self, iteration: int) -> None:
        """Put back the state from before the step of `iteration` (which must be the one snapshotted)."""
        if self.iteration != iteration:
            raise RuntimeError(f"roll-back to before the step of iteration {iteration} needs that snapshot, but the "
                               f"one held is of iteration {self.iteration}")
        with torch.no_grad():
            for tensor, saved in zip(self.module.state_dict().values(), self._params):
                tensor.copy_(saved)
        self.optimizer.load_state_dict(copy_state(self._optimizer_state))
        self.iteration = None
