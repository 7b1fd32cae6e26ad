"""Layer re-partitioning: per-layer costs from the config, the per-stage config of a partition, the best partition
for a failure state (balanced work per live worker, under the memory caps) and its plan."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

from recycle.config import Config, parse_config
from recycle.errors import ConfigError, PlanError
from recycle.ir.plan import Plan
from recycle.planner.api import make_plan, plan_for_key
from recycle.planner.bounds import period_lower_bound, split_unit
from recycle.planner.budget import LIST_SCHEDULE_COST, WorkBudget
from recycle.planner.failures import normalize
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import check_key

__all__ = ["LayerCosts", "configured_partition", "layer_costs", "partition_config", "partition_caps",
           "worker_memory_bytes", "balanced_partition", "PartitionChoice", "best_partition", "partition_period",
           "ideal_period", "PartitionBound", "partition_bound", "migration_bytes", "make_repartitioned_plan",
           "plan_with_partition", "PeriodSource", "planned_period", "PARTITION_SEARCH_WORK", "BOUND_WORK"]

# The planner's period for (config, key, options, solver, time limit): `planned_period`, or a cache in front of it
# (recycle.traces.plan_cache), so a replay plans each (failure key, partition) once.
PeriodSource = Callable[[Config, tuple[int, ...], PlannerOptions, str, float], float]

# Work budget of one `best_partition` search, in units of one walk node (a floor and memory check, ~10 us): a
# partition's lower bound (its config built and parsed) costs BOUND_WORK units, a screened plan LIST_SCHEDULE_COST
# per action of one iteration. Sized so that the whole space of a 32-layer, 4-stage model (about 5,000 nodes and
# 4,500 bounds) and the 8 screened plans of a D=20 job fit: replays at those sizes choose exactly as an unbounded
# search would; larger searches stop at the same point on every machine and load (never a clock).
PARTITION_SEARCH_WORK = 400_000
BOUND_WORK = 25

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
        memory = raw["memory"]
        rebuilt = memory.get("recompute_bytes", [0] * len(partition))  # to_dict leaves it out while all 0
        needed = max(a + r for a, r in zip(memory["activation_bytes"], rebuilt))
        memory["capacity_bytes"] = max(memory["capacity_bytes"], needed)
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


def worker_memory_bytes(config: Config, costs: LayerCosts | None = None) -> float:
    """Memory of one worker for activations and state: every worker is the same device, and the configured
    activation budget (`capacity_bytes`, one value for all stages) must fit beside the largest configured stage's
    weights, gradients and optimizer state, so each device holds at least capacity + that state. (GPT-3 6.7B:
    46.8 GB + stage 0's 29.2 GB = 76.0 GB, the config's 80 GB A100 less 4 GB of context; a stage-1 worker holds
    25.8 GB of state, so 3.4 GB of its device was never in the activation budget.) inf when unlimited."""
    if config.memory.capacity_bytes <= 0:
        return math.inf
    costs = costs or layer_costs(config)
    return config.memory.capacity_bytes + max(costs.state_bytes(s, n) for s, n in enumerate(costs.layers))


def partition_caps(config: Config, partition: Sequence[int], costs: LayerCosts | None = None,
                   spec: tuple[int, ...] | None = None) -> tuple[int, ...] | None:
    """Activation cap per stage under `partition`: an explicit cap (`spec`) as given; else what is left of the
    worker's memory (`worker_memory_bytes`) once its stage's state under `partition` is placed, over the new
    activation bytes per micro-batch; a stage that keeps its layers keeps its configured budget (the caps ReCycle's
    own plans use). None when the config's memory is unlimited. A stage whose cap falls below 1 cannot hold its
    layers: PlanError."""
    if spec is not None:
        return tuple(spec)
    if config.memory.capacity_bytes <= 0:
        return None
    costs = costs or layer_costs(config)
    partition = _check_partition(costs, partition)
    memory = worker_memory_bytes(config, costs)
    caps = []
    for s, n in enumerate(partition):
        room = _room(config, costs, memory, s, n) - config.memory.recompute_bytes[s]
        cap = int(room // max(1.0, costs.value("activation_bytes", s, n)))
        if cap < 1:
            raise PlanError(f"layer partition {list(partition)}: stage {s} with {n} layers leaves room for {cap} "
                            "micro-batches of activations; give it fewer layers")
        caps.append(cap)
    return tuple(caps)


def _room(config: Config, costs: LayerCosts, memory: float, stage: int, n: int) -> float:
    """Activation bytes a worker of `stage` holding `n` layers may use (the configured budget when n is its
    configured count: a config that fits keeps its own caps)."""
    if n == costs.layers[stage]:
        return float(config.memory.capacity_bytes)
    return memory - costs.state_bytes(stage, n)


def _fits(config: Config, costs: LayerCosts, stage: int, n: int) -> bool:
    if config.memory.capacity_bytes <= 0:
        return True
    room = _room(config, costs, worker_memory_bytes(config, costs), stage, n) - config.memory.recompute_bytes[stage]
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


def planned_period(config: Config, key: tuple[int, ...], options: PlannerOptions, solver: str,
                   time_limit_s: float) -> float:
    """The simulated period of `plan_for_key` (the default PeriodSource)."""
    plan = plan_for_key(config, key, options, solver, time_limit_s)
    assert plan.meta.predicted_period is not None
    return float(plan.meta.predicted_period)


def partition_period(config: Config, key: Sequence[int], partition: Sequence[int],
                     options: PlannerOptions = PlannerOptions(), solver: str = "heuristic",
                     costs: LayerCosts | None = None, time_limit_s: float = 10.0,
                     source: PeriodSource | None = None) -> float:
    """The simulated period of the planner's plan for `key` with the layers laid out as `partition` (cached by
    the planner per derived config, or by `source`); inf when the partition does not fit in memory."""
    costs = costs or layer_costs(config)
    try:
        caps = partition_caps(config, partition, costs, options.memory_cap)
    except PlanError:
        return math.inf
    derived = partition_config(config, partition, costs)
    return (source or planned_period)(derived, tuple(key), replace(options, memory_cap=caps), solver, time_limit_s)


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
    evaluated: int  # partitions planned (0: no search, the configured layout was already at the floor)
    complete: bool = True  # False when the search's work budget ran out (the choice is then the best found)

    @property
    def changed(self) -> bool:
        return self.partition != self.configured

    def to_dict(self) -> dict:
        return {"key": list(self.key), "partition": list(self.partition), "period": self.period,
                "configured": list(self.configured), "configured_period": self.configured_period,
                "balanced": list(self.balanced), "ideal_period": self.ideal_period, "evaluated": self.evaluated,
                "complete": self.complete}


def _floor(config: Config, costs: LayerCosts, stage: int, n: int, live: int, decoupled: bool,
           unit: int = 1) -> float:
    """A value no larger than `period_lower_bound` of any partition giving `stage` n layers: its busiest live
    worker's forwards and backwards (ceil(D*M/live) whole micro-batches; ceil(D*M*unit/live)/unit with micro-batches
    split into `unit` pieces) plus its step and all-reduce (the bound's `steady_state` term, a hair lower for the
    byte rounding of `partition_config`). Grows with n."""
    D, M = config.num_replicas, config.num_microbatches
    q = math.ceil(D * M * unit / live) / unit
    fused = costs.value("backward_fused", stage, n)
    back = min(costs.value("backward_input", stage, n) + costs.value("backward_weight", stage, n), fused) \
        if decoupled else fused
    comm = config.communication
    allreduce = 0.0
    if live > 1:
        steps = 2 * (live - 1)
        transfer = steps / live * costs.value("gradient_bytes", stage, n) / comm.allreduce_bandwidth \
            if comm.allreduce_bandwidth > 0 else 0.0
        allreduce = steps * comm.allreduce_latency + transfer
    value = q * (costs.value("forward", stage, n) + back) + costs.value("optimizer", stage, n) + allreduce
    return value * (1 - 1e-9) - 1.0


def _bound(config: Config, key: tuple[int, ...], partition: tuple[int, ...], options: PlannerOptions,
           costs: LayerCosts) -> float:
    return period_lower_bound(partition_config(config, partition, costs), key, options)


def _below(config: Config, key: tuple[int, ...], ceiling: float, options: PlannerOptions, costs: LayerCosts,
           near: tuple[int, ...], budget: WorkBudget, bound_work: int = 0
           ) -> tuple[list[tuple[float, tuple[int, ...]]], bool]:
    """Every partition that fits in memory and whose lower bound is below `ceiling`, with its bound, by a depth-first
    walk over the layer counts stage by stage (counts nearest `near` first), pruned by `_floor`. Each node costs one
    unit of `budget`, each lower bound `bound_work` more. Returns (found, complete): complete is False when the
    budget ran out (found is then a subset)."""
    S = len(costs.layers)
    total = sum(costs.layers)
    live = [config.num_replicas - k for k in key]
    found: list[tuple[float, tuple[int, ...]]] = []
    # A node's floor and memory check depend on its stage and layer count alone: tabled once per walk (the walk
    # visits tens of thousands of nodes over S * layers (stage, count) pairs; the same values, computed once).
    unit = split_unit(config, options)
    pruned = [[True] + [_floor(config, costs, s, n, live[s], options.decoupled, unit) >= ceiling or
                        not _fits(config, costs, s, n) for n in range(1, total - S + 2)] for s in range(S)]
    order = [sorted(range(1, total - S + 2), key=lambda n: (abs(n - near[s]), n)) for s in range(S)]

    def walk(prefix: list[int], left: int) -> bool:
        s = len(prefix)
        if s == S - 1:
            options_n = [left]
        else:
            top = left - (S - 1 - s)  # every later stage keeps at least one layer
            options_n = [n for n in order[s] if n <= top]
        for n in options_n:
            if not budget.afford(1):
                return False
            if pruned[s][n]:
                continue  # larger n only raise the floor, but memory may still fail for a smaller one: go on
            if s == S - 1:
                if not budget.afford(bound_work):
                    return False
                partition = tuple(prefix + [n])
                value = _bound(config, key, partition, options, costs)
                if value < ceiling:
                    found.append((value, partition))
            elif not walk(prefix + [n], left - n):
                return False
        return True

    complete = walk([], total)
    found.sort()
    return found, complete


@dataclass(frozen=True)
class PartitionBound:
    """The smallest lower bound on the period of any plan for `key` over every layer partition that fits in memory
    (whole layers, whole micro-batches: `period_lower_bound` of each partition's config; with
    options.split_microbatches, micro-batches cut into pieces down to one sample): no re-partitioned plan of this
    cost model beats it. `exact` is False when the search stopped at its node limit."""

    key: tuple[int, ...]
    partition: tuple[int, ...]
    bound: float
    exact: bool


def partition_bound(config: Config, key: Sequence[int], options: PlannerOptions = PlannerOptions(),
                    limit: int = 200_000) -> PartitionBound:
    """The best achievable period for `key` with whole layers and whole micro-batches, or pieces of micro-batches
    with options.split_microbatches (see PartitionBound)."""
    key = check_key(config, key)
    costs = layer_costs(config)
    start = balanced_partition(config, key, costs)
    best = min(_bound(config, key, p, options, costs) for p in {start, costs.layers}
               if all(_fits(config, costs, s, n) for s, n in enumerate(p)))
    found, complete = _below(config, key, best * (1 + 1e-12) + 1e-9, options, costs, start, WorkBudget(limit))
    value, partition = found[0] if found else (best, start)
    return PartitionBound(key, partition, value, complete)


def best_partition(config: Config, key: Sequence[int], options: PlannerOptions = PlannerOptions(),
                   solver: str = "heuristic", max_evaluations: int = 24,
                   time_limit_s: float = 10.0, polish: int = 2, work: int = PARTITION_SEARCH_WORK,
                   source: PeriodSource | None = None, screen_rules: int | None = None) -> PartitionChoice:
    """The partition with the best planned period for `key`, by branch and bound over partitions.

    Screen: the configured and the balanced partition are planned with the priority rules only (`search=False`:
    milliseconds); then every partition whose lower bound (`period_lower_bound` of its config) is below the best
    screened period is a candidate (`_below`: all of them, the walk pruned by each stage's busiest-worker floor),
    planned in increasing order of its bound until the next bound is no better than the best screened period (no
    plan of it can win) or `max_evaluations` partitions were screened. Polish: the `polish` best screened
    re-partitions and the configured partition are planned with `options` and `solver` as given (the heuristic's
    budgeted local search, or the exact solver), and the fastest wins; a re-partition is kept only when
    strictly faster than the configured layout (moving layers is never free).

    The walk and the screen share one deterministic budget of `work` units (PARTITION_SEARCH_WORK): when it runs
    out the search goes on with what it found and the choice says `complete=False`. `source` supplies planned
    periods (default: `planned_period`; a replay passes its plan cache). `screen_rules` N: every screen (the
    configured and balanced partitions' too) list-schedules only the first N priority rules (PlannerOptions.rules):
    cheaper screens whose periods may sit above the full rules', so the partition polished may differ (a change of
    plan; None, the default: every rule, the exact screen)."""
    key = check_key(config, key)
    costs = layer_costs(config)
    configured = costs.layers
    screen = replace(options, search=False, rules=screen_rules)
    periods: dict[tuple[int, ...], float] = {}
    budget = WorkBudget(work)
    screen_work = LIST_SCHEDULE_COST * (3 if options.decoupled else 2) * config.num_replicas * \
        config.num_microbatches * config.num_stages

    def period(p: tuple[int, ...]) -> float:
        if p not in periods:
            periods[p] = partition_period(config, key, p, screen, "heuristic", costs, source=source)
        return periods[p]

    balanced = balanced_partition(config, key, costs)
    ceiling = min(period(configured), period(balanced))
    complete = True
    if any(key):
        found, complete = _below(config, key, ceiling, screen, costs, balanced, budget, BOUND_WORK)
        for value, p in found:
            if len(periods) >= max_evaluations or value >= min(periods.values()):
                break
            if not budget.afford(screen_work):
                complete = False
                break
            period(p)
    ranked = sorted(periods, key=lambda p: (periods[p], p != configured))
    base = partition_period(config, key, configured, options, solver, costs, time_limit_s, source)
    best, final = configured, base
    for p in [p for p in ranked if p != configured][:polish]:
        if not math.isinf(periods[p]):
            value = partition_period(config, key, p, options, solver, costs, time_limit_s, source)
            if value < final:
                best, final = p, value
    return PartitionChoice(key, best, final, configured, base, balanced, ideal_period(config, key), len(periods),
                           complete)


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
