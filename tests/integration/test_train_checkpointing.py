"""Activation checkpointing on real gloo processes: a D=2 x S=2 float64 run with checkpointed stages ends at the
parameters of the unchecked model trained whole in one process (<= 1e-9), fault-free and with a worker SIGKILLed
mid-step, for the built-in GPT and a tied Hugging Face model."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from recycle.config import Config, parse_config
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import LaunchOptions, with_keywords
from recycle.runtime.tools.reference import reference_train
from recycle.schedules.fault_free import build_schedule

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _config(mode: str, model: dict | None = None, steps: int = 3) -> Config:
    return parse_config({
        "topology": {"num_replicas": 2, "num_stages": 2},
        "workload": {"num_microbatches": 2, "microbatch_size": 2, "seq_len": 16},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {**(model or {"n_layer": 4, "n_embd": 32, "n_head": 2}), "activation_checkpointing": mode},
        "training": {"steps": steps, "lr": 0.01, "dtype": "float64", "seed": 5},
    }, name=f"checkpointing-{mode}")


def _assert_exact(saved: dict[str, torch.Tensor], config: Config) -> None:
    """Every saved tensor equals the reference's, trained whole without checkpointing, to 1e-9 (and it trained)."""
    unchecked = replace(config, model=replace(config.model, activation_checkpointing="none"))
    reference, _ = reference_train(unchecked)
    start, _ = reference_train(unchecked, steps=0)
    assert set(saved) <= set(reference) and len(saved) >= len(reference) - 1  # a tied model saves its weight once
    assert any(not torch.equal(start[k], reference[k]) for k in saved)
    for key, value in saved.items():
        ref = reference[key]
        assert float((value - ref).abs().max()) <= 1e-9 * max(1.0, float(ref.abs().max())), key


@pytest.mark.parametrize("mode", ["full", "per_layer"])
def test_a_checkpointed_gpt_run_is_exact_against_the_unchecked_model(tmp_path, mode: str) -> None:
    config = _config(mode)
    launch(config, build_schedule(config, "zb-h1", staggered=True),  # decoupled: B and W recompute separately
           with_keywords(LaunchOptions(), dict(progress=None, start_method="forkserver", verify_replicas=True,
                                               save_path=str(tmp_path / "final.pt"))))
    _assert_exact(torch.load(tmp_path / "final.pt", weights_only=True)["model"], config)


def test_a_checkpointed_worker_killed_mid_step_is_survived_exactly(tmp_path) -> None:
    """Worker 1:1 is SIGKILLed mid-step; its micro-batches re-run on 0:1 (checkpointed too) and the run is exact."""
    from recycle.api import train
    from recycle.runtime.tools.faults import FaultInjection

    config = _config("per_layer", steps=4)
    save = tmp_path / "final.pt"
    result = train(config, schedule="zb-h1", max_failures=1, save_path=str(save), progress=None,
                   start_method="forkserver", faults=((config.topology.rank(1, 1), FaultInjection(1, 4, "kill")),))
    (recovery,) = result.recoveries
    assert recovery.workers == ("1:1",) and "killed by SIGKILL" in recovery.causes[0], recovery.causes
    assert [m.step for m in result.steps][-1] == 4 and result.failed == ((1, 1),)
    _assert_exact(torch.load(save, weights_only=True)["model"], config)


def test_a_checkpointed_tied_hf_run_is_exact_against_the_unchecked_model(tmp_path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = json.loads((EXAMPLES / "hf-tiny-gpt2.json").read_text())
    spec.pop("tie_word_embeddings", None)  # gpt2's default: tied
    hf = tmp_path / "tied-gpt2.json"
    hf.write_text(json.dumps(spec))
    config = _config("full", model={"hf_config": str(hf)})
    launch(config, build_schedule(config, "zb-h1", staggered=True),
           with_keywords(LaunchOptions(), dict(progress=None, start_method="forkserver", verify_replicas=True,
                                               save_path=str(tmp_path / "final.pt"))))
    _assert_exact(torch.load(tmp_path / "final.pt", weights_only=True)["model"], config)
