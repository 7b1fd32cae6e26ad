"""`recycle train` end to end: metrics, --save, checkpoints and an exact --resume; and its clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from recycle.cli import main
from recycle.config import load_config
from recycle.schedules.fault_free import build_schedule

ROOT = Path(__file__).resolve().parents[2]

@pytest.fixture()
def config_file(tmp_path: Path, tiny_config_file) -> Path:
    (tmp_path / "corpus.txt").write_text("All work and no play makes a dull pipeline. " * 50, encoding="utf-8")
    return tiny_config_file(steps=3, name="cli-test", training='dataset = "corpus.txt"')


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_train_checkpoint_and_exact_resume(config_file: Path, tmp_path: Path) -> None:
    ck, full, resumed, metrics = tmp_path / "ck", tmp_path / "full.pt", tmp_path / "resumed.pt", tmp_path / "m.jsonl"
    run = subprocess.run([sys.executable, "-m", "recycle", "train", "--config", str(config_file),
                          "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--save", str(full),
                          "--metrics", str(metrics), "--start-method", "spawn"], cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, run.stderr
    assert "step 3/3 loss" in run.stdout
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2, 3] and all(m["tokens_per_s"] > 0 for m in lines)
    assert (ck / "latest").read_text().strip() == "step000002"

    code = main(["train", "--config", str(config_file), "--resume", str(ck), "--save", str(resumed),
                 "--start-method", "forkserver"])
    assert code == 0
    a = torch.load(full, weights_only=True)["model"]
    b = torch.load(resumed, weights_only=True)["model"]
    assert a.keys() == b.keys()
    for key in a:  # the resumed run's final parameters are bit-identical to the uninterrupted run's
        assert torch.equal(a[key], b[key]), key

    # Checkpoints are per stage, so the same checkpoint resumes under a failure state (the sums run in another
    # order, so equal to rounding, not bitwise).
    degraded = tmp_path / "degraded.pt"
    assert main(["train", "--config", str(config_file), "--resume", str(ck), "--down", "1:1", "--save",
                 str(degraded), "--start-method", "forkserver"]) == 0
    c = torch.load(degraded, weights_only=True)["model"]
    for key in a:
        assert float((a[key] - c[key]).abs().max() / a[key].abs().max()) < 1e-9, key


def test_plan_for_another_config_is_rejected(config_file: Path, tmp_path: Path, capsys) -> None:
    other = load_config(config_file).with_topology(num_microbatches=3)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(build_schedule(other, "1f1b").to_json())
    assert main(["train", "--config", str(config_file), "--plan", str(plan_file)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the plan is for D=2, S=2, M=3 but the config has D=2, S=2, M=2")


@pytest.mark.parametrize("args,message", [
    (["--down", "5:0"], "outside the topology"),
    (["--down", "0:0", "--down", "1:0"], "stage 0 has lost all 2 replicas"),
    (["--resume", "nowhere"], "no checkpoint there"),
    (["--schedule", "bogus"], "schedule 'bogus' is unknown"),
])
def test_user_errors_exit_2_with_a_message(config_file: Path, args: list[str], message: str, capsys) -> None:
    assert main(["train", "--config", str(config_file), *args]) == 2
    assert message in capsys.readouterr().err


def test_more_stages_than_layers_fails_before_any_worker_starts(tiny_config_file, capsys) -> None:
    path = tiny_config_file(num_stages=5, file="deep.toml")
    assert main(["train", "--config", str(path)]) == 2
    assert "n_layer = 4 layers but num_stages = 5" in capsys.readouterr().err
