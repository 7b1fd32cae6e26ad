"""Layers move between stages mid-run (issue 15 item 4): when worker 1:1 dies the plan re-partitions the 4 layers
as 3 + 1 (stage 1 has one survivor), the survivors hand layer 2 over at the iteration boundary; when 1:1 re-joins
the plan goes back to 2 + 2 and the layer returns. The parameters end equal to the single-process reference."""

from __future__ import annotations

import multiprocessing as mp
from dataclasses import replace

import pytest
import torch

from recycle.ir import PlanChoice
from recycle.planner.api import make_plan
from recycle.planner.partition import partition_config
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import (ClusterOptions, DebugOptions, FaultOptions, LaunchOptions, OutputOptions,
                                     RecoveryOptions)
from recycle.runtime.tools.faults import FaultInjection
from recycle.runtime.tools.reference import reference_train
from recycle.runtime.worker.emulate import Emulation
from recycle.schedules.fault_free import build_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(150), pytest.mark.timing]

STEPS = 10


def provider(config, base):
    def plans(failed: frozenset) -> PlanChoice:
        if not failed:
            return PlanChoice(base, "store", 0.0)
        partition = (3, 1) if (1, 1) in failed or (0, 1) in failed else (1, 3)
        plan = make_plan(partition_config(config, partition), failed)
        return PlanChoice(replace(plan, partition=partition), "re-partition planner", 0.0)
    return plans


@pytest.mark.parametrize("rejoin", [False, True], ids=["stays-repartitioned", "moves-back"])
def test_layers_move_to_the_stage_with_more_survivors_and_back(tiny_config, tmp_path, rejoin: bool) -> None:
    config = tiny_config(steps=STEPS, seed=3, name="migrate-2x2")  # the tiny preset's 4 layers: 2 + 2
    base = build_schedule(config, "zb-h1", staggered=True)
    options = LaunchOptions(
        outputs=OutputOptions(save_path=str(tmp_path / "final.pt")), recovery=RecoveryOptions(timeout_s=30),
        cluster=ClusterOptions(start_method="forkserver"),
        debug=DebugOptions(verify_replicas=True, emulation=Emulation(20.0, 1.0)),
        faults=FaultOptions(injections=((base.rank(1, 1), FaultInjection(2, 3)),),
                            rejoins=((base.rank(1, 1), 5),) if rejoin else ()),
        plan_provider=provider(config, base), progress=None)
    result = launch(config, base, options)
    got = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    ref = reference_train(config)[0]
    assert set(got) == set(ref)
    for key in ref:
        error = float((got[key] - ref[key]).abs().max() / ref[key].abs().max().clamp_min(1e-12))
        assert error < 1e-9, (key, error)
    assert result.steps[-1].step == STEPS and not mp.active_children()
    assert result.failed == (() if rejoin else ((1, 1),))
    assert [w for r in result.recoveries for w in r.joined] == (["1:1"] if rejoin else [])
    moves = [(r.partition, r.layers_moved) for r in result.recoveries]
    # Layer 2 goes from stage 1 (its survivor 0:1 sends) to both replicas of stage 0; on the re-join it comes back
    # to 0:1 (from 0:0) and 1:1 gets the whole stage from 0:1 as usual.
    assert moves == ([((3, 1), 2), ((), 1)] if rejoin else [((3, 1), 2)])
    assert all(r.migration_bytes > 0 for r in result.recoveries)
    assert "layers re-partitioned to [3, 1] per stage (2 layer move(s)" in result.recoveries[0].line()
