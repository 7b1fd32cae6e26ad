"""Checkpoints off the critical path: the training step hands over a copy of its stage's state and goes on; a
background thread writes it as the stage's DCP shard, then tells the coordinator the shard is complete."""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import torch

from recycle.runtime.protocol.channels import Keys
from recycle.runtime.protocol.store import StoreUnavailable
from recycle.runtime.state import checkpoint
from recycle.runtime.state.stage_state import StageState

__all__ = ["CheckpointWriter"]


class CheckpointWriter:
    """One writer thread per worker; `submit` copies the state (a memcpy) and returns, once the previous
    checkpoint is written."""

    def __init__(self, root: str, store: Any, written: Callable[[Any, int, int], None] | None = None) -> None:
        self.root = root
        self.store = store  # its own connection: the thread must not share the main thread's
        # How a complete shard is told to the coordinator: written(store, done steps, stage) (the worker keeps the
        # word for a restarted coordinator); by default a plain flag.
        self.written = written or (lambda store, done_steps, stage: store.set(Keys.checkpointed(done_steps, stage),
                                                                              "1"))
        self._queue: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._error: BaseException | None = None
        # torch.distributed.checkpoint (with DTensor) takes ~1.2 s to import here. Imported now, at the worker's
        # start-up and before its heartbeat runs: in the writer thread it would hold the GIL for that long while
        # the worker trains (its heartbeat starves and it is fenced as hung), and delay the first checkpoint.
        import torch.distributed.checkpoint  # noqa: F401

        self._thread = threading.Thread(target=self._run, daemon=True, name="recycle-checkpoint-writer")
        self._thread.start()

    def submit(self, state: StageState, layers: tuple[int, int],
               before_write: Callable[[], None] | None = None,
               entries: dict[str, torch.Tensor] | None = None) -> None:
        """Checkpoint `state` as the shard of the step it holds (its position's steps done); `entries`: what to write
        instead of its own (a tensor-parallel stage's, gathered whole), fresh CPU tensors the step will not touch."""
        self._raise_if_failed()
        # At most one checkpoint in flight (as with dcp.async_save): memory stays at one copy, and a writer never
        # falls steps behind the training it checkpoints. A step that checkpoints before the previous checkpoint
        # is written waits for it.
        self._queue.join()
        self._raise_if_failed()
        if entries is None:
            entries = checkpoint.shard_entries(state, copy=True)
        self._queue.put((state.position.done, state.stage, layers, entries, before_write))

    def wait(self) -> None:
        """Block until every submitted checkpoint is written; raise if one failed."""
        self._queue.join()
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def _ping(self) -> None:
        """Before a shard is committed: a fenced writer's ping ends its process. A store that is away (its
        coordinator restarts) does not stop the write."""
        ping = getattr(self.store, "ping", None)
        if ping is not None:
            try:
                ping()
            except StoreUnavailable:
                pass

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                done_steps, stage, layers, state, before_write = item
                checkpoint.save_shard(self.root, done_steps, stage, layers, state, before_write=before_write,
                                      before_commit=self._ping)
                self.written(self.store, done_steps, stage)
            except BaseException as exc:  # reported to the training thread at its next submit or wait
                self._error = exc
            finally:
                self._queue.task_done()
