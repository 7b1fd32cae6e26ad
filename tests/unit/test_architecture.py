"""Data flows one way: the runtime never imports the planner or the simulator; the IR never imports torch."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "recycle"


def _imports(folder: Path) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        found[str(path.relative_to(SRC))] = names
    return found


def test_runtime_does_not_import_planner_or_simulator() -> None:
    offenders = {
        f: sorted(n for n in names if n.startswith(("recycle.planner", "recycle.sim")))
        for f, names in _imports(SRC / "runtime").items()
    }
    offenders = {f: n for f, n in offenders.items() if n}
    assert not offenders, f"runtime modules import planner/sim internals: {offenders}"


def test_ir_is_torch_free_and_lowest_layer() -> None:
    for f, names in _imports(SRC / "ir").items():
        bad = sorted(n for n in names if n.startswith("torch") or n.startswith(
            ("recycle.planner", "recycle.sim", "recycle.runtime", "recycle.schedules")))
        assert not bad, f"ir module {f} imports {bad}"


def test_every_module_has_a_docstring() -> None:
    missing = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not missing, f"modules without a one-line docstring: {missing}"
