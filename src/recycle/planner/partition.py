"""Layer re-partitioning: per-layer costs from the config, the per-stage config of a partition, the best partition
for a failure state (balanced work per live worker, under the memory caps) and its plan."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Iterable, Sequence

from recycle.config import Config, parse_config
from recycle.errors import ConfigError, PlanError
from recycle.ir.plan import Plan
from recycle.planner.api import make_plan, plan_for_key
from recycle.planner.failures import normalize
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import check_key

__all__ = ["LayerCosts", "configured_partition", "layer_costs", "partition_config", "partition_caps",
           "balanced_partition", "PartitionChoice", "best_partition", "partition_period", "ideal_period",
           "migration_bytes", "make_repartitioned_plan", "plan_with_partition"]

# Per-stage values that follow the layers a stage holds; everything else (activation messages: the hidden state
# between stages) does not depend on the partition.
_SCALED = {
    "costs": ("forward", "backward_input", "backward_weight", "optimizer", "backward_fused"),
    "memory": ("activation_bytes", "parameter_bytes", "optimizer_state_bytes"),
    "communication": ("gradient_bytes",),
}
_INTS = {"activation_bytes", "parameter_bytes", "optimizer_state_bytes", "gradient_bytes"}


def configured_partition(config: Config) -> tuple[int, ...]:
    """Layers per stage of the configured layout: `[model] layers_per_stage`, else the model's layers split as
    evenly as possible, earlier stages taking the extra layer (the runtime's `models.gpt.stage_layers`)."""
    if config.model.layers_per_stage:
        return tuple(config.model.layers_per_stage)
    from recycle.models.gpt import resolve_shape  # lazy: torch is only needed for a preset's layer count

    n_layer = resolve_shape(config.model, config.workload.seq_len).n_layer
    S = config.num_stages
    if n_layer < S:
        raise ConfigError(f"{config.source or config.name}: the model has {n_layer} layer(s) for {S} stages, so no "
                          "stage can give a layer away; set [model] layers_per_stage (one count per stage, e.g. "
                          f"{[8] * S}) to the layers behind the per-stage costs")
    base, extra = divmod(n_layer, S)
    return tuple(base + (1 if s < extra else 0) for s in range(S))


@dataclass(frozen=True)
class LayerCosts:
    """Stage s holding n layers costs n * per_layer[key] + fixed[key][s] for every partition-dependent value.

    Derived from the configured per-stage values and layer counts: the stage with the lowest value per layer is
    taken to hold transformer layers only, so per_layer = min_s value_s / layers_s, and what another stage has on
    top (the embeddings of stage 0, the LM head of the last stage) is a fixed cost of that stage's position."""

    layers: tuple[int, ...]
    per_layer: dict[str, float]
    fixed: dict[str, tuple[float, ...]]

    def value(self, key: str, stage: int, n: int) -> float:
        return n * self.per_layer[key] + self.fixed[key][stage]

    def compute(self, stage: int, n: int) -> float:
        """F + B + W of one micro-batch at `stage` holding `n` layers."""
        return sum(self.value(k, stage, n) for k in ("forward", "backward_input", "backward_weight"))

    def state_bytes(self, stage: int, n: int) -> float:
        """Weights, gradients and optimizer state a worker of `stage` keeps (what competes with activations)."""
        return sum(self.value(k, stage, n) for k in ("parameter_bytes", "optimizer_state_bytes", "gradient_bytes"))

    def moved_bytes_per_layer(self) -> float:
        """A migrated layer carries its parameters and optimizer state (Adam's moments, plus the fp32 master copy
        when the config counts it in optimizer_state_bytes); gradients are recomputed, not moved."""
        return self.per_layer["parameter_bytes"] + self.per_layer["optimizer_state_bytes"]


def layer_costs(config: Config, layers: Sequence[int] | None = None) -> LayerCosts:
    """The per-layer cost model of `config`, whose per-stage values hold `layers` (default: the configured ones)."""
    layers = tuple(layers) if layers is not None else configured_partition(config)
    if len(layers) != config.num_stages or any(n < 1 for n in layers):
        raise ConfigError(f"layer partition {list(layers)} must give one count >= 1 per stage ({config.num_stages} "
                          "stages)")
    per_layer: dict[str, float] = {}
    fixed: dict[str, tuple[float, ...]] = {}
    for section, keys in _SCALED.items():
        for key in keys:
            values = getattr(getattr(config, section), key)
            per = min(v / n for v, n in zip(values, layers))
            per_layer[key] = per
            fixed[key] = tuple(max(0.0, v - n * per) for v, n in zip(values, layers))
    return LayerCosts(layers, per_layer, fixed)


def partition_config(config: Config, partition: Sequence[int], costs: LayerCosts | None = None) -> Config:
    """`config` with per-stage costs, memory and gradient sizes following `partition` (same layer count)."""
    costs = costs or layer_costs(config)
    partition = _check_partition(costs, partition)
    raw = config.to_dict()
    for section, keys in _SCALED.items():
        for key in keys:
            values = [costs.value(key, s, n) for s, n in enumerate(partition)]
            raw[section][key] = [int(round(v)) for v in values] if key in _INTS else values
    # The activation caps of a partition come from partition_caps (passed as the planner's memory cap); the budget
    # only has to admit one micro-batch per stage here for the config to parse.
    if raw["memory"]["capacity_bytes"] > 0:
        raw["memory"]["capacity_bytes"] = max(raw["memory"]["capacity_bytes"], max(raw["memory"]["activation_bytes"]))
    raw["model"]["layers_per_stage"] = list(partition)
    raw["model"]["n_layer"] = sum(partition)
    return parse_config(raw, name=config.name, source=config.source)


def _check_partition(costs: LayerCosts, partition: Sequence[int]) -> tuple[int, ...]:
    partition = tuple(int(n) for n in partition)
    total = sum(costs.layers)
    if len(partition) != len(costs.layers) or any(n < 1 for n in partition) or sum(partition) != total:
        raise PlanError(f"layer partition {list(partition)} must give one count >= 1 per stage "
                        f"({len(costs.layers)} stages) summing to the model's {total} layers")
    return partition


def partition_caps(config: Config, partition: Sequence[int], costs: LayerCosts | None = None,
                   spec: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
    """Activation cap per stage under `partition`: an explicit cap (`spec`) as given; else each worker keeps its
    memory: the config's activation budget plus the state its stage holds today, minus the state it holds after
    re-partitioning, over the new activation bytes per micro-batch. None when the config's memory is unlimited.
    A stage whose cap falls below 1 cannot hold its layers: PlanError."""
    if spec is not None:
        return tuple(spec)
    capacity = config.memory.capacity_bytes
    if capacity <= 0:
        return None
    costs = costs or layer_costs(config)
    partition = _check_partition(costs, partition)
    caps = []
    for s, n in enumerate(partition):
        room = capacity - (costs.state_bytes(s, n) - costs.state_bytes(s, costs.layers[s]))
        cap = int(room // max(1.0, costs.value("activation_bytes", s, n)))
        if cap < 1:
            raise PlanError(f"layer partition {list(partition)}: stage {s} with {n} layers leaves room for {cap} "
                            "micro-batches of activations; give it fewer layers")
        caps.append(cap)
    return tuple(caps)


def _fits(config: Config, costs: LayerCosts, stage: int, n: int) -> bool:
    if config.memory.capacity_bytes <= 0:
        return True
    room = config.memory.capacity_bytes - (costs.state_bytes(stage, n) - costs.state_bytes(stage, costs.layers[stage]))
    return room >= costs.value("activation_bytes", stage, n)


def stage_work(config: Config, costs: LayerCosts, stage: int, n: int, live: int) -> float:
    """Busy time per iteration of one live worker of `stage` holding `n` layers, its stage's D*M micro-batches
    shared evenly by `live` workers: their F+B+W, then the stage's optimizer step and all-reduce."""
    D, M = config.num_replicas, config.num_microbatches
    comm = config.communication
    grad = costs.value("gradient_bytes", stage, n)
    allreduce = 0.0
    if live > 1:
        steps = 2 * (live - 1)
        transfer = steps / live * grad / comm.allreduce_bandwidth if comm.allreduce_bandwidth > 0 else 0.0
        allreduce = steps * comm.allreduce_latency + transfer
    return D * M / live * costs.compute(stage, n) + costs.value("optimizer", stage, n) + allreduce


def balanced_partition(config: Config, key: Sequence[int], costs: LayerCosts | None = None) -> tuple[int, ...]:
    """The partition minimising the largest `stage_work` per live worker, within the memory caps.

    Water-filling: every stage starts with one layer and each further layer goes to the stage whose work after
    taking it is smallest. For increasing per-stage costs this greedy is optimal for the min-max (an exchange
    argument: the L-th smallest marginal maximum is never exceeded)."""
    costs = costs or layer_costs(config)
    D, S = config.num_replicas, config.num_stages
    live = [D - k for k in key]
    parts = [1] * S
    for _ in range(sum(costs.layers) - S):
        options = [(stage_work(config, costs, s, parts[s] + 1, live[s]), s) for s in range(S)
                   if _fits(config, costs, s, parts[s] + 1)]
        if not options:
            raise PlanError(f"no layer partition of {sum(costs.layers)} layers fits the memory budget "
                            f"(capacity_bytes = {config.memory.capacity_bytes}); raise it or use more stages")
        parts[min(options)[1]] += 1
    return tuple(parts)


def ideal_period(config: Config, key: Sequence[int]) -> float:
    """The ideal live-proportional period of failure state `key`: every live worker's busy time (all D*M
    micro-batches' F+B+W at every stage, plus each live worker's optimizer step and all-reduce, configured
    partition) shared evenly by the live workers, with no bubble: the physical limit of this cost model, up to
    the small change of the step costs when layers move."""
    costs = layer_costs(config)
    D = config.num_replicas
    live = [D - k for k in key]
    total = sum(live[s] * stage_work(config, costs, s, n, live[s]) for s, n in enumerate(costs.layers) if live[s])
    return total / sum(live)


def partition_period(config: Config, key: Sequence[int], partition: Sequence[int],
                     options: PlannerOptions = PlannerOptions(), solver: str = "heuristic",
                     costs: LayerCosts | None = None, time_limit_s: float = 10.0) -> float:
    """The simulated period of the planner's plan for `key` with the layers laid out as `partition` (cached by
    the planner per derived config); inf when the partition does not fit in memory."""
    costs = costs or layer_costs(config)
    try:
        caps = partition_caps(config, partition, costs, options.memory_cap)
    except PlanError:
        return math.inf
    derived = partition_config(config, partition, costs)
    plan = plan_for_key(derived, tuple(key), replace(options, memory_cap=caps), solver, time_limit_s)
    assert plan.meta.predicted_period is not None
    return float(plan.meta.predicted_period)


@dataclass(frozen=True)
class PartitionChoice:
    """The partition chosen for a failure state, with the periods that justify it (config time units)."""

    key: tuple[int, ...]
    partition: tuple[int, ...]
    period: float  # the chosen partition's simulated period
    configured: tuple[int, ...]
    configured_period: float  # re-routing alone: the configured partition's period
    balanced: tuple[int, ...]  # the water-filling start of the search
    ideal_period: float
    evaluated: int  # partitions planned

    @property
    def changed(self) -> bool:
        return self.partition != self.configured

    def to_dict(self) -> dict:
        return {"key": list(self.key), "partition": list(self.partition), "period": self.period,
                "configured": list(self.configured), "configured_period": self.configured_period,
                "balanced": list(self.balanced), "ideal_period": self.ideal_period, "evaluated": self.evaluated}


def _neighbours(partition: tuple[int, ...]) -> Iterable[tuple[int, ...]]:
    """One layer moved across one stage boundary, either way (contiguous layers: only counts change)."""
    for b in range(len(partition) - 1):
        for give, take in ((b, b + 1), (b + 1, b)):
            if partition[give] > 1:
                out = list(partition)
                out[give] -= 1
                out[take] += 1
                yield tuple(out)


def best_partition(config: Config, key: Sequence[int], options: PlannerOptions = PlannerOptions(),
                   solver: str = "heuristic", max_evaluations: int = 24,
                   time_limit_s: float = 10.0) -> PartitionChoice:
    """The partition with the best simulated period for `key`: the configured one, the balanced one, then a hill
    climb over one-layer moves from the better of the two (the most promising by `stage_work` first), at most
    `max_evaluations` partitions screened.

    The screen plans with the priority rules only (`search=False`: milliseconds, and on GPT-3 6.7B it picks the
    same partitions as the full search); the winner and the configured partition are then planned with `options`
    and solver as given, and the winner is kept only if it is strictly faster (moving layers is never free)."""
    key = check_key(config, key)
    costs = layer_costs(config)
    configured = costs.layers
    screen = replace(options, search=False)
    periods: dict[tuple[int, ...], float] = {}

    def period(p: tuple[int, ...]) -> float:
        if p not in periods:
            periods[p] = partition_period(config, key, p, screen, "heuristic", costs)
        return periods[p]

    balanced = balanced_partition(config, key, costs)
    best = min((configured, balanced), key=lambda p: (period(p), p != configured))
    live = [config.num_replicas - k for k in key]

    def bound(p: tuple[int, ...]) -> tuple[float, float]:
        """Largest, then total, busy time per live worker: the cheap model that orders the neighbours."""
        works = [stage_work(config, costs, s, n, live[s]) for s, n in enumerate(p)]
        return max(works), sum(works)

    improved = True
    while improved and len(periods) < max_evaluations:
        improved = False
        for p in sorted(_neighbours(best), key=bound):
            if len(periods) >= max_evaluations:
                break
            if p not in periods and period(p) < periods[best]:
                best, improved = p, True
                break
    base = partition_period(config, key, configured, options, solver, costs, time_limit_s)
    final = partition_period(config, key, best, options, solver, costs, time_limit_s) if best != configured else base
    if final >= base:
        best, final = configured, base
    return PartitionChoice(key, best, final, configured, base, balanced, ideal_period(config, key), len(periods))


def migration_bytes(costs: LayerCosts, old: Sequence[int], new: Sequence[int],
                    live: Sequence[int]) -> tuple[float, float]:
    """(largest bytes one worker receives, largest bytes one worker sends) to change partition `old` -> `new`
    with `live[s]` live workers per stage. Every live worker of the new owner stage receives each layer it gains;
    the live workers of the old owner share the sending, each serving ceil(receivers / senders) of them."""
    S = len(old)
    layer = costs.moved_bytes_per_layer()
    start_new = [sum(new[:s]) for s in range(S)]
    owner_old = [s for s in range(S) for _ in range(old[s])]
    received = [0.0] * S
    sent = [0.0] * S
    for s in range(S):
        for layer_index in range(start_new[s], start_new[s] + new[s]):
            a = owner_old[layer_index]
            if a == s:
                continue
            received[s] += layer
            sent[a] += layer * math.ceil(live[s] / max(1, live[a]))
    return max(received), max(sent)


def make_repartitioned_plan(config: Config, failed: Iterable[tuple[int, int]] = (),
                            options: PlannerOptions = PlannerOptions(), solver: str = "heuristic",
                            routing: str = "traffic", max_evaluations: int = 24,
                            time_limit_s: float = 10.0) -> tuple[Plan, PartitionChoice]:
    """`make_plan` with the layer partition chosen for the failure state: the plan (real ranks) records it."""
    state = normalize(failed, config.num_replicas, config.num_stages)
    choice = best_partition(config, state.key, options, solver, max_evaluations, time_limit_s)
    plan = plan_with_partition(config, state.failed, choice.partition, options, solver, routing, time_limit_s,
                               f"configured {list(choice.configured)}, period {choice.configured_period:g} with "
                               "re-routing alone")
    return plan, choice


def plan_with_partition(config: Config, failed: Iterable[tuple[int, int]], partition: Sequence[int],
                        options: PlannerOptions = PlannerOptions(), solver: str = "heuristic",
                        routing: str = "traffic", time_limit_s: float = 10.0, note: str = "") -> Plan:
    """`make_plan` for the failure set with the layers laid out as `partition` (a PlanError when it does not fit
    in memory): the plan (real ranks) records the partition."""
    costs = layer_costs(config)
    caps = partition_caps(config, partition, costs, options.memory_cap)
    derived = partition_config(config, partition, costs)
    plan = make_plan(derived, failed, replace(options, memory_cap=caps), solver, time_limit_s, routing)
    notes = f"{plan.meta.notes}; layers per stage {list(partition)}" + (f" ({note})" if note else "")
    return replace(plan, partition=tuple(partition)).with_meta(config_fingerprint=config.fingerprint(), notes=notes)
