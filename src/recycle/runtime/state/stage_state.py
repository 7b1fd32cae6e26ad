"""A stage's training state as one torch.distributed.checkpoint `Stateful`, keyed by the whole model's names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import nn

from recycle.models.tensor_parallel import local_tensor, shard_of_whole, sharded_like
from recycle.runtime.state.optim import StageOptimizer

__all__ = ["IterationPosition", "StageState", "copy_state", "PLAIN_TENSORS", "OPTIMIZER_PREFIX", "STEP_KEY",
           "RNG_PREFIX"]

# The keys checkpoints are written with (runtime.checkpoint's FORMAT): they must not change.
OPTIMIZER_PREFIX = "optimizer.state."
STEP_KEY = "train.step"
RNG_PREFIX = "train.rng.stage"


@dataclass
class IterationPosition:
    """Where a stage's state stands in training. One object per worker, shared by the executor that steps it and the
    worker that rolls it back, restores or receives it."""

    applied: int = -1  # the last iteration whose optimizer step the weights hold (start - 1: none yet)
    snapshot: int | None = None  # the iteration whose pre-step state the roll-back snapshot holds

    @property
    def done(self) -> int:
        """The number of training steps the weights hold (a checkpoint's step)."""
        return self.applied + 1

    def restart(self, done: int) -> None:
        """The weights now hold `done` steps, taken from elsewhere: no snapshot of this stage's past applies."""
        self.applied = done - 1
        self.snapshot = None


# The tensor types torch's foreach ops take as they are (a subclass such as DTensor is copied on its own).
PLAIN_TENSORS = _PLAIN = frozenset({torch.Tensor, nn.Parameter})


def copy_state(state: Mapping[str, Any], into: dict[str, Any] | None = None) -> dict[str, Any]:
    """A copy of a flat state whose tensors are detached clones; with `into` (an earlier copy), its tensors of the
    same shape, dtype and device are overwritten in place instead (a per-step copy without allocation)."""
    into = {} if into is None else into
    copied: dict[str, Any] = {}
    # The in-place copies of plain tensors go to torch in one _foreach_copy_ per device: the pre-step snapshot copies
    # ~100 tensors every step, and one call instead of a copy_ and a detach per tensor saves their Python calls (6-8 %
    # of the snapshot alone; the rest is memory traffic: docs/runtime-performance.md). The values are the same.
    fused: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            old = into.get(key)
            if isinstance(old, torch.Tensor) and old.shape == value.shape and old.dtype == value.dtype \
                    and old.device == value.device:
                if type(old) in _PLAIN and type(value) in _PLAIN:
                    targets, sources = fused.setdefault(value.device, ([], []))
                    targets.append(old)
                    sources.append(value)
                    copied[key] = old
                else:  # a DTensor (tensor-parallel stage): copied on its own, shard by shard
                    copied[key] = old.copy_(value.detach())
            else:
                copied[key] = value.detach().clone()
        else:
            copied[key] = value
    with torch.no_grad():  # the sources are parameters: a copy must not be recorded by autograd
        for targets, sources in fused.values():
            torch._foreach_copy_(targets, sources)
    return copied


class StageState:
    """The stage module's parameters and buffers, its optimizer's per-parameter state and schedule position, the
    CPU generator and the iteration position, as one flat dict (torch.distributed.checkpoint's Stateful protocol).

    Keys: the module's state-dict names under `prefix` (checkpoint.key_prefix), "optimizer.state.{name}.{key}" for
    each per-parameter optimizer entry (torch.optim keys it by index in the optimizer's parameter order: the
    module's trainable parameters), "train.step" (the steps done) and "train.rng.stage{stage}". Because the keys are
    the whole model's, a state taken from one layer partition loads into another's stage (each takes its own keys).
    """

    def __init__(self, module: nn.Module, optimizer: StageOptimizer, stage: int, position: IterationPosition,
                 prefix: str = "") -> None:
        self.module = module
        self.optimizer = optimizer
        self.stage = stage
        self.position = position
        self.prefix = prefix
        # Parameter names in the optimizer's order (it was built from module.parameters() that require grad).
        self.names = [name for name, p in module.named_parameters() if p.requires_grad]
        self._heads = [f"{OPTIMIZER_PREFIX}{prefix}{name}." for name in self.names]
        self._index = {prefix + name: index for index, name in enumerate(self.names)}
        self.rng_key = f"{RNG_PREFIX}{stage}"

    def parameter_of(self, key: str) -> int | None:
        """The optimizer index of the parameter whose optimizer entry `key` is (None: not one of this stage's)."""
        if not key.startswith(OPTIMIZER_PREFIX):
            return None
        owner, _, entry = key[len(OPTIMIZER_PREFIX):].rpartition(".")
        return self._index.get(owner) if entry else None

    def optimizer_head(self, index: int) -> str:
        """The key prefix of the optimizer entries of the parameter at `index` in the optimizer's order."""
        return self._heads[index]

    def module_entries(self) -> dict[str, torch.Tensor]:
        """The module's parameters and buffers, live."""
        return {self.prefix + name: t for name, t in self.module.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """The live state (no copies): the module's tensors, the optimizer's (and any non-tensor entries it keeps,
        e.g. None for a buffer not made yet), the steps done, the CPU generator's state."""
        state: dict[str, Any] = self.module_entries()
        for index, per_param in self.optimizer.state_dict()["optimizer"]["state"].items():
            head = self._heads[index]
            for key, value in per_param.items():
                state[head + key] = value
        state[STEP_KEY] = torch.tensor(self.position.done, dtype=torch.int64)
        state[self.rng_key] = torch.get_rng_state()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take this stage's entries of `state` (others are ignored): the module's tensors are copied in place, the
        optimizer adopts its entries' tensors, with the schedule position and the iteration position of the steps
        done; the CPU generator's state when `state` has this stage's. On a tensor-parallel stage each entry may be a
        DTensor, this rank's plain shard, or the whole tensor in the unsharded layout (a checkpoint's)."""
        with torch.no_grad():
            for name, live in self.module.state_dict().items():
                key = self.prefix + name
                if key not in state:
                    raise KeyError(f"the stage state to load has no {key!r}")
                # A tensor-parallel stage's DTensors load shard by shard (from a DTensor or a plain shard alike), or
                # take their shard of a whole tensor (a checkpoint's, written in the unsharded layout).
                value, live = local_tensor(shard_of_whole(key, state[key], live)), local_tensor(live)
                if value.shape != live.shape:
                    raise ValueError(f"{key!r} is {tuple(value.shape)} in the state to load, {tuple(live.shape)} in "
                                     "this stage")
                if value.data_ptr() != live.data_ptr():  # loaded in place already (DCP fills the live tensors)
                    live.copy_(value)
        per_param: dict[int, dict[str, Any]] = {}
        params = [p for p in self.module.parameters() if p.requires_grad]  # the optimizer's order
        for key, value in state.items():
            index = self.parameter_of(key)
            if index is not None:
                shard = shard_of_whole(key, value, params[index])
                per_param.setdefault(index, {})[key.rpartition(".")[2]] = sharded_like(shard, params[index])
        done = int(state[STEP_KEY])
        groups = self.optimizer.state_dict()["optimizer"]["param_groups"]
        self.optimizer.load_state_dict({"optimizer": {"state": dict(sorted(per_param.items())),
                                                      "param_groups": groups}, "steps": done})
        self.position.restart(done)
        if self.rng_key in state:
            torch.set_rng_state(state[self.rng_key])
