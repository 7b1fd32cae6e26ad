"""Layer re-partitioning at an iteration boundary: stages hand whole layers (parameters and their optimizer state)
to each other over torch.distributed, and every worker whose layer range changed rebuilds its stage module and
optimizer. The maths does not change: a layer computes the same wherever it lives, so the parameters after any
sequence of re-partitions equal the fault-free run's."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch import nn

from recycle.config import Config
from recycle.errors import ConfigError
from recycle.models.gpt import GPTStage, resolve_shape, stage_layers
from recycle.runtime.state_transfer import decode_layout, encode_layout, group_by_dtype

__all__ = ["LayerMove", "MigrationStats", "layer_bounds", "plan_bounds", "layer_moves", "bundles", "layer_names",
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


def layer_names(module: nn.Module, layers: Sequence[int]) -> list[str]:
    """The trainable parameter names of `layers` in the built-in GPT (blocks keep their global index)."""
    prefixes = tuple(f"blocks.{layer}." for layer in layers)
    return [name for name, p in module.named_parameters() if p.requires_grad and name.startswith(prefixes)]


def _optimizer_state_by_name(module: nn.Module, optimizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(per-parameter optimizer state keyed by parameter name, the rest of the optimizer's state dict)."""
    full = optimizer.state_dict()
    inner = full["optimizer"]
    names = [name for name, p in module.named_parameters() if p.requires_grad]
    by_name = {names[int(index)]: state for index, state in inner["state"].items()}
    return by_name, full


def _send(obj: Any, send: Callable[[torch.Tensor], None], device: torch.device) -> int:
    tensors: list[torch.Tensor] = []
    layout = encode_layout(obj, tensors)
    blob = torch.frombuffer(bytearray(json.dumps(layout).encode()), dtype=torch.uint8).to(device)
    send(torch.tensor([blob.numel()], dtype=torch.int64, device=device))
    send(blob)
    moved = 8 + blob.numel()
    for group in group_by_dtype(tensors):
        flat = torch.cat([t.detach().reshape(-1).to(device) for t in group])
        send(flat)
        moved += flat.numel() * flat.element_size()
    return moved


def _receive(recv: Callable[[torch.Tensor], None], device: torch.device) -> tuple[Any, int]:
    size = torch.zeros(1, dtype=torch.int64, device=device)
    recv(size)
    blob = torch.empty(int(size[0]), dtype=torch.uint8, device=device)
    recv(blob)
    moved = 8 + blob.numel()
    tensors: list[torch.Tensor] = []

    def make(entry: dict[str, Any]) -> torch.Tensor:
        tensor = torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]), device=device)
        tensors.append(tensor)
        return tensor

    obj = decode_layout(json.loads(bytes(blob.cpu().numpy()).decode()), make)
    for group in group_by_dtype(tensors):
        flat = torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype, device=device)
        recv(flat)
        moved += flat.numel() * flat.element_size()
        offset = 0
        for tensor in group:
            tensor.copy_(flat[offset:offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
    return obj, moved


def exchange_layers(module: nn.Module, optimizer: Any, stage: int, moves: Sequence[LayerMove],
                    senders: dict[int, int], receivers: dict[int, list[int]], me: int,
                    send: Callable[[torch.Tensor, int], None], recv: Callable[[torch.Tensor, int], None],
                    device: torch.device) -> tuple[dict[str, torch.Tensor], dict[str, Any], MigrationStats]:
    """Move layers between stages. `senders[s]`: the rank that sends stage s's departing layers (one live replica);
    `receivers[s]`: every rank of stage s that receives arriving layers; `me`: this worker's rank. Returns the
    parameters and per-parameter optimizer state this worker received, keyed by parameter name."""
    started = time.perf_counter()
    by_name, _ = _optimizer_state_by_name(module, optimizer)
    params = dict(module.named_parameters())
    received: dict[str, torch.Tensor] = {}
    received_state: dict[str, Any] = {}
    moved = layers_in = layers_out = 0
    for source, target, layers in bundles(moves):
        if source == stage and senders[source] == me:
            names = layer_names(module, layers)
            payload = {"params": {n: params[n].detach() for n in names},
                       "state": {n: by_name[n] for n in names if n in by_name}}
            for rank in receivers[target]:
                moved += _send(payload, lambda t, r=rank: send(t, r), device)
            layers_out += len(layers)
        elif target == stage and me in receivers[target]:
            payload, size = _receive(lambda t: recv(t, senders[source]), device)
            moved += size
            received.update(payload["params"])
            received_state.update(payload["state"])
            layers_in += len(layers)
    return received, received_state, MigrationStats(layers_in, layers_out, moved, time.perf_counter() - started)


def rebuild_stage(config: Config, module: GPTStage, optimizer: Any, new_range: tuple[int, int],
                  received: dict[str, torch.Tensor], received_state: dict[str, Any],
                  make_optimizer: Callable[[nn.Module], Any]) -> tuple[GPTStage, Any]:
    """The stage module for `new_range` and its optimizer: kept layers (and the embedding / head) from `module`,
    arriving layers from `received`; optimizer state moved with each parameter, the schedule position kept."""
    first, last = new_range
    reference = next(module.parameters())
    fresh = GPTStage(module.shape, first, last).to(device=reference.device, dtype=reference.dtype)
    old_state = module.state_dict()
    wanted = fresh.state_dict()
    state = {}
    for name in wanted:
        if name in received:
            state[name] = received[name]
        elif name in old_state:
            state[name] = old_state[name]
        else:
            raise ConfigError(f"layer re-partition to {new_range}: parameter {name!r} neither kept nor received; the "
                              "workers disagree on the current partition")
    fresh.load_state_dict(state)
    by_name, full = _optimizer_state_by_name(module, optimizer)
    by_name.update(received_state)
    new_optimizer = make_optimizer(fresh)
    names = [name for name, p in fresh.named_parameters() if p.requires_grad]
    groups = new_optimizer.state_dict()["optimizer"]["param_groups"]
    new_optimizer.load_state_dict({**full, "optimizer": {
        "state": {index: by_name[name] for index, name in enumerate(names) if name in by_name},
        "param_groups": groups}})
    return fresh, new_optimizer
