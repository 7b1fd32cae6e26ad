"""Layer re-partitioning at an iteration boundary: stages hand whole layers (parameters and their optimizer state)
to each other over torch.distributed, and every worker whose layer range changed rebuilds its stage module and
optimizer. The maths does not change: a layer computes the same wherever it lives, so the parameters after any
sequence of re-partitions equal the fault-free run's."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence, cast

import torch
from torch import nn

from recycle.config import Config
from recycle.errors import ConfigError
from recycle.models.gpt import GPTStage, resolve_shape, stage_layers
from recycle.runtime.state.stage_state import OPTIMIZER_PREFIX, StageState
from recycle.runtime.state.state_transfer import receive_state, send_state

__all__ = ["LayerMove", "MigrationStats", "layer_bounds", "plan_bounds", "layer_moves", "bundles", "layer_entries",
           "exchange_layers", "rebuild_stage", "layer_scaled_config"]

Bounds = list[tuple[int, int]]  # [first, last) blocks per stage


@dataclass(frozen=True)
class LayerMove:
    layer: int
    source: int  # stage that holds it now
    target: int  # stage that holds it after the re-partition


@dataclass(frozen=True)
class MigrationStats:
    layers_in: int
    layers_out: int
    bytes: int  # sent plus received by this worker
    seconds: float


def layer_bounds(partition: Sequence[int]) -> Bounds:
    """[first, last) per stage from the number of layers each holds."""
    bounds, start = [], 0
    for count in partition:
        bounds.append((start, start + int(count)))
        start += int(count)
    return bounds


def plan_bounds(config: Config, partition: Sequence[int]) -> Bounds:
    """The layer ranges a plan asks for: its partition, else the config's layout ([model] layers_per_stage, else
    the model's layers split evenly). Checked against the built-in GPT's layer count."""
    n_layer = resolve_shape(config.model, config.workload.seq_len).n_layer
    configured = getattr(config.model, "layers_per_stage", ()) or ()
    chosen = tuple(partition) or tuple(configured)
    if not chosen:
        return stage_layers(n_layer, config.num_stages)
    if len(chosen) != config.num_stages or sum(chosen) != n_layer or min(chosen) < 1:
        raise ConfigError(f"layer partition {list(chosen)} does not split the model's {n_layer} layers over "
                          f"{config.num_stages} stages (one count >= 1 per stage, summing to {n_layer}); plan for "
                          "this model and num_stages")
    return layer_bounds(chosen)


def layer_scaled_config(config: Config, bounds: Bounds | None) -> Config:
    """`config` with each stage's compute costs scaled by the layers it holds under `bounds` over those it holds in
    the configured layout (per-layer costs taken as equal within a stage): what --emulate-costs paces to after a
    re-partition."""
    if bounds is None:
        return config
    configured = plan_bounds(config, ())
    if bounds == configured:
        return config
    factor = [(last - first) / (c_last - c_first) for (first, last), (c_first, c_last) in zip(bounds, configured)]
    costs = config.costs

    def scaled(values: Sequence[float]) -> tuple[float, ...]:
        return tuple(v * f for v, f in zip(values, factor))

    return replace(config, costs=replace(costs, forward=scaled(costs.forward),
                                         backward_input=scaled(costs.backward_input),
                                         backward_weight=scaled(costs.backward_weight),
                                         optimizer=scaled(costs.optimizer),
                                         backward_fused=scaled(costs.backward_fused)))


def layer_moves(old: Bounds, new: Bounds) -> list[LayerMove]:
    """Every layer whose stage changes, in layer order."""
    def owner(bounds: Bounds) -> dict[int, int]:
        return {layer: s for s, (first, last) in enumerate(bounds) for layer in range(first, last)}

    before, after = owner(old), owner(new)
    if set(before) != set(after):
        raise ConfigError(f"layer partitions {old} and {new} do not cover the same layers")
    return [LayerMove(layer, before[layer], after[layer]) for layer in sorted(before) if before[layer] != after[layer]]


def bundles(moves: Sequence[LayerMove]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Moves grouped per (source stage, target stage), in one order that every worker follows (no deadlock)."""
    grouped: dict[tuple[int, int], list[int]] = {}
    for move in moves:
        grouped.setdefault((move.source, move.target), []).append(move.layer)
    return [(source, target, tuple(layers)) for (source, target), layers in sorted(grouped.items())]


def layer_entries(state: StageState, layers: Sequence[int]) -> dict[str, Any]:
    """The entries of `layers` in the built-in GPT's stage state (blocks keep their global index): their parameters
    and their optimizer state."""
    heads = tuple(f"{head}{state.prefix}blocks.{layer}." for layer in layers for head in ("", OPTIMIZER_PREFIX))
    return {key: value for key, value in state.state_dict().items() if key.startswith(heads)}


def exchange_layers(state: StageState, moves: Sequence[LayerMove], senders: dict[int, int],
                    receivers: dict[int, list[int]], me: int, send: Callable[[torch.Tensor, int], None],
                    recv: Callable[[torch.Tensor, int], None],
                    device: torch.device) -> tuple[dict[str, Any], MigrationStats]:
    """Move layers between stages. `senders[s]`: the rank that sends stage s's departing layers (one live replica);
    `receivers[s]`: every rank of stage s that receives arriving layers; `me`: this worker's rank. Returns the
    state entries (parameters and optimizer state, stage_state's keys) this worker received."""
    started = time.perf_counter()
    received: dict[str, Any] = {}
    moved = layers_in = layers_out = 0
    for source, target, layers in bundles(moves):
        if source == state.stage and senders[source] == me:
            payload = layer_entries(state, layers)
            for rank in receivers[target]:
                moved += send_state(payload, lambda t: send(t, rank), device)
            layers_out += len(layers)
        elif target == state.stage and me in receivers[target]:
            payload, size = receive_state(lambda t: recv(t, senders[source]), device)
            moved += size
            received.update(payload)
            layers_in += len(layers)
    return received, MigrationStats(layers_in, layers_out, moved, time.perf_counter() - started)


def rebuild_stage(state: StageState, new_range: tuple[int, int], received: dict[str, Any],
                  make_optimizer: Callable[[nn.Module], Any]) -> StageState:
    """The stage state for `new_range`: a new module and optimizer holding the kept layers (and the embedding / head)
    of `state` and the arriving ones of `received`, optimizer state moved with each parameter, the schedule and
    iteration positions kept."""
    first, last = new_range
    module = cast(GPTStage, state.module)  # layers move only between the built-in GPT's stages
    reference = next(module.parameters())
    fresh = GPTStage(module.shape, first, last).to(device=reference.device, dtype=reference.dtype)
    fresh.activation_checkpointing = module.activation_checkpointing  # the run's mode, kept across the move
    merged = {**state.state_dict(), **received}
    for name in fresh.state_dict():
        if state.prefix + name not in merged:
            raise ConfigError(f"layer re-partition to {new_range}: parameter {name!r} neither kept nor received; the "
                              "workers disagree on the current partition")
    rebuilt = StageState(fresh, make_optimizer(fresh), state.stage, state.position, state.prefix)
    rebuilt.load_state_dict(merged)
    return rebuilt
