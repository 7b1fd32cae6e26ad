"""`recycle train` runs a chunked V plan on the canonical routing of a non-nested failure set (healthy micro-batches
moved through another pipeline's worker, which the chunked planner now takes where it is faster) and ends with the
single-process reference's parameters."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from recycle.planner import chunked
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import traffic
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import ClusterOptions, DebugOptions, LaunchOptions, OutputOptions, RecoveryOptions
from recycle.runtime.tools.reference import reference_train

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_a_canonical_routed_chunked_plan_matches_the_reference(tiny_config, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    base = tiny_config(D=3, S=2, M=2, seed=11)
    config = replace(base, topology=replace(base.topology, chunks_per_worker=2, chunk_layout="v"))
    failed = frozenset({(0, 0), (1, 1)})  # not nested
    canonical = chunked.canonical_chunked_routing(config, failed)
    # Plan on the canonical routing alone (whether it is faster on this tiny job does not matter here: the runtime
    # must run it exactly).
    monkeypatch.setattr(chunked, "chunked_routing", lambda config, failed, **_: canonical)
    plan = chunked.schedule_chunked(config, failed, PlannerOptions())
    assert plan.host == canonical
    assert traffic(plan.host, 2, failed, stage_of=plan.chunk_stages)["moved_healthy"] > 0
    save = tmp_path / "final.pt"
    result = launch(config, plan, LaunchOptions(outputs=OutputOptions(save_path=str(save)),
                                                debug=DebugOptions(verify_replicas=True),
                                                recovery=RecoveryOptions(timeout_s=30),
                                                cluster=ClusterOptions(start_method="forkserver"), progress=None))
    ref, ref_losses = reference_train(config)
    got = torch.load(save, weights_only=True)["model"]
    assert got.keys() == ref.keys()
    assert max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) for k in ref) < 1e-9
    assert [round(s.loss, 9) for s in result.steps] == [round(x, 9) for x in ref_losses]
