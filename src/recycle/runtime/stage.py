"""Stage construction: the built-in GPT's stages, or "bring your own model" through a factory 'module:function'.

A factory is called as `factory(config, num_stages)` and returns the S stage modules of one model with the same
initial weights on every call (seed it from `config.training.seed`). Every module keeps the stage call contract of
`recycle.models.gpt` (stage 0 takes token ids, the last stage returns the scalar loss given targets) and has a
method `boundary_shape(batch, seq)` giving the shape of the tensor it sends downstream.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from recycle.config import Config
from recycle.errors import ConfigError
from recycle.models.gpt import build_stages, resolve_shape, stage_layers
from recycle.runtime.precision import weights_dtype

__all__ = ["BuiltStage", "build_stage", "load_factory", "check_model"]

StageFactory = Callable[[Config, int], list[nn.Module]]


@dataclass(frozen=True)
class BuiltStage:
    module: nn.Module
    layout: tuple[int, int]  # which part of the model this stage holds (checked on resume)
    input_shape: tuple[int, ...] | None  # the activation it receives (None on stage 0: token ids are loaded)
    output_shape: tuple[int, ...] | None  # the activation it sends, = the gradient it receives (None: last stage)


def load_factory(path: str) -> StageFactory:
    """Import 'package.module:function'."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"model factory {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"model factory {path!r}: cannot import {module_name!r} ({exc}); put it on PYTHONPATH") \
            from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"model factory {path!r}: {module_name!r} has no function {attr!r}")
    return factory


def build_stage(config: Config, stage: int, factory: str = "") -> BuiltStage:
    """The module of `stage` (in the config's dtype), its layout and the shapes of the messages it receives."""
    S = config.num_stages
    batch, seq = config.workload.microbatch_size, config.workload.seq_len
    if not factory:
        shape = resolve_shape(config.model, seq)
        stages = build_stages(config.model, S, config.training.seed, weights_dtype(config.training.dtype), seq)
        layout = stage_layers(shape.n_layer, S)[stage]
    else:
        stages = load_factory(factory)(config, S)
        if len(stages) != S:
            raise ConfigError(f"model factory {factory!r} returned {len(stages)} stages but num_stages = {S}")
        for s, module in enumerate(stages[:-1]):
            if not hasattr(module, "boundary_shape"):
                raise ConfigError(f"model factory {factory!r}: stage {s} has no boundary_shape(batch, seq) method")
        stages = [m.to(weights_dtype(config.training.dtype)) for m in stages]
        layout = (stage, S)
    input_shape = tuple(stages[stage - 1].boundary_shape(batch, seq)) if stage > 0 else None
    output_shape = tuple(stages[stage].boundary_shape(batch, seq)) if stage < S - 1 else None
    return BuiltStage(stages[stage], layout, input_shape, output_shape)


def check_model(config: Config, factory: str = "") -> None:
    """Fail fast, in the launcher, on model errors (unknown preset, too few layers, a broken factory)."""
    if factory:
        load_factory(factory)
    else:
        stage_layers(resolve_shape(config.model, config.workload.seq_len).n_layer, config.num_stages)
