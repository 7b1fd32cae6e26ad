"""`recycle profile` end to end: it writes a config that `recycle plan` uses, names bad input, and measures gloo."""

from __future__ import annotations

import json

import pytest
import torch

from recycle.cli import main
from recycle.config import load_config
from recycle.models.split import StageModel, causal_lm_loss

pytestmark = [pytest.mark.timing]
TINY = "configs/tiny-gpt.toml"


def test_profile_then_plan_on_the_written_config(tmp_path, capsys) -> None:
    out = tmp_path / "costs.toml"
    assert main(["profile", "--config", TINY, "--out", str(out), "--repeats", "3", "--warmup", "1",
                 "--comm", "defaults"]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out}" in printed and "stage" in printed
    costs = load_config(out)
    assert costs.time_unit == "us" and costs.num_stages == 2
    assert all(f > 0 for f in costs.costs.forward)
    assert main(["plan", "--config", str(out), "--fail", "1:1", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["time_unit"] == "us" and summary["failed"] == [[1, 1]]
    # Re-routing stage 1's micro-batches onto one survivor cannot be faster than the planner's fault-free plan with
    # the same options. (Not than the coupled 1F1B baseline: with the optimizer step measured as the executor runs
    # it, snapshot included, a staggered plan may beat coupled 1F1B even with a worker down.)
    assert summary["period"] >= summary["planner_fault_free_period"] > 0 and summary["fault_free_period"] > 0


def test_profile_errors_exit_2_with_a_message(tmp_path, capsys) -> None:
    assert main(["profile", "--config", str(tmp_path / "missing.toml"), "--out", str(tmp_path / "o.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["profile", "--config", TINY, "--out", str(tmp_path / "o.toml"), "--repeats", "0",
                 "--comm", "defaults"]) == 2
    assert "--repeats 0" in capsys.readouterr().err
    assert not (tmp_path / "o.toml").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_measured_gloo_costs_are_plausible(tmp_path, capsys) -> None:
    out = tmp_path / "costs.toml"
    assert main(["profile", "--config", TINY, "--out", str(out), "--repeats", "2", "--warmup", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["comm"]["source"].startswith("measured")
    comm = load_config(out).communication
    # Loopback gloo: a small message costs microseconds to a few milliseconds, 4 MB moves at 10 MB/s - 100 GB/s.
    assert 0 <= comm.p2p_latency < 20_000 and 10 < comm.p2p_bandwidth < 100_000
    assert 0 <= comm.allreduce_latency < 20_000 and 10 < comm.allreduce_bandwidth < 100_000


def _profile_json(capsys, *flags: str, out) -> tuple[dict, str]:
    assert main(["profile", "--config", TINY, "--out", str(out), "--repeats", "1", "--warmup", "0",
                 "--comm", "defaults", "--json", *flags]) == 0
    captured = capsys.readouterr()
    return json.loads(captured.out), captured.err


def test_profile_measures_the_hugging_face_model_that_train_would_train(tmp_path, capsys) -> None:
    pytest.importorskip("transformers")
    from recycle.models.gpt import resolve_shape
    from recycle.models.hf import build_hf_model

    hf_json = "examples/hf-tiny-llama.json"
    report, err = _profile_json(capsys, "--hf", hf_json, out=tmp_path / "costs.toml")
    assert "profiling the Hugging Face llama model" in err and "built-in GPT" not in err, err
    # float32 weights: 4 bytes per parameter of the HF model, not of the built-in GPT of the config's [model].
    hf_params = sum(p.numel() for p in build_hf_model(hf_json, 32, 0, torch.float32).parameters())
    tiny = load_config(TINY)
    assert hf_params != resolve_shape(tiny.model, tiny.workload.seq_len).num_parameters
    assert sum(s["parameter_bytes"] for s in report["stages"]) == 4 * hf_params
    # Stage 0 sends the hidden states: micro-batch 2 x 32 tokens x hidden 32 x 4 bytes.
    assert report["stages"][0]["message_bytes"] == 2 * 32 * 32 * 4
    profiled = load_config(tmp_path / "costs.toml")
    assert profiled.model.hf_config and json.loads(open(profiled.model.hf_config).read())["model_type"] == "llama"


class _Wide(torch.nn.Module):
    """Stage 0 of the factory below: token ids to 24 features (a width no built-in model has)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(256, 24)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.emb(tokens)


class _Logits(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = torch.nn.Linear(24, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def two_stage_factory(config, num_stages: int) -> StageModel:
    torch.manual_seed(config.training.seed)
    return StageModel((_Wide(), _Logits()), causal_lm_loss)


def test_profile_measures_a_model_factory(tmp_path, capsys) -> None:
    report, err = _profile_json(capsys, "--model-factory", f"{__name__}:two_stage_factory", out=tmp_path / "c.toml")
    assert "model factory" in err and "built-in GPT" not in err, err
    assert [s["parameter_bytes"] for s in report["stages"]] == [256 * 24 * 4, (24 * 256 + 256) * 4]
    assert report["stages"][0]["message_bytes"] == 2 * 32 * 24 * 4
    assert report["stages"][1]["forward_us"] > 0


def test_profile_refuses_two_models(tmp_path, capsys) -> None:
    assert main(["profile", "--config", TINY, "--out", str(tmp_path / "o.toml"), "--comm", "defaults",
                 "--hf", "examples/hf-tiny-llama.json", "--model-factory", f"{__name__}:two_stage_factory"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "both name the model; keep one" in err[0], err
