"""Stage construction: the built-in GPT's stages, or "bring your own model" through a factory 'module:function'.

A factory is called as `factory(config, num_stages)` and returns the S stage modules of one model with the same
initial weights on every call (seed it from `config.training.seed`): a list of modules, or a
`recycle.models.split.StageModel(stages, loss_fn)` -- e.g. the stage modules of torch.distributed.pipelining's
`pipeline()`. The call and loss contract is recycle.models.split's; the boundary shapes are found by one micro-batch
on the meta device unless every stage has `boundary_shape(batch, seq)`. A Hugging Face config ([model] hf_config)
is split by decoder layers (recycle.models.hf).
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from recycle.config import Config
from recycle.errors import ConfigError
from recycle.models.checkpointing import set_mode
from recycle.models.gpt import build_stage as build_gpt_stage
from recycle.models.gpt import build_stages, resolve_shape, stage_layers
from recycle.models.tensor_parallel import check_hf_tensor_parallel, check_tensor_parallel
from recycle.models.split import LossFn, StageModel, as_stage_model, boundary_shapes, causal_lm_loss
from recycle.runtime.state.precision import weights_dtype
from recycle.runtime.worker.tensor_parallel import check_worker_features

__all__ = ["BuiltStage", "build_stage", "load_factory", "check_model", "factory_model", "hf_model", "all_stages",
           "check_one_model", "hf_built_stage", "gpt_built_stage", "hf_path", "hf_weights_path", "tied_stages",
           "tied_copy_keys", "drop_tied_copies"]

StageFactory = Callable[[Config, int], list[nn.Module]]


@dataclass(frozen=True)
class BuiltStage:
    module: nn.Module
    layout: tuple[int, int]  # which part of the model this stage holds (checked on resume)
    input_shape: tuple[int, ...] | None  # the activation it receives (None on stage 0: token ids are loaded)
    output_shape: tuple[int, ...] | None  # the activation it sends, = the gradient it receives (None: last stage)
    loss_fn: LossFn | None = None  # last stage: loss = loss_fn(module(x), targets); None: module(x, targets)


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
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # some builtins have none: their call below says what is wrong
        return factory
    try:
        signature.bind(None, None)
    except TypeError:
        raise ConfigError(f"model factory {path!r} takes {signature}, not (config, num_stages); a model factory is a "
                          "function (config, num_stages) -> list of stage modules (docs/runtime.md)") from None
    return factory


def factory_model(config: Config, factory: str) -> StageModel:
    """The factory's stages (checked, in the config's dtype) and loss function."""
    model = as_stage_model(load_factory(factory)(config, config.num_stages), config.num_stages,
                           f"model factory {factory!r}")
    tied = [s for s, m in enumerate(model.stages) if getattr(m, "tied_weights", ())]
    if tied:  # the tied group is formed for a Hugging Face model's first and last stage only (tied_stages)
        raise ConfigError(f"model factory {factory!r}: stage(s) {tied} declare tied_weights, which recycle sums "
                          "across stages for Hugging Face models only (--hf); give each stage its own parameters")
    dtype = weights_dtype(config.training.dtype)
    return StageModel(tuple(m.to(dtype) for m in model.stages), model.loss_fn)


def hf_path(config: Config) -> str:
    from recycle.models.hf import resolve_hf_path

    return str(resolve_hf_path(config.model.hf_config, os.path.dirname(config.source) or None))


def hf_weights_path(config: Config) -> str | None:
    """The pretrained weights the Hugging Face model starts from ([model] hf_weights, or the save_pretrained folder
    [model] hf_config names), or None: random init from the seed."""
    from recycle.models.hf import resolve_hf_weights

    if not config.model.hf_config:
        if config.model.hf_weights:
            raise ConfigError(f"[model] hf_weights = {config.model.hf_weights!r} needs the Hugging Face model they are "
                              "for: set [model] hf_config (--hf) too")
        return None
    found = resolve_hf_weights(config.model.hf_config, config.model.hf_weights, os.path.dirname(config.source) or None)
    return None if found is None else str(found)


def _tied_hf_config(config: Config, factory: str) -> Any:
    """The Hugging Face config of the run's model if it ties its word embeddings, else None."""
    if factory or not config.model.hf_config:
        return None
    from recycle.models.hf import load_hf_config, tied_embedding

    hf = load_hf_config(hf_path(config), config.workload.seq_len)
    return hf if tied_embedding(hf) is not None else None


def tied_stages(config: Config, factory: str = "") -> tuple[int, ...]:
    """The stages that hold a copy of a tied weight and sum its gradient across them (a tied Hugging Face model's
    first and last stage, when they differ): every worker forms their group, so every worker asks."""
    S = config.num_stages
    return (0, S - 1) if S > 1 and _tied_hf_config(config, factory) is not None else ()


def tied_copy_keys(config: Config, factory: str = "") -> dict[str, str]:
    """The stage-state keys that only repeat another tensor of the model (a tied lm_head weight), each with the key
    of the tensor it repeats: left out of the merged --save, as save_pretrained leaves them out."""
    hf = _tied_hf_config(config, factory)
    if hf is None:
        return {}
    from recycle.models.hf import tied_copies
    from recycle.models.hf_export import STAGE_PREFIX

    return {STAGE_PREFIX + copy: STAGE_PREFIX + original for copy, original in tied_copies(hf).items()}


def drop_tied_copies(parts: list[dict[str, torch.Tensor]], copies: dict[str, str]) -> list[dict[str, torch.Tensor]]:
    """The stages' state dicts without the tied copies (tied_copy_keys), each checked equal to the tensor it repeats
    (the tied all-reduce keeps them bit for bit equal: a difference is a bug, never written silently)."""
    whole = {k: v for part in parts for k, v in part.items()}
    for copy, original in copies.items():
        if copy in whole and original in whole and not torch.equal(whole[copy], whole[original]):
            raise RuntimeError(f"the tied weight's copies differ: {copy} and {original}")
    return [{k: v for k, v in part.items() if k not in copies} for part in parts]


def hf_model(config: Config) -> tuple[StageModel, list[tuple[int, int]]]:
    """A Hugging Face causal LM ([model] hf_config) split by decoder layers, and each stage's layers."""
    from recycle.models.hf import hf_stages

    dtype = weights_dtype(config.training.dtype)
    stages = hf_stages(hf_path(config), config.num_stages, config.workload.seq_len, config.training.seed, dtype,
                       hf_weights_path(config))
    return StageModel(tuple(stages), causal_lm_loss), [(m.first_layer, m.end_layer) for m in stages]


def check_one_model(config: Config, factory: str) -> None:
    """Refuse a run whose model is named twice (a factory and a Hugging Face config)."""
    if factory and config.model.hf_config:
        raise ConfigError(f"--model-factory {factory!r} and [model] hf_config = {config.model.hf_config!r} both name "
                          "the model; keep one")


def hf_built_stage(config: Config, stage: int) -> BuiltStage:
    """A Hugging Face model's stage built alone (only its tensors are allocated; recycle.models.hf.hf_stage)."""
    from recycle.models.hf import hf_stage

    S, workload = config.num_stages, config.workload
    module = hf_stage(hf_path(config), S, stage, workload.seq_len, config.training.seed,
                      weights_dtype(config.training.dtype), hf_weights_path(config))
    boundary = tuple(module.boundary_shape(workload.microbatch_size, workload.seq_len))  # hidden states, every stage
    return BuiltStage(module, (module.first_layer, module.end_layer), boundary if stage > 0 else None,
                      boundary if stage < S - 1 else None, causal_lm_loss if stage == S - 1 else None)


def gpt_built_stage(config: Config, stage: int, bounds: list[tuple[int, int]] | None = None) -> BuiltStage:
    """A built-in GPT's stage built alone (only its tensors are allocated; recycle.models.gpt.build_stage)."""
    S, workload = config.num_stages, config.workload
    module = build_gpt_stage(config.model, S, stage, config.training.seed, weights_dtype(config.training.dtype),
                             workload.seq_len, bounds)
    boundary = module.boundary_shape(workload.microbatch_size, workload.seq_len)  # the same at every boundary
    return BuiltStage(module, (module.first, module.last), boundary if stage > 0 else None,
                      boundary if stage < S - 1 else None)


def all_stages(config: Config, factory: str = "",
               bounds: list[tuple[int, int]] | None = None) -> tuple[StageModel, list[tuple[int, int]]]:
    """Every stage module of the run's model (built-in GPT, Hugging Face config, or factory) and their layouts.
    `bounds`: the built-in GPT's [first, last) layers per stage (default: the even split)."""
    S = config.num_stages
    check_one_model(config, factory)
    if factory:
        model, layouts = factory_model(config, factory), [(s, S) for s in range(S)]
    elif config.model.hf_config:
        model, layouts = hf_model(config)
    else:
        seq = config.workload.seq_len
        shape = resolve_shape(config.model, seq)
        layouts = bounds or stage_layers(shape.n_layer, S)
        model = StageModel(tuple(build_stages(config.model, S, config.training.seed,
                                              weights_dtype(config.training.dtype), seq, layouts)))
    mode = config.model.activation_checkpointing
    for s, module in enumerate(model.stages):
        set_mode(module, mode, f"stage {s}")
    return model, layouts


def build_stage(config: Config, stage: int, factory: str = "",
                bounds: list[tuple[int, int]] | None = None) -> BuiltStage:
    """The module of `stage` (in the config's dtype), its layout and the shapes of the messages it receives
    (`bounds`: see all_stages)."""
    S = config.num_stages
    if not factory:
        built = hf_built_stage(config, stage) if config.model.hf_config else gpt_built_stage(config, stage, bounds)
        set_mode(built.module, config.model.activation_checkpointing, f"stage {stage}")
        return built
    model, layouts = all_stages(config, factory, bounds)
    stages = list(model.stages)
    shapes = boundary_shapes(stages, config.workload.microbatch_size, config.workload.seq_len, upto=stage + 1)
    input_shape = shapes[stage - 1] if stage > 0 else None
    output_shape = shapes[stage] if stage < S - 1 else None
    return BuiltStage(stages[stage], layouts[stage], input_shape, output_shape,
                      model.loss_fn if stage == S - 1 else None)


def check_model(config: Config, factory: str = "") -> None:
    """Fail fast, in the launcher, on model errors (unknown preset, too few layers, a broken factory or Hugging Face
    config, stages whose outputs cannot be sent): a factory is called once and its stages run on the meta device; a
    Hugging Face model is only laid out there."""
    check_one_model(config, factory)
    check_worker_features(config, factory, partition=False)
    hf_weights_path(config)  # hf_weights without hf_config
    if factory:
        model, _ = all_stages(config, factory)
        boundary_shapes(list(model.stages), config.workload.microbatch_size, config.workload.seq_len)
    elif config.model.hf_config:
        from recycle.models.hf import check_hf_model

        # On the meta device, and the weights' headers only.
        check_hf_model(hf_path(config), config.num_stages, config.workload.seq_len, hf_weights_path(config))
        if config.topology.gpus_per_worker > 1:
            from recycle.models.hf import load_hf_config

            check_hf_tensor_parallel(load_hf_config(hf_path(config), config.workload.seq_len),
                                     config.topology.gpus_per_worker)
    else:
        shape = resolve_shape(config.model, config.workload.seq_len)
        stage_layers(shape.n_layer, config.num_stages)
        check_tensor_parallel(shape, config.topology.gpus_per_worker)
