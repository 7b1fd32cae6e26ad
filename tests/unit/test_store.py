"""Plan store: build, index, load, fast lookup on real ranks, online fallback, config mismatch."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import pytest

from recycle.config import Config, load_config, uniform_config
from recycle.errors import PlanError
from recycle.ir.validate import validate_plan
from recycle.planner.api import plan_for_key
from recycle.planner.failures import enumerate_keys, normalize
from recycle.planner.options import PlannerOptions
from recycle.planner.store import INDEX_NAME, PlanStore, build_store, key_name
from recycle.sim.simulator import simulate

TOY = Path(__file__).resolve().parents[2] / "configs" / "toy.toml"


@pytest.fixture(scope="module")
def toy() -> Config:
    return load_config(TOY)


@pytest.fixture(scope="module")
def toy_store(toy: Config, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("store")
    progress = io.StringIO()
    build_store(toy, 2, out, PlannerOptions(), progress=progress)
    lines = progress.getvalue().splitlines()
    keys = list(enumerate_keys(3, 4, 2))
    assert len(lines) == len(keys) == 15
    assert lines[-1].startswith(f"[{len(keys)}/{len(keys)}] key=(")
    assert "period=" in lines[0]
    return out


def test_index_lists_every_key_with_its_period(toy: Config, toy_store: Path) -> None:
    index = json.loads((toy_store / INDEX_NAME).read_text())
    assert index["config_fingerprint"] == toy.fingerprint()
    assert index["options"] == {"decoupled": True, "staggered": True, "memory_cap": None, "search": True}
    assert set(index["plans"]) == {key_name(k) for k in enumerate_keys(3, 4, 2)}
    entry = index["plans"][key_name((0, 0, 1, 0))]
    assert entry["period"] == plan_for_key(toy, (0, 0, 1, 0), PlannerOptions()).meta.predicted_period
    assert entry["lower_bound"] <= entry["period"]
    assert not list(toy_store.rglob("*.tmp"))  # atomic writes leave no temp files


def test_lookup_maps_real_failures_to_a_valid_plan(toy: Config, toy_store: Path) -> None:
    store = PlanStore.load(toy_store, toy)
    assert len(store) == 15
    for failed in ([], [(1, 2)], [(2, 0), (0, 3)], [(0, 1), (2, 1)]):
        plan = validate_plan(store.lookup(failed))
        assert plan.failed == frozenset(failed)
        key = normalize(failed, 3, 4).key
        assert simulate(plan, toy).period == store.entries[key].period
        assert "not in store" not in plan.meta.notes


def test_lookup_is_fast(toy: Config, toy_store: Path) -> None:
    store = PlanStore.load(toy_store, toy)
    failures = [[(1, 2)], [(2, 0), (0, 3)], [(0, 1)], []]
    n = 2000
    start = time.perf_counter()
    for i in range(n):
        store.lookup(failures[i % len(failures)])
    mean = (time.perf_counter() - start) / n
    assert mean < 1e-3, f"mean lookup {mean * 1e6:.0f} us (want well under 1 ms)"


def test_missing_key_falls_back_to_the_heuristic_and_says_so(toy: Config, toy_store: Path) -> None:
    store = PlanStore.load(toy_store, toy)
    failed = [(0, 0), (1, 1), (2, 2)]  # three failures: the store holds up to two
    plan = validate_plan(store.lookup(failed))
    assert plan.failed == frozenset(failed)
    assert "not in store" in plan.meta.notes and "heuristic" in plan.meta.notes


def test_store_for_another_config_is_a_clear_error(toy_store: Path) -> None:
    other = uniform_config(3, 4, 6, optimizer=2.0, name="other")
    with pytest.raises(PlanError, match="fingerprint"):
        PlanStore.load(toy_store, other)


def test_missing_or_damaged_store_is_a_clear_error(toy: Config, tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="does not exist"):
        PlanStore.load(tmp_path / "nowhere", toy)
    (tmp_path / INDEX_NAME).write_text("{not json")
    with pytest.raises(PlanError, match="not valid JSON"):
        PlanStore.load(tmp_path, toy)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_parallel_build_matches_serial(tmp_path: Path) -> None:
    config = uniform_config(3, 3, 4, optimizer=1.0)
    build_store(config, 2, tmp_path / "serial", progress=None)
    build_store(config, 2, tmp_path / "parallel", jobs=2, progress=io.StringIO())
    serial = json.loads((tmp_path / "serial" / INDEX_NAME).read_text())["plans"]
    parallel = json.loads((tmp_path / "parallel" / INDEX_NAME).read_text())["plans"]
    assert {k: v["period"] for k, v in serial.items()} == {k: v["period"] for k, v in parallel.items()}


def _copy_store(toy_store: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "store"
    shutil.copytree(toy_store, out)
    return out


def _name_plan_file(store: Path, file: str) -> None:
    index = json.loads((store / INDEX_NAME).read_text())
    index["plans"][key_name((0, 0, 0, 0))]["file"] = file
    (store / INDEX_NAME).write_text(json.dumps(index))


@pytest.mark.parametrize("file", ["/etc/passwd", "../../../../../../etc/passwd", "plans/../../store2/x.json",
                                  "plans//k0-0-0-0.json", ""])
def test_an_index_naming_a_file_outside_the_store_is_refused(toy: Config, toy_store: Path, tmp_path: Path,
                                                              file: str) -> None:
    """Issue 21 item 4: index.json may name only relative paths inside the store folder (before: /etc/passwd was
    read and parsed as a plan)."""
    store = _copy_store(toy_store, tmp_path)
    _name_plan_file(store, file)
    with pytest.raises(PlanError, match="not inside the store folder.*refused"):
        PlanStore.load(store, toy)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["plan -> elsewhere", "plan -> /dev/zero", "FIFO plan", "FIFO index.json",
                                  "plans folder -> elsewhere"])
def test_links_and_special_files_in_a_plan_store_are_refused(toy: Config, toy_store: Path, tmp_path: Path,
                                                             kind: str) -> None:
    """Before: a FIFO hung the load, /dev/zero was read until memory ran out, links were followed."""
    import os
    import shutil

    store = _copy_store(toy_store, tmp_path)
    plan = store / "plans" / f"{key_name((0, 0, 0, 0))}.json"
    if kind == "plan -> elsewhere":
        shutil.copy(plan, tmp_path / "elsewhere.json")
        plan.unlink()
        plan.symlink_to(tmp_path / "elsewhere.json")
    elif kind == "plan -> /dev/zero":
        plan.unlink()
        plan.symlink_to("/dev/zero")
    elif kind == "FIFO plan":
        plan.unlink()
        os.mkfifo(plan)
    elif kind == "FIFO index.json":
        (store / INDEX_NAME).unlink()
        os.mkfifo(store / INDEX_NAME)
    else:
        shutil.move(store / "plans", tmp_path / "plans")
        (store / "plans").symlink_to(tmp_path / "plans")
    with pytest.raises(PlanError, match="refused"):
        PlanStore.load(store, toy)


def test_a_plan_over_its_size_bound_is_refused_unread(toy: Config, toy_store: Path, tmp_path: Path,
                                                      monkeypatch) -> None:
    import recycle.planner.store as store_module

    store = _copy_store(toy_store, tmp_path)
    monkeypatch.setattr(store_module, "PLAN_LIMIT", 10)
    with pytest.raises(PlanError, match="more than a plan file may have"):
        PlanStore.load(store, toy)


@pytest.mark.parametrize("text", ["[1, 2]", '"index"', "3"])
def test_an_index_that_is_not_a_json_object_is_a_plan_error(toy: Config, toy_store: Path, tmp_path: Path,
                                                            text: str) -> None:
    store = _copy_store(toy_store, tmp_path)
    (store / INDEX_NAME).write_text(text)
    with pytest.raises(PlanError, match="not a plan store index"):
        PlanStore.load(store, toy)
