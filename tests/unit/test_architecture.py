"""Data flows one way: the runtime imports only the layers below it (never the planner or the simulator), the IR never
imports torch, and no two modules import each other."""

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


# What the runtime may build on (docs/runtime.md): the plan IR (with the plan-provider protocol), the config, errors,
# file I/O, the garbage collector's pause, the models and the data sources. The planner reaches it only through a PlanProvider handed in by the command layer.
RUNTIME_MAY_IMPORT = ("recycle.runtime", "recycle.ir", "recycle.config", "recycle.errors", "recycle.fileio",
                      "recycle.collector", "recycle.models", "recycle.data")
# The data sources sit beside the models: they read the config's values and nothing that runs.
DATA_MAY_IMPORT = ("recycle.data", "recycle.config", "recycle.errors", "recycle.fileio")


def test_runtime_imports_only_the_layers_below_it() -> None:
    offenders = {
        f: sorted(n for n in names if n.startswith("recycle") and not n.startswith(RUNTIME_MAY_IMPORT))
        for f, names in _imports(SRC / "runtime").items()
    }
    offenders = {f: n for f, n in offenders.items() if n}
    assert not offenders, f"runtime modules import above their layer (planner, sim, commands, ...): {offenders}"


def test_data_sources_import_only_config_and_errors() -> None:
    offenders = {
        f: sorted(n for n in names if n.startswith("recycle") and not n.startswith(DATA_MAY_IMPORT))
        for f, names in _imports(SRC / "data").items()
    }
    offenders = {f: n for f, n in offenders.items() if n}
    assert not offenders, f"data modules import the runtime, planner or models: {offenders}"


def test_ir_is_torch_free_and_lowest_layer() -> None:
    for f, names in _imports(SRC / "ir").items():
        bad = sorted(n for n in names if n.startswith("torch") or n.startswith(
            ("recycle.planner", "recycle.sim", "recycle.runtime", "recycle.schedules")))
        assert not bad, f"ir module {f} imports {bad}"


def test_every_module_has_a_docstring() -> None:
    missing = [str(p.relative_to(SRC)) for p in SRC.rglob("*.py") if ast.get_docstring(ast.parse(p.read_text())) is None]
    assert not missing, f"modules without a one-line docstring: {missing}"


def _module_graph() -> dict[str, set[str]]:
    """recycle module -> the recycle modules it imports anywhere (top level, in a function or for type checking)."""
    modules = {".".join(("recycle", *p.relative_to(SRC).with_suffix("").parts)).removesuffix(".__init__"): p
               for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)  # `from pkg import module`
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def test_no_import_cycles() -> None:
    graph = _module_graph()
    cycles = []
    for start in graph:  # a depth-first walk from each module, looking for a path back to it
        stack, seen = [(start, (start,))], set()
        while stack:
            module, path = stack.pop()
            for dep in graph.get(module, ()):
                if dep == start:
                    cycles.append(" -> ".join((*path, start)))
                elif dep not in seen:
                    seen.add(dep)
                    stack.append((dep, (*path, dep)))
    assert not cycles, f"modules that import each other (move the shared piece into a module of its own): {cycles}"


# The runtime's folders by role (docs/runtime.md, "Layout"): protocol/ at the bottom, then state/, then the worker
# process with its fault hooks; control/ (node 0 and the launchers) above all of them, never loaded by a worker.
ROLE_MAY_IMPORT = {
    "protocol": ("protocol",),
    "state": ("protocol", "state"),
    "worker": ("protocol", "state", "worker", "tools.faults", "options"),
    "tools": ("protocol", "state", "worker", "tools", "options"),
    "control": ("protocol", "state", "worker", "tools", "options", "control"),
}


def test_runtime_folders_import_only_the_roles_below_them() -> None:
    roles = {p.name for p in (SRC / "runtime").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert roles == set(ROLE_MAY_IMPORT), f"runtime folders {sorted(roles)} differ from the documented roles"
    loose = sorted(p.name for p in (SRC / "runtime").glob("*.py"))
    assert loose == ["__init__.py", "options.py"], f"runtime modules outside a role folder: {loose}"
    offenders = {}
    for f, names in _imports(SRC / "runtime").items():
        role = Path(f).parts[1]
        if role not in ROLE_MAY_IMPORT:
            continue
        allowed = tuple(f"recycle.runtime.{r}" for r in ROLE_MAY_IMPORT[role])
        bad = sorted(n for n in names if n.startswith("recycle.runtime.") and not n.startswith(allowed))
        if bad:
            offenders[f] = bad
    assert not offenders, f"runtime modules import a role above theirs: {offenders}"
