"""`recycle train` runs a chunked V plan on the canonical routing of a non-nested failure set (healthy micro-batches
moved through another pipeline's worker, which the chunked planner now takes where it is faster) and ends with the
single-process reference's parameters."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from test_train_chunks import runs_exactly

from recycle.planner import chunked
from recycle.planner.options import PlannerOptions
from recycle.planner.routing import traffic

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
    runs_exactly(config, plan, tmp_path)
