"""benchmarks/bench_step_records.py at a tiny size: it measures this tree (the supervisor's read of NodeSteps
records and the reporter's metrics) and prints its JSON, and refuses a size that does not split into nodes."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_step_records.py"

pytestmark = pytest.mark.timeout(60)


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_step_records", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tiny_run_measures_this_tree_and_prints_the_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert _bench().main(["--ranks", "64", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert result["ranks"] == 64 and result["total_us_per_record_after"] > 0 and "speedup" not in result


def test_a_size_that_does_not_split_into_nodes_or_a_tree_without_recycle_is_refused_with_one_line(
        tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match=r"^error: --ranks 60 must be a positive multiple of --ranks-per-node 8"):
        _bench().main(["--ranks", "60"])
    with pytest.raises(SystemExit, match=r"^error: --before .* holds no src/recycle; give the root of a recycle"):
        _bench().main(["--ranks", "64", "--before", str(tmp_path)])
