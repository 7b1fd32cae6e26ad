"""The activation cap per stage (live micro-batches per worker): from a user spec, the options, or the config."""

from __future__ import annotations

from recycle.config import Config
from recycle.errors import ConfigError, PlanError
from recycle.planner.options import PlannerOptions

__all__ = ["budget_memory_cap", "memory_cap", "resolve_memory_cap"]


def budget_memory_cap(config: Config) -> tuple[int, ...] | None:
    """Live micro-batches per worker that fit the config's activation budget, per stage (None: unlimited): what is
    left after the one region a checkpointed stage rebuilds inside a backward (recompute_bytes), over what each live
    micro-batch keeps (activation_bytes)."""
    memory = config.memory
    capacity = memory.capacity_bytes
    if capacity <= 0:
        return None
    return tuple(max(1, (capacity - rebuilt) // max(1, kept))
                 for kept, rebuilt in zip(memory.activation_bytes, memory.recompute_bytes))


def memory_cap(config: Config, options: PlannerOptions) -> tuple[int, ...] | None:
    """The hard cap per stage that plans must respect: the options' cap, else the config's budget, else none."""
    cap = options.memory_cap if options.memory_cap is not None else budget_memory_cap(config)
    if cap is None:
        return None
    S = config.num_stages
    cap = tuple(int(c) for c in cap)
    if len(cap) != S or any(c < 1 for c in cap):
        raise ConfigError(f"memory cap {list(cap)} must list one integer >= 1 per stage ({S} stages), e.g. the "
                          f"1F1B cap {[S - s for s in range(S)]}; every worker must hold at least one micro-batch")
    return cap


def resolve_memory_cap(config: Config, spec: str | int | None) -> tuple[int, ...] | None:
    """Activation cap per stage from a user spec.

    None or "none": the config's budget (capacity_bytes // activation_bytes[s], or None when unlimited); an integer
    N (or its text): N live micro-batches on every worker; "1f1b": each stage's fault-free 1F1B peak min(S - s, M).
    """
    S, M = config.num_stages, config.num_microbatches
    if spec is None or (isinstance(spec, str) and spec.strip().lower() == "none"):
        return budget_memory_cap(config)
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "1f1b":
            return tuple(min(S - s, M) for s in range(S))
        try:
            spec = int(text)
        except ValueError:
            raise PlanError(f"memory cap {spec!r} is not understood; give a whole number of live micro-batches per "
                            "worker (e.g. 4), '1f1b' (the fault-free 1F1B peak per stage) or 'none' (the config's "
                            "memory budget)") from None
    if isinstance(spec, bool) or not isinstance(spec, int) or spec < 1:
        raise PlanError(f"memory cap {spec!r} must be at least 1 live micro-batch per worker (a worker must hold "
                        "the micro-batch it works on); pass e.g. --memory-cap 4, 1f1b or none")
    return (spec,) * S
