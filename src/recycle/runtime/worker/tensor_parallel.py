"""A worker's T tensor-parallel ranks: the DeviceMesh its stage is sharded over, made before any process group exists
and bound to each generation's group of the worker's ranks, and what a rank may do alone.

Why the mesh is bound rather than made per generation: the stage's DTensor parameters, the optimizer's state and
parallelize_module's input/output hooks all hold the one DeviceMesh object they were made with. Each generation tears
every process group down and forms new ones (runtime.transport), so the mesh is made once without a group
(`_init_backend=False`: its coordinate is the TP rank, known from the spec) and pointed at the new generation's group
of the worker's ranks when that forms. DTensor resolves the group by name at every collective, so nothing else
changes. A worker's ranks live and die together (a failure fences all T), so the group always has T members.
"""

from __future__ import annotations

from typing import Any

import torch

from recycle.config import Config
from recycle.errors import ConfigError

__all__ = ["tp_degree", "worker_mesh", "bind_mesh", "check_worker_features", "rank_beat_key", "ready_key",
           "RankBeats"]


def tp_degree(config: Config) -> int:
    """T: the processes of one worker ([topology] gpus_per_worker, the tensor-parallel degree)."""
    return int(config.topology.gpus_per_worker)


def worker_mesh(degree: int, tp_rank: int, device_type: str = "cpu") -> Any:
    """The 1-D mesh of a worker's `degree` ranks, as rank `tp_rank` sees it, with no process group yet."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, torch.arange(degree), _init_backend=False, _rank=tp_rank)


def bind_mesh(mesh: Any, group: Any) -> None:
    """Point `mesh` at `group` (this generation's group of the worker's ranks, in TP-rank order)."""
    name = group.group_name
    mesh._dim_group_names = [name]
    mesh._pg_registry = {name: group}


def check_worker_features(config: Config, model_factory: str, partition: bool) -> None:
    """Refuse, with T > 1, what a tensor-parallel worker does not do yet (each message names the limitation)."""
    T = tp_degree(config)
    if T == 1:
        return
    rule = f"[topology] gpus_per_worker = {T} (tensor parallel inside a worker)"
    if model_factory:
        raise ConfigError(f"{rule} shards the built-in GPT and Hugging Face rotary models only, not --model-factory "
                          f"{model_factory!r}; use gpus_per_worker = 1 with a model factory")
    if partition:
        raise ConfigError(f"{rule} cannot move layers between stages (a plan with a layer partition); use plans "
                          "without one (stage_loss = 'respawn') or gpus_per_worker = 1")


def rank_beat_key(rank: int, tp_rank: int) -> str:
    """The store key where TP rank `tp_rank` (> 0) of worker `rank` counts its beats for its rank 0."""
    return f"tp_beat/{rank}/{tp_rank}"


def ready_key(rank: int, incarnation: str, tp_rank: int) -> str:
    """The store key where TP rank `tp_rank` (> 0) of a replacement for worker `rank` (its `incarnation`) says it is
    up: its rank 0 tells the coordinator the worker is ready only once every rank is, or the generation that
    admits it would wait for a rank still starting (a process takes ~20 s to start on a loaded 2-core machine)."""
    return f"tp_ready/{rank}/{incarnation}/{tp_rank}"


class RankBeats:
    """TP rank 0's watch over its worker's other ranks, which do not beat to the coordinator: a rank whose beat count
    has not moved for `timeout_s` (by rank 0's own clock) is frozen, and then so is the worker. A rank is watched
    from its first beat (before that, the generation's formation waits for it, under its own timeout)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._last: dict[int, tuple[bytes, float]] = {}  # TP rank -> (its beat count, when rank 0 saw it change)

    def saw(self, tp_rank: int, count: bytes | None, now: float) -> None:
        if count is None:
            return
        last = self._last.get(tp_rank)
        if last is None or last[0] != count:
            self._last[tp_rank] = (count, now)

    def frozen(self, now: float) -> list[int]:
        return sorted(t for t, (_, seen) in self._last.items() if now - seen > self.timeout_s)
