"""The public API: `import recycle` stays cheap, configs round-trip through dicts, `--set` overrides with clear
errors, the CLI goes through the API, and the API reference page (docs/api.md) runs as a doctest."""

from __future__ import annotations

import doctest
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import recycle
from recycle.cli import main
from recycle.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


@pytest.mark.timeout(120)
def test_the_api_reference_page_runs_as_a_doctest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the page names configs/ relative to the repository root
    failures, tried = doctest.testfile(str(ROOT / "docs" / "api.md"), module_relative=False,
                                       optionflags=doctest.ELLIPSIS)
    assert tried >= 15 and failures == 0


@pytest.mark.timeout(60)
def test_import_recycle_imports_neither_torch_nor_the_planner() -> None:
    code = ("import sys, recycle; recycle.load_config; recycle.plan; "
            "print(sorted(m for m in ('torch', 'ortools', 'recycle.planner', 'recycle.sim', 'matplotlib') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_every_public_name_resolves_and_unknown_names_do_not() -> None:
    for name in recycle.__all__:
        assert getattr(recycle, name) is not None, name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        recycle.nope  # noqa: B018


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_a_config_from_its_dict_equals_the_config_from_toml(path: Path) -> None:
    from_toml = recycle.load_config(path)
    from_dict = recycle.config_from_dict(from_toml.to_dict())
    assert from_dict == recycle.config_from_dict(from_toml.to_dict())
    assert from_dict.to_dict() == from_toml.to_dict()
    assert from_dict.fingerprint() == from_toml.fingerprint()


def test_overrides_set_typed_values_and_refuse_unknown_keys_naming_the_known_ones() -> None:
    toy = ROOT / "configs" / "toy.toml"
    cfg = recycle.load_config(toy, ["training.lr=1e-3", "workload.num_microbatches=4", "costs.forward=[1, 2, 1, 1]",
                                    "training.dataset=data/my file.txt", "name=renamed"])
    assert cfg.training.lr == 1e-3 and cfg.num_microbatches == 4 and cfg.costs.forward == (1.0, 2.0, 1.0, 1.0)
    assert cfg.training.dataset == "data/my file.txt" and cfg.name == "renamed"
    with pytest.raises(ConfigError, match=r"unknown key 'learning_rate' in \[training\]; known keys: .*lr"):
        recycle.load_config(toy, ["training.learning_rate=1"])
    with pytest.raises(ConfigError, match=r"unknown section 'train'; known sections: .*training"):
        recycle.load_config(toy, ["train.lr=1"])
    with pytest.raises(ConfigError, match=r"must look like section.key=value"):
        recycle.load_config(toy, ["training.lr"])
    with pytest.raises(ConfigError, match=r"\[training\] lr = 'fast' must be a number"):
        recycle.load_config(toy, ["training.lr=fast"])
    with pytest.raises(ConfigError, match=r"\[topology\] num_stages = 2.5 must be an integer"):
        recycle.config_from_dict(recycle.load_config(toy).to_dict(), ["topology.num_stages=2.5"])


def test_cli_set_reaches_the_config_and_bad_keys_exit_2_with_one_error_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    toy = str(ROOT / "configs" / "toy.toml")
    assert main(["plan", "--config", toy, "--set", "workload.num_microbatches=4", "--fail", "1:2", "--compare", "no",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_microbatches"] == 4
    for command in (["plan"], ["schedule", "--schedule", "1f1b"], ["train", "--steps", "1"], ["profile", "--out", "x"],
                    ["simulate", "--generate", "paper-gcp", "--out", "x"]):
        assert main([command[0], "--config", toy, "--set", "training.lrate=1", *command[1:]]) == 2, command
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: override 'training.lrate=1': unknown key 'lrate'") \
            and "known keys:" in err[0], (command, err)


def test_train_refuses_unknown_launch_options_before_starting_anything() -> None:
    cfg = recycle.load_config(ROOT / "configs" / "tiny-gpt.toml")
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['stepz'\]; known: .*steps"):
        recycle.train(cfg, stepz=3)


def test_repartition_is_refused_before_anything_starts_where_it_cannot_work(capsys) -> None:
    cfg = recycle.load_config(ROOT / "configs" / "tiny-gpt.toml")
    with pytest.raises(ConfigError, match="a --model-factory or --hf model's split is fixed"):
        recycle.train(cfg, repartition=True, model_factory="mymodels:stages")
    with pytest.raises(ConfigError, match="repartition=True needs recover=True"):
        recycle.train(cfg, repartition=True, recover=False)
    assert main(["train", "--config", str(ROOT / "configs" / "tiny-gpt.toml"), "--repartition", "--no-recover"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: repartition=True needs recover=True") and err.count("\n") == 1


def test_plan_takes_pairs_or_text_and_names_a_bad_worker() -> None:
    toy = recycle.load_config(ROOT / "configs" / "toy.toml")
    assert recycle.plan(toy, [(1, 2)]).to_json() == recycle.plan(toy, ["1:2"]).to_json()
    with pytest.raises(recycle.RecycleError, match="9:0"):
        recycle.plan(toy, ["9:0"])
