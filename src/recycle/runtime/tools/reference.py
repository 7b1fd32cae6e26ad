"""Single-process reference training: the whole model, the same D*M micro-batches per step, each micro-batch's mean
loss weighted by the global-token rule (recycle.ir.pieces.loss_weight: 1/(D*M) for whole micro-batches) and
summed, optional global-norm clipping, the configured optimizer, LR schedule and precision (bf16 autocast), and the
held-out evaluations of [training] eval_every. Pipeline runs must end with the same parameters and losses."""

from __future__ import annotations

from typing import Callable

import torch

from recycle.config import Config
from recycle.errors import ConfigError
from recycle.ir.pieces import loss_weight
from recycle.models.gpt import full_model
from recycle.runtime.state.optim import make_optimizer
from recycle.runtime.state.precision import autocast, weights_dtype
from recycle.runtime.worker.data import data_source

__all__ = ["reference_train", "reference_eval_loss"]


def reference_eval_loss(config: Config, module: torch.nn.Module,
                        model: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> float:
    """The mean loss of `model` (tokens, targets -> loss) over [training] eval_batches global batches of the
    held-out split, micro-batch by micro-batch, without gradients or dropout (what worker.evaluation computes)."""
    load = data_source(config, "eval")
    total = config.num_replicas * config.num_microbatches
    batches = config.training.eval_batches
    loss_sum = 0.0
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            for batch in range(batches):
                for mb in range(total):
                    tokens, targets = load(batch, mb)
                    with autocast(config.training.dtype):
                        loss_sum += float(model(tokens, targets).double())
    finally:
        module.train(training)
    return loss_sum / (batches * total)


def reference_train(config: Config, steps: int | None = None, evaluations: dict[int, float] | None = None
                    ) -> tuple[dict[str, torch.Tensor], list[float]]:
    """(final state dict, loss per step) of `steps` steps (default: [training] steps) on one process. `evaluations`,
    if given, receives {done steps: held-out loss} at every [training] eval_every."""
    if config.model.dropout > 0:
        raise ConfigError("the reference needs [model] dropout = 0: the pipeline seeds dropout per stage, which a "
                          "whole-model forward cannot reproduce")
    training, workload = config.training, config.workload
    steps = training.steps if steps is None else steps
    if config.model.hf_config:
        # The same Hugging Face model the stages are cut from, whole: logits, then the runtime's loss_fn.
        from recycle.models.hf import build_hf_model, hf_dropouts
        from recycle.models.split import causal_lm_loss
        from recycle.runtime.worker.stage import hf_path, hf_weights_path

        whole = build_hf_model(hf_path(config), workload.seq_len, training.seed, weights_dtype(training.dtype),
                               hf_weights_path(config))
        drops = hf_dropouts(whole.model.config)
        if drops:
            raise ConfigError(f"the reference needs no dropout, but {config.model.hf_config!r} has {drops}; set them "
                              "to 0.0 in the Hugging Face config")

        def model(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return causal_lm_loss(whole(tokens), targets)
        module: torch.nn.Module = whole
    else:
        module = model = full_model(config.model, workload.seq_len, training.seed,
                                    weights_dtype(training.dtype))
    optimizer = make_optimizer(module, training)
    load = data_source(config)
    total = config.num_replicas * config.num_microbatches
    weight = loss_weight(workload.microbatch_size, workload.microbatch_size, total)
    losses = []
    for step in range(steps):
        step_loss = 0.0
        for mb in range(total):
            tokens, targets = load(step, mb)
            with autocast(training.dtype):
                loss = model(tokens, targets) * weight
            loss.backward()
            step_loss += float(loss.detach())
        if training.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(module.parameters(), training.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(step_loss)
        every = training.eval_every
        if evaluations is not None and every and (step + 1) % every == 0:
            evaluations[step + 1] = reference_eval_loss(config, module, model)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}, losses
