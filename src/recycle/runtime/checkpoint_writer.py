"""Checkpoints off the critical path: the training step hands over a copy of its stage's state and goes on; a
background thread serialises and writes it atomically, then tells the coordinator the stage's file is complete."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch
from torch import nn

from recycle.runtime import checkpoint
from recycle.runtime.control import Keys
from recycle.runtime.optim import StageOptimizer
from recycle.runtime.rollback import copy_state

__all__ = ["CheckpointWriter"]


class CheckpointWriter:
    """One writer thread per worker; `submit` copies the state (a memcpy) and returns at once."""

    def __init__(self, root: str, store: Any) -> None:
        self.root = root
        self.store = store  # its own connection: the thread must not share the main thread's
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True, name="recycle-checkpoint-writer")
        self._thread.start()

    def submit(self, done_steps: int, stage: int, layers: tuple[int, int], module: nn.Module,
               optimizer: StageOptimizer, before_write: Callable[[], None] | None = None) -> None:
        self._raise_if_failed()
        model_state = {k: v.detach().to("cpu", copy=True) for k, v in module.state_dict().items()}
        optimizer_state = copy_state(optimizer.state_dict())
        self._queue.put((done_steps, stage, layers, model_state, optimizer_state, torch.get_rng_state(),
                         before_write))

    def wait(self) -> None:
        """Block until every submitted checkpoint is written; raise if one failed."""
        self._queue.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                done_steps, stage, layers, model_state, optimizer_state, rng, before_write = item
                checkpoint.save_stage_state(self.root, done_steps, stage, layers, model_state, optimizer_state, rng,
                                            before_write=before_write)
                self.store.set(Keys.checkpointed(done_steps, stage), "1")
            except BaseException as exc:  # reported to the training thread at its next submit or wait
                self._error = exc
            finally:
                self._queue.task_done()
