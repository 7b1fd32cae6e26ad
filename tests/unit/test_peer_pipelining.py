"""Our fault-free per-rank compute orders equal the ones torch.distributed.pipelining's own schedules produce.

No processes are started. Two ways of reading torch's orders:

* Schedule1F1B and ScheduleGPipe are `PipelineScheduleSingle`s: what runs is `_step_microbatches`, not the
  `pipeline_order` table (that table is only for display). We run `_step_microbatches` against a recording stage
  whose p2p op lists are empty, so every forward/backward call is logged in execution order.
* ScheduleInterleavedZeroBubble (ZB1P = ZB-H1 with one stage per rank) is a `_PipelineScheduleRuntime`: it executes
  exactly its `pipeline_order` (after lowering in comms), so we construct it with fake stages and read that table.

Mapping: torch F -> F, I (BACKWARD_INPUT) -> B, W (BACKWARD_WEIGHT) -> W, B (FULL_BACKWARD) -> BW; torch's
REDUCE_GRAD slot is our OPT. One pipeline, so torch's micro-batch index is our local index.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pipelining = pytest.importorskip("torch.distributed.pipelining.schedules")

from recycle.config import uniform_config  # noqa: E402
from recycle.schedules.fault_free import build_schedule  # noqa: E402

_KIND = {"F": "F", "I": "B", "W": "W", "B": "BW"}


class _RecordingStage:
    """Just enough of `_PipelineStageBase` for a single-stage schedule's `_step_microbatches`: logs compute calls."""

    def __init__(self, stage: int, num_stages: int) -> None:
        self.stage_index = stage
        self.num_stages = num_stages
        self.group_size = num_stages
        self.group_rank = stage
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.submod = None
        self.calls: list[str] = []

    def get_fwd_recv_ops(self, mb: int) -> list:
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb: int, *args, **kwargs) -> None:
        self.calls.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb: int, loss=None, full_backward: bool = True, last_backward: bool = False) -> None:
        self.calls.append(f"{self.stage_index}{'BW' if full_backward else 'B'}{mb}")

    def perform_reduce_grad(self, scale: int) -> None:
        self.calls.append(f"{self.stage_index}OPT")


def _executed_order(schedule_cls, stage: int, num_stages: int, num_microbatches: int) -> list[str]:
    fake = _RecordingStage(stage, num_stages)
    schedule = schedule_cls(fake, num_microbatches)
    schedule._initialize_stage = lambda *args, **kwargs: None  # no real tensors: skip shape inference
    schedule._step_microbatches()
    return fake.calls


def _ours(schedule: str, num_stages: int, num_microbatches: int) -> dict[int, list[str]]:
    plan = build_schedule(uniform_config(1, num_stages, num_microbatches), schedule)
    return {stage: [str(a) for a in plan.actions[stage]] for stage in range(num_stages)}


def _torch_token(action) -> str:
    """A torch `_Action` in our token form: "2I5" -> "2B5", "2B5" -> "2BW5", "2REDUCE_GRAD" -> "2OPT"."""
    kind = action.computation_type.value
    if kind == "REDUCE_GRAD":
        return f"{action.stage_index}OPT"
    return f"{action.stage_index}{_KIND[kind]}{action.microbatch_index}"


SIZES = [(2, 2), (2, 5), (3, 3), (3, 7), (4, 4), (4, 6), (4, 8), (5, 10), (8, 8), (8, 16)]


@pytest.mark.parametrize("num_stages,num_microbatches", SIZES)
def test_1f1b_equals_torch_schedule_1f1b_execution(num_stages: int, num_microbatches: int) -> None:
    ours = _ours("1f1b", num_stages, num_microbatches)
    for stage in range(num_stages):
        theirs = _executed_order(pipelining.Schedule1F1B, stage, num_stages, num_microbatches)
        assert ours[stage] == theirs, f"stage {stage}"


@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 3), (4, 6), (8, 16)])
def test_gpipe_equals_torch_schedule_gpipe_execution(num_stages: int, num_microbatches: int) -> None:
    ours = _ours("gpipe", num_stages, num_microbatches)
    for stage in range(num_stages):
        theirs = _executed_order(pipelining.ScheduleGPipe, stage, num_stages, num_microbatches)
        assert ours[stage] == theirs, f"stage {stage}"


@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 4), (4, 6), (4, 8), (8, 16)])
def test_1f1b_display_table_differs_only_in_last_rank_microbatch_ids(num_stages: int, num_microbatches: int) -> None:
    """Schedule1F1B.pipeline_order (display only) numbers the last rank's forwards 1..M instead of 0..M-1.

    Cause, torch 2.13 `Schedule1F1B._get_pipeline_order`: with zero warm-up forwards the loop never sets
    `forward_mb`, which stays 0, and the steady phase pre-increments it (`forward_mb += 1`) before the first
    forward. Every other rank ends its warm-up with forward_mb = warm-up count - 1, so the pre-increment is
    right there. Execution (`_step_microbatches`, checked above) is correct; so is everything but those ids.
    """
    fake = _RecordingStage(0, num_stages)
    table = pipelining.Schedule1F1B(fake, num_microbatches).pipeline_order
    ours = _ours("1f1b", num_stages, num_microbatches)
    last = num_stages - 1
    for rank, actions in table.items():
        theirs = [_torch_token(a) for a in actions if a is not None]
        if rank != last:
            assert theirs == ours[rank], f"rank {rank}"
            continue
        shifted = [t if "F" not in t else f"{last}F{int(t.split('F')[1]) - 1}" for t in theirs]
        assert theirs != ours[rank]
        assert shifted == ours[rank]


@pytest.mark.parametrize("num_stages,num_microbatches", [(2, 2), (2, 4), (3, 6), (4, 4), (4, 6), (4, 8), (6, 12),
                                                         (8, 8), (8, 16)])
def test_zb_h1_equals_torch_interleaved_zero_bubble_one_stage_per_rank(num_stages: int,
                                                                       num_microbatches: int) -> None:
    fakes = [SimpleNamespace(num_stages=num_stages, group_size=num_stages, group_rank=0, stage_index=0,
                             submod=None)]
    schedule = pipelining.ScheduleInterleavedZeroBubble(fakes, num_microbatches)
    ours = _ours("zb-h1", num_stages, num_microbatches)
    for rank, actions in schedule.pipeline_order.items():
        theirs = [_torch_token(a) for a in actions if a is not None]
        assert theirs == ours[rank][:-1], f"rank {rank}"  # torch adds REDUCE_GRAD only when lowering comms
        lowered = [_torch_token(a) for a in schedule.pipeline_order_with_comms[rank]
                   if a.computation_type.value in ("F", "I", "W", "B", "REDUCE_GRAD")]
        assert lowered == ours[rank], f"rank {rank} (lowered with comms)"


def test_zb_h1_holds_the_same_per_stage_memory_as_torch() -> None:
    """torch's ZB1P defers `rank` W's on rank `rank` (num_1f1b_microbatches = rank): every stage holds S in flight."""
    from recycle.sim.simulator import simulate

    config = uniform_config(1, 4, 8)
    result = simulate(build_schedule(config, "zb-h1"), config, iterations=1)
    assert result.peak_activations == (4, 4, 4, 4)
