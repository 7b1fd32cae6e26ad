"""Models split the PyTorch way: any S stage modules (e.g. from torch.distributed.pipelining's `pipeline()`), a
`loss_fn(output, targets)`, and the boundary shapes found by running one micro-batch on the meta device.

Contract (docs/runtime.md, "Bring your own model"):
  * stage 0 takes a LongTensor of token ids [batch, seq]; every other stage takes the previous stage's output;
  * every stage but the last returns one floating tensor (its shape is found on the meta device, or given by an
    optional `boundary_shape(batch, seq)` method, which skips that run);
  * the loss: with a `loss_fn`, the last stage returns its output (e.g. logits) and the runtime calls
    `loss_fn(output, targets)` (targets: LongTensor [batch, seq], the next tokens) for the scalar mean loss of the
    micro-batch, as torch.distributed.pipelining's schedules do; without one, the last stage is called as
    `stage(x, targets)` and returns that loss itself (the built-in GPT's contract).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from recycle.errors import ConfigError

__all__ = ["LossFn", "StageModel", "as_stage_model", "split_model", "boundary_shapes", "causal_lm_loss"]

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class StageModel:
    """What a model factory returns: the S stage modules of one model and, optionally, the loss function applied to
    the last stage's output. (A plain list of modules is accepted too: the built-in contract, no loss_fn.)"""

    stages: tuple[nn.Module, ...]
    loss_fn: LossFn | None = None


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of logits [batch, seq, vocab] against targets [batch, seq]."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def as_stage_model(made: Any, num_stages: int, where: str) -> StageModel:
    """A factory's return value as a StageModel, checked: S modules, a callable loss_fn."""
    if isinstance(made, StageModel):
        model = made
    elif isinstance(made, (list, tuple)):
        model = StageModel(tuple(made))
    else:
        raise ConfigError(f"{where} returned {type(made).__name__}; return a list of S stage modules or "
                          "recycle.models.split.StageModel(stages, loss_fn)")
    if len(model.stages) != num_stages:
        raise ConfigError(f"{where} returned {len(model.stages)} stages but num_stages = {num_stages}; split the "
                          "model into as many stages as the config's [topology] num_stages")
    for s, module in enumerate(model.stages):
        if not isinstance(module, nn.Module):
            raise ConfigError(f"{where}: stage {s} is a {type(module).__name__}, not a torch.nn.Module")
    if model.loss_fn is not None and not callable(model.loss_fn):
        raise ConfigError(f"{where}: loss_fn must be a function loss_fn(output, targets) -> scalar loss")
    return StageModel(tuple(model.stages), model.loss_fn)


def split_model(model: nn.Module, split_points: Sequence[str], example_input: torch.Tensor) -> list[nn.Module]:
    """Split an ordinary model with torch.distributed.pipelining: a stage begins at each named submodule (e.g.
    "layers.2"), traced on `example_input` (a micro-batch of token ids). Parameter names stay the model's, so the
    stages' state dicts together load into `model`. Runs on CPU in one process (no process group needed)."""
    from torch.distributed.pipelining import SplitPoint, pipeline

    pipe = pipeline(model, mb_args=(example_input,),
                    split_spec={name: SplitPoint.BEGINNING for name in split_points})
    return [pipe.get_stage_module(i) for i in range(pipe.num_stages)]


def _meta_forward(module: nn.Module, x: torch.Tensor) -> Any:
    """The module's output for `x` on the meta device (shapes and dtypes only, no compute, no copy of the weights);
    a module that keeps tensors outside its parameters and buffers is copied to the meta device instead."""
    from torch.func import functional_call

    state = {name: torch.empty_like(t, device="meta") for name, t in
             [*module.named_parameters(), *module.named_buffers()]}
    with torch.no_grad():
        try:
            return functional_call(module, state, (x,))
        except (RuntimeError, NotImplementedError):
            return copy.deepcopy(module).to("meta")(x)


def boundary_shapes(stages: Sequence[nn.Module], batch: int, seq: int,
                    upto: int | None = None) -> list[tuple[int, ...]]:
    """The shape each stage s < S - 1 (or s < `upto`) sends downstream, from `boundary_shape(batch, seq)` where
    every stage up to there has it, else by one micro-batch of token ids [batch, seq] through the stages on meta."""
    count = len(stages) - 1 if upto is None else min(upto, len(stages) - 1)
    if all(hasattr(m, "boundary_shape") for m in stages[:count]):
        return [tuple(int(d) for d in stages[s].boundary_shape(batch, seq)) for s in range(count)]
    shapes = []
    x = torch.empty(batch, seq, dtype=torch.long, device="meta")
    for s in range(count):
        try:
            out = _meta_forward(stages[s], x)
        except Exception as exc:  # a user's module: name the stage, keep its message
            raise ConfigError(f"stage {s} failed on a micro-batch of shape {list(x.shape)} on the meta device "
                              f"({type(exc).__name__}: {exc}); check that stage {s} takes the previous stage's output "
                              "(stage 0: token ids [batch, seq])") from None
        if not isinstance(out, torch.Tensor):
            kind = f"a {type(out).__name__}" + (f" of {len(out)} values" if isinstance(out, (tuple, list)) else "")
            raise ConfigError(f"stage {s} returns {kind}; the runtime sends one tensor between stages: split where a "
                              "single activation crosses (e.g. at the start of a decoder layer)")
        if not out.is_floating_point():
            raise ConfigError(f"stage {s} returns a {out.dtype} tensor; activations sent downstream must be floating "
                              "point (gradients flow back through them)")
        shapes.append(tuple(out.shape))
        x = out
    return shapes
