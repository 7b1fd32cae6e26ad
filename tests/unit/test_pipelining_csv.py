"""`recycle plan --format pipelining-csv`: a fault-free plan exported as torch.distributed.pipelining's compute-only
CSV loads in torch's `_PipelineScheduleRuntime` (validated and lowered with its send/recv ops) with the same action
order; what the format cannot express (cross-pipeline re-routing) is refused, clearly."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

import recycle
from recycle.cli import main
from recycle.errors import PlanError
from recycle.ir.actions import Kind
from recycle.ir.pipelining import PIPELINING_KIND, pipelining_csv

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "toy.toml")


class _StageStandIn:
    """What the schedule's constructor and CSV loader read from a pipeline stage (torch's own schedule tests use a
    mock stage the same way): loading a CSV needs no process group and no model."""

    def __init__(self, num_stages: int, rank: int) -> None:
        self.num_stages, self.group_size, self.group_rank = num_stages, num_stages, rank
        self.stage_index, self.is_first, self.is_last = rank, rank == 0, rank == num_stages - 1
        self.stage_index_to_group_rank: dict[int, int] = {}


def _load_in_torch(path: Path, num_stages: int, num_microbatches: int) -> _PipelineScheduleRuntime:
    runtime = _PipelineScheduleRuntime([_StageStandIn(num_stages, 0)], num_microbatches)
    runtime._load_csv(str(path))
    return runtime


def _expected(plan, replica: int) -> dict[int, list[str]]:
    base = replica * plan.num_microbatches
    return {s: [f"{a.stage}{PIPELINING_KIND[a.kind]}{a.mb - base}" for a in plan.worker_actions(replica, s)
                if a.kind is not Kind.OPT] for s in range(plan.num_stages)}


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "gpipe"])
def test_a_fault_free_schedule_loads_in_torchs_runtime_with_the_same_action_order(tmp_path, name: str) -> None:
    config = recycle.load_config(TOY)
    plan = recycle.schedule(config, name, staggered=name == "zb-h1")
    for replica in (0, 2):
        path = tmp_path / f"{name}-{replica}.csv"
        path.write_text(pipelining_csv(plan, replica))
        runtime = _load_in_torch(path, config.num_stages, config.num_microbatches)
        assert {r: [str(a) for a in acts] for r, acts in runtime.pipeline_order.items()} == _expected(plan, replica)
        assert runtime.stage_index_to_group_rank == {s: s for s in range(config.num_stages)}
        sends = [str(a) for a in runtime.pipeline_order_with_comms[0] if "SEND_F" in str(a)]
        assert len(sends) == config.num_microbatches  # torch lowered it: stage 0 sends every micro-batch forward
    kinds = {cell[1] for row in pipelining_csv(plan).split() for cell in row.split(",")}
    assert kinds == ({"F", "I", "W"} if name == "zb-h1" else {"F", "B"})


def test_the_cli_writes_the_planners_fault_free_plan_and_torch_loads_it(tmp_path, capsys) -> None:
    path = tmp_path / "plan.csv"
    assert main(["plan", "--config", TOY, "--save", str(path), "--format", "pipelining-csv", "--json"]) == 0
    assert "the optimizer step (OPT) is left out" in capsys.readouterr().err
    runtime = _load_in_torch(path, 4, 6)
    assert [",".join(str(a) for a in runtime.pipeline_order[r]) for r in range(4)] == path.read_text().split()


def test_cross_pipeline_rerouting_is_refused_naming_what_moves(tmp_path, capsys) -> None:
    config = recycle.load_config(TOY)
    plan = recycle.plan(config, ["1:2"])
    with pytest.raises(PlanError, match=r"cannot express replica 0's part of this plan: micro-batch \d+ of replica 1 "
                                        r"runs stage 2 on replica 0 \(cross-pipeline re-routing\)"):
        pipelining_csv(plan, 0)
    with pytest.raises(PlanError, match=r"worker\(s\) 1:2 of replica 1 are down"):
        pipelining_csv(plan, 1)
    path = tmp_path / "x.csv"
    assert main(["plan", "--config", TOY, "--fail", "1:2", "--save", str(path), "--format", "pipelining-csv",
                 "--replica", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cross-pipeline re-routing" in err[0] and not path.exists()
    assert main(["plan", "--config", TOY, "--format", "pipelining-csv"]) == 2
    assert "add --save FILE" in capsys.readouterr().err
