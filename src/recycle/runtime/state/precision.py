"""The numerics recipe of [training] dtype: the dtype the weights and optimizer state are kept in, and the autocast
dtype of the forward ("bfloat16": bf16 autocast over float32 master weights and optimizer state)."""

from __future__ import annotations

import contextlib
from typing import ContextManager

import torch

__all__ = ["weights_dtype", "autocast"]

_WEIGHTS = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.float32}
_AUTOCAST = {"bfloat16": torch.bfloat16}


def weights_dtype(name: str) -> torch.dtype:
    """The dtype of parameters, gradients, optimizer state and the activations sent between stages."""
    return _WEIGHTS[name]


def autocast(name: str, device: torch.device | str = "cpu") -> ContextManager[object]:
    """The context a forward (and its loss) runs in: torch.autocast for "bfloat16", nothing otherwise. Backward
    runs outside it, as torch.autocast asks."""
    dtype = _AUTOCAST.get(name)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=dtype)
