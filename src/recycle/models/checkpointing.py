"""Activation checkpointing of a stage: keep only a region's inputs at F, recompute the region inside the backward.

Modes ([model] activation_checkpointing):
  * "none": autograd keeps every saved tensor from F until the micro-batch's W;
  * "full": the whole stage is one region: F keeps only the stage input;
  * "per_layer": every transformer block is a region: F keeps each block's input (plus what the embedding and the
    head save, which are not checkpointed).

torch.utils.checkpoint (use_reentrant=False, RNG state preserved) does the work. It composes with the runtime's
split backward because each autograd call is its own graph task: B (the input-gradient) recomputes a region when it
first reaches it, and W (the weight-gradient, a later call) recomputes it again; what a region rebuilds is freed as
its backward consumes it. So between actions a micro-batch holds only the kept tensors, in both the F-B and the B-W
gap (the gap into which ReCycle defers W), at the price of one recompute of F in B and one in W. The recompute
replays the same operations on the same inputs with the same dropout draws, so gradients are exact.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from recycle.config import CHECKPOINTING_MODES
from recycle.errors import ConfigError

__all__ = ["MODES", "run_region", "run_stage", "set_mode", "mode_of", "regions"]

MODES = CHECKPOINTING_MODES


def run_region(mode: str, layer: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call one transformer block, as a checkpointed region when `mode` is "per_layer" and autograd records."""
    if mode == "per_layer" and torch.is_grad_enabled():
        return checkpoint(layer, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
    return layer(*args, **kwargs)


def run_stage(mode: str, forward: Callable[..., Any], *args: Any) -> Any:
    """Call a stage's whole forward, as one checkpointed region when `mode` is "full" and autograd records."""
    if mode == "full" and torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=True)
    return forward(*args)


def regions(module: nn.Module, mode: str) -> list[nn.Module]:
    """The modules `mode` recomputes as one region each: the stage, or its transformer blocks (none for "none")."""
    if mode == "full":
        return [module]
    if mode == "per_layer":
        layers = getattr(module, "checkpoint_layers", None)
        return list(layers()) if callable(layers) else []
    return []


def mode_of(module: nn.Module) -> str:
    """The stage's checkpointing mode ("none" for a module that cannot checkpoint)."""
    return str(getattr(module, "activation_checkpointing", "none"))


def set_mode(module: nn.Module, mode: str, what: str = "the stage") -> nn.Module:
    """Make `module` (a built-in GPT or Hugging Face stage) run its forward in `mode`; returns it."""
    if mode not in MODES:
        raise ConfigError(f"activation checkpointing {mode!r} is not a mode; use one of "
                          f"{', '.join(repr(m) for m in MODES)}")
    if mode != "none" and not hasattr(module, "checkpoint_layers"):
        raise ConfigError(f"[model] activation_checkpointing = {mode!r}: {what} ({type(module).__name__}) is not a "
                          "built-in GPT or Hugging Face stage, whose forward recycle knows how to checkpoint; set it "
                          "to 'none' and checkpoint inside your own modules (torch.utils.checkpoint)")
    if hasattr(module, "checkpoint_layers"):
        module.activation_checkpointing = mode  # read by the stage's forward (gpt.GPTStage, hf._HFStage)
    if mode != "none":
        # torch.utils.checkpoint imports torch._dynamo on its first call (~2 s here): pay it while the stage is
        # built, not inside the first F, where the rest of the pipeline (or a re-joined worker's peers) would wait.
        import torch._dynamo  # noqa: F401
    return module
