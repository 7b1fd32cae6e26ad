"""`recycle plan --format pipelining-csv`: fault-free schedules load in torch.distributed.pipelining's own runtime
(validated and lowered with its communication actions) in our action order; re-routed pipelines are refused."""

from __future__ import annotations

from pathlib import Path

import pytest

import recycle
from recycle.cli import main
from recycle.errors import PlanError
from recycle.ir.pipelining import pipelining_order, to_pipelining_csv

ROOT = Path(__file__).resolve().parents[2]


def load_in_torch(path: Path, num_stages: int, num_microbatches: int):
    """torch's `_PipelineScheduleRuntime._load_csv` without building stages: the same validation and lowering."""
    from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime

    schedule = object.__new__(_PipelineScheduleRuntime)
    schedule.pp_group_size, schedule._num_stages, schedule._n_microbatches = num_stages, num_stages, num_microbatches
    schedule._stages, schedule.pipeline_order, schedule._defer_pp_recv = [], {}, False
    schedule._load_csv(str(path))
    return schedule


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "planner"])
@pytest.mark.parametrize("replica", [0, 2])
def test_fault_free_schedules_load_in_torch_in_the_same_order(tmp_path: Path, schedule: str, replica: int) -> None:
    config = recycle.load_config(ROOT / "configs" / "toy.toml")
    plan = recycle.plan(config) if schedule == "planner" else recycle.fault_free_plan(config, schedule)
    path = tmp_path / "schedule.csv"
    path.write_text(to_pipelining_csv(plan, replica))
    loaded = load_in_torch(path, config.num_stages, config.num_microbatches)
    expected = pipelining_order(plan, replica)
    assert [[str(a) for a in loaded.pipeline_order[r] if a is not None] for r in range(config.num_stages)] == expected
    for stage, row in enumerate(expected):
        ours = [a for a in plan.worker_actions(replica, stage) if a.kind.value != "OPT"]
        assert len(row) == len(ours)
        if schedule != "planner":  # (the planner may fuse some backwards: BW is pipelining's B)
            assert len(row) == (2 if schedule in ("gpipe", "1f1b") else 3) * config.num_microbatches
    assert all(loaded.pipeline_order_with_comms[r] for r in range(config.num_stages))  # lowered with comms


def test_re_routed_pipelines_cannot_be_expressed() -> None:
    config = recycle.load_config(ROOT / "configs" / "toy.toml")
    plan = recycle.plan(config, ["1:2"])
    with pytest.raises(PlanError, match="cross-pipeline re-routing"):
        pipelining_order(plan, 0)  # 0:2 takes pipeline 1's micro-batches
    with pytest.raises(PlanError, match="worker 1:2 is down"):
        pipelining_order(plan, 1)


@pytest.mark.parametrize("argv,needle", [
    (["--format", "pipelining-csv"], "add --save FILE.csv"),
    (["--format", "pipelining-csv", "--replica", "7", "--save", "{tmp}/x.csv"], "replica 7 is outside"),
    (["--fail", "1:2", "--format", "pipelining-csv", "--save", "{tmp}/x.csv"], "cross-pipeline re-routing"),
])
def test_cli_errors(tmp_path: Path, capsys, argv: list[str], needle: str) -> None:
    argv = [a.format(tmp=tmp_path) for a in argv]
    assert main(["plan", "--config", str(ROOT / "configs" / "toy.toml"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and needle in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_cli_writes_the_csv(tmp_path: Path, capsys) -> None:
    path = tmp_path / "p.csv"
    assert main(["plan", "--config", str(ROOT / "configs" / "toy.toml"), "--format", "pipelining-csv", "--save",
                 str(path)]) == 0
    assert path.read_text().splitlines()[0].startswith("0F0,")
