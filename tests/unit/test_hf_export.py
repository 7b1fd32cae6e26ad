"""HF format out: the stages' parameters written as a folder that transformers' from_pretrained loads, with the
logits of the stages chained; refused up front where the folder cannot be written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from recycle.errors import ConfigError, OutputError
from recycle.models.hf import hf_stages
from recycle.models.hf_export import check_export_dir, export_hf

transformers = pytest.importorskip("transformers")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def chained(stages: list[torch.nn.Module], tokens: torch.Tensor) -> torch.Tensor:
    x = tokens
    for stage in stages:
        x = stage(x)
    return x


@pytest.mark.parametrize("family,dtype", [("llama", torch.float64), ("gpt2", torch.float64),
                                          ("qwen2", torch.float32)])
def test_an_export_loads_in_transformers_with_the_stages_logits(tmp_path, family: str, dtype: torch.dtype) -> None:
    config = EXAMPLES / f"hf-tiny-{family}.json"
    stages = hf_stages(config, 2, 16, 7, dtype)
    state = {k: v for s in stages for k, v in s.state_dict().items()}
    out = export_hf(config, 16, state, tmp_path / "export")
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert all((out / f).stat().st_mode & 0o444 == 0o444 for f in os.listdir(out))  # readable by everyone
    assert not [p for p in os.listdir(tmp_path) if p != "export"]  # the temporary folder was renamed into place
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=dtype).eval()
    assert type(loaded).__name__ == json.loads((out / "config.json").read_text())["architectures"][0]
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = chained(stages, tokens), loaded(input_ids=tokens).logits
    assert theirs.dtype == dtype
    if dtype == torch.float64:
        assert torch.equal(ours, theirs)
    else:
        assert float((ours - theirs).abs().max()) <= 1e-6


def test_an_export_target_that_is_not_new_or_empty_is_refused(tmp_path) -> None:
    check_export_dir(tmp_path / "new")  # absent: fine
    (tmp_path / "empty").mkdir()
    check_export_dir(tmp_path / "empty")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(OutputError, match=r"--export-hf '.*full' is a folder that is not empty"):
        check_export_dir(tmp_path / "full")
    (tmp_path / "file").write_text("")
    with pytest.raises(OutputError, match=r"exists and is not a directory"):
        check_export_dir(tmp_path / "file")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(OutputError, match=r"cannot create"):
            check_export_dir(locked / "out")


def test_cli_export_of_a_non_hf_model_or_into_a_full_folder_is_one_error_line(tmp_path, capsys) -> None:
    from recycle.cli import main

    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-gpt.toml")
    assert main(["train", "--config", tiny, "--export-hf", str(tmp_path / "out"), "--max-failures", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --export-hf") and "built-in GPT" in err[0], err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert main(["train", "--config", tiny, "--hf", str(EXAMPLES / "hf-tiny-gpt2.json"), "--export-hf",
                 str(tmp_path / "full"), "--max-failures", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --export-hf") and "not empty" in err[0], err


def test_the_export_check_runs_in_the_launcher_too(tmp_path) -> None:
    from recycle.config import load_config
    from recycle.runtime.control.preflight import check_export_model
    from recycle.runtime.options import LaunchOptions, OutputOptions

    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny-gpt.toml")
    with pytest.raises(ConfigError, match=r"--export-hf '.*' writes a Hugging Face model, but this run trains "
                                          r"the built-in GPT"):
        check_export_model(cfg, LaunchOptions(outputs=OutputOptions(export_hf=str(tmp_path / "x"))))


def test_save_and_export_are_written_from_the_same_parts_and_no_part_is_left(tmp_path) -> None:
    from safetensors.torch import load_file

    from recycle.config import load_config
    from recycle.runtime.control.launcher import _write_final
    from recycle.runtime.options import OutputOptions
    from recycle.runtime.state import checkpoint

    config_json = EXAMPLES / "hf-tiny-gpt2.json"
    config = load_config(EXAMPLES.parent / "configs" / "tiny-gpt.toml",
                         [f"model.hf_config={json.dumps(str(config_json))}"])
    stages = hf_stages(config_json, 2, 16, 3, torch.float32)
    outputs = OutputOptions(save_path=str(tmp_path / "final.pt"), export_hf=str(tmp_path / "export"))
    for s, stage in enumerate(stages):  # what each stage's writer leaves (worker.process._save_final)
        checkpoint.atomic_torch_save(stage.state_dict(), checkpoint.part_file(outputs.parts_path, s))
    _write_final(config, outputs, 2, end_step=1)
    assert sorted(os.listdir(tmp_path)) == ["export", "final.pt"]
    saved = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    exported = load_file(tmp_path / "export" / "model.safetensors")
    assert sorted(saved) == sorted(f"model.{k}" for k in exported)
    assert all(torch.equal(saved[f"model.{k}"], v) for k, v in exported.items())


def test_a_tied_export_writes_the_shared_weight_once_and_loads_tied(tmp_path) -> None:
    raw = json.loads((EXAMPLES / "hf-tiny-qwen2.json").read_text())
    raw["tie_word_embeddings"] = True
    config = tmp_path / "tied.json"
    config.write_text(json.dumps(raw))
    stages = hf_stages(config, 2, 16, 7, torch.float64)
    state = {k: v for s in stages for k, v in s.state_dict().items()}  # both copies, as the stages hold them
    out = export_hf(config, 16, state, tmp_path / "export")
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(chained(stages, tokens), loaded(input_ids=tokens).logits)
    # Copies that differ are a bug in the run, never exported silently.
    state["model.lm_head.weight"] = state["model.lm_head.weight"] + 1.0
    with pytest.raises(ValueError, match="tied weight's copies"):
        export_hf(config, 16, state, tmp_path / "export2")
