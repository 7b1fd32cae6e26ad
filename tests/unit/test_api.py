"""The public API: docs/api.md runs as a doctest, config from a dict equals the TOML file, --set overrides with clear
errors, and `import recycle` stays light."""

from __future__ import annotations

import doctest
import subprocess
import sys
import tomllib
from dataclasses import replace
from pathlib import Path

import pytest

import recycle
from recycle.cli import main
from recycle.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def test_the_api_reference_page_runs_as_a_doctest(monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    failures, tried = doctest.testfile(str(ROOT / "docs" / "api.md"), module_relative=False,
                                       optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert tried >= 10 and failures == 0


@pytest.mark.parametrize("name", ["toy", "tiny-gpt", "gpt3-6.7b-a100"])
def test_config_from_a_dict_equals_the_toml_file(name: str) -> None:
    path = ROOT / "configs" / f"{name}.toml"
    raw = tomllib.loads(path.read_text())
    from_file = recycle.load_config(path)
    from_dict = recycle.config_from_dict(raw, name=raw.get("name", name))
    assert replace(from_dict, source=from_file.source) == from_file  # `source` only anchors relative data paths


def test_overrides_change_only_what_they_name() -> None:
    base = recycle.load_config(ROOT / "configs" / "tiny-gpt.toml")
    changed = recycle.load_config(ROOT / "configs" / "tiny-gpt.toml",
                                  ["training.lr=1e-3", "topology.num_replicas=3", "training.dtype=float64",
                                   "costs.forward=[1, 2]", 'name="renamed"'])
    assert changed.training.lr == 1e-3 and changed.num_replicas == 3 and changed.training.dtype == "float64"
    assert changed.costs.forward == (1.0, 2.0) and changed.name == "renamed"
    assert changed.num_stages == base.num_stages and changed.training.seed == base.training.seed


@pytest.mark.parametrize("override,needle", [
    ("training.lrr=1", "unknown key 'lrr' in [training]; known keys:"),
    ("trainig.lr=1", "unknown section 'trainig'; known sections:"),
    ("lr=1", "unknown top-level key 'lr'"),
    ("training.lr", "is not SECTION.KEY=VALUE"),
    ("training.lr=fast", "[training] lr = 'fast' must be a number"),
])
def test_bad_overrides_are_clear_errors(override: str, needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        recycle.load_config(ROOT / "configs" / "toy.toml", [override])
    assert needle in str(err.value)


def test_set_on_the_command_line(capsys) -> None:
    assert main(["schedule", "--config", str(ROOT / "configs" / "toy.toml"), "--set", "workload.num_microbatches=8",
                 "--json"]) == 0
    assert '"num_microbatches": 8' in capsys.readouterr().out.replace(" ", " ")
    assert main(["schedule", "--config", str(ROOT / "configs" / "toy.toml"), "--set", "topology.stages=2"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --set 'topology.stages=2': unknown key 'stages' in [topology]") and \
        err.count("\n") == 1
    assert main(["demo", "--set", "training.lr=1"]) == 2
    assert "no --config was given" in capsys.readouterr().err


def test_import_recycle_is_light() -> None:
    code = ("import sys, recycle; recycle.load_config; "
            "print(sorted(m for m in ('torch', 'ortools', 'recycle.planner.api', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_unknown_attributes_and_train_options_are_errors() -> None:
    with pytest.raises(AttributeError):
        recycle.no_such_function  # noqa: B018
    config = recycle.load_config(ROOT / "configs" / "tiny-gpt.toml")
    with pytest.raises(ConfigError, match="unknown option\\(s\\) \\['stepz'\\]"):
        recycle.train(config, stepz=3)
