"""torch.distributed.pipelining's multi-chunk schedules (ZBV, DualPipeV, interleaved 1F1B and zero bubble) read
without processes from their `pipeline_order` tables and turned into our plans, so one simulator times both."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from recycle.config import Config
from recycle.errors import ConfigError
from recycle.ir.actions import Action, Kind
from recycle.ir.plan import Plan, PlanMeta
from recycle.ir.validate import validate_plan

__all__ = ["TORCH_CHUNK_SCHEDULES", "torch_chunk_plan", "torch_pipeline_order"]

# name -> (torch class name, chunk layout it places stages by)
TORCH_CHUNK_SCHEDULES = {
    "zbv": ("ScheduleZBVZeroBubble", "v"),
    "dualpipev": ("ScheduleDualPipeV", "v"),
    "interleaved-zb": ("ScheduleInterleavedZeroBubble", "interleaved"),
    "interleaved-1f1b": ("ScheduleInterleaved1F1B", "interleaved"),
}
# torch's computation types -> ours: I = backward-input, B = full backward (our fused BW)
_KIND = {"F": Kind.F, "I": Kind.B, "W": Kind.W, "B": Kind.BW}


def torch_pipeline_order(name: str, num_stages: int, num_microbatches: int) -> dict[int, list[Any]]:
    """rank -> torch's compute actions in order (OVERLAP_F_B split into its forward, then its backward), for two
    stages per rank; torch places stage v on rank v mod S (interleaved) or on ranks v and 2S-1-v (V shape)."""
    import torch.distributed.pipelining.schedules as schedules

    cls_name, layout = TORCH_CHUNK_SCHEDULES[name]
    S = num_stages
    mine = (0, 2 * S - 1) if layout == "v" else (0, S)
    stages = [SimpleNamespace(num_stages=2 * S, group_size=S, group_rank=0, stage_index=i, submod=None,
                              is_first=i == 0, is_last=i == 2 * S - 1) for i in mine]
    schedule = getattr(schedules, cls_name)(stages, num_microbatches)
    out: dict[int, list[Any]] = {}
    for rank, actions in schedule.pipeline_order.items():
        flat: list[Any] = []
        for a in actions:
            if a is None:
                continue
            subs = getattr(a, "sub_actions", None)
            flat.extend(subs if subs else [a])
        out[rank] = flat
    return out


def torch_chunk_plan(config: Config, name: str) -> Plan:
    """Torch's schedule `name` for the config's S and M (one pipeline, two chunks per worker) as our validated plan,
    with a coupled optimizer (torch steps after the whole schedule) and OPT appended to every worker."""
    if name not in TORCH_CHUNK_SCHEDULES:
        raise ConfigError(f"torch schedule {name!r} is unknown; choose one of {sorted(TORCH_CHUNK_SCHEDULES)}")
    t = config.topology
    layout = TORCH_CHUNK_SCHEDULES[name][1]
    if t.num_replicas != 1 or t.chunks_per_worker != 2 or t.chunk_layout != layout:
        raise ConfigError(f"torch's {name} runs one pipeline with 2 chunks per worker in the {layout} layout; the "
                          f"config has D={t.num_replicas}, chunks_per_worker={t.chunks_per_worker}, chunk_layout="
                          f"{t.chunk_layout!r}")
    S, M = t.num_stages, config.num_microbatches
    order = torch_pipeline_order(name, S, M)
    actions = []
    for rank in range(S):
        acts = [Action(_KIND[a.computation_type.value], a.stage_index, a.microbatch_index) for a in order[rank]
                if a.computation_type.value in _KIND]
        actions.append(tuple(acts) + (Action(Kind.OPT, rank),))
    plan = Plan.from_worker_lists(1, S, M, actions, staggered=False,
                                  meta=PlanMeta(schedule=f"torch-{name}", decoupled=True, solver="torch",
                                                config_fingerprint=config.fingerprint()),
                                  chunks=2, chunk_layout=layout)
    return validate_plan(plan)
