"""Tied word embeddings on real gloo processes: the first and last stage each hold the shared weight and sum its
gradient across them before the step, so D x S training (and S = 1, a SIGKILLed worker, a resume from a checkpoint)
ends at the parameters of the tied model trained whole in one process; --save and --export-hf write the weight once,
and transformers loads the export tied, with the stages' logits."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from recycle.config import load_config
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import LaunchOptions, with_keywords
from recycle.runtime.tools.reference import reference_train
from recycle.schedules.fault_free import build_schedule

pytest.importorskip("transformers")  # in requirements.txt; the optional extra 'hf' for users

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EMBEDDING = {"gpt2": "model.transformer.wte.weight", "llama": "model.model.embed_tokens.weight"}
HEAD = "model.lm_head.weight"
TOML = """
[topology]
num_replicas = {D}
num_stages = {S}
[workload]
num_microbatches = 2
microbatch_size = 2
seq_len = 16
[costs]
forward = 1
backward_input = 1
backward_weight = 1
[model]
hf_config = {hf!r}
[training]
steps = {steps}
lr = 0.01
dtype = "float64"
seed = 4
{training}
"""


def _tied_config(tmp_path: Path, family: str, D: int = 2, S: int = 2, steps: int = 2, training: str = ""):
    raw = json.loads((EXAMPLES / f"hf-tiny-{family}.json").read_text())
    if family == "gpt2":
        del raw["tie_word_embeddings"]  # gpt2's default: tied
    else:
        raw["tie_word_embeddings"] = True
    hf = tmp_path / f"tied-{family}.json"
    hf.write_text(json.dumps(raw))
    path = tmp_path / f"tied-{family}-{D}x{S}.toml"
    path.write_text(TOML.format(D=D, S=S, hf=str(hf), steps=steps, training=training))
    return load_config(path)


def _launch(cfg, **options) -> None:
    launch(cfg, build_schedule(cfg, "zb-h1", staggered=True),
           with_keywords(LaunchOptions(), dict(progress=None, start_method="forkserver", verify_replicas=True,
                                               **options)))


def _assert_exact(saved: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], family: str) -> None:
    """`saved` holds the tied weight once (no lm_head copy) and every tensor equals the reference's to 1e-9."""
    assert HEAD not in saved and EMBEDDING[family] in saved
    assert torch.equal(reference[HEAD], reference[EMBEDDING[family]])  # the reference is the tied model itself
    assert sorted(saved) == sorted(k for k in reference if k != HEAD)
    for key, value in saved.items():
        ref = reference[key]
        assert float((value - ref).abs().max()) <= 1e-9 * max(1.0, float(ref.abs().max())), key


@pytest.mark.parametrize("family,training", [("gpt2", ""), ("llama", "grad_clip = 0.05")])
def test_tied_training_on_two_by_two_is_exact_against_the_tied_model_trained_whole(tmp_path, monkeypatch, family: str,
                                                                                  training: str) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _tied_config(tmp_path, family, training=training)
    _launch(cfg, save_path=str(tmp_path / "final.pt"))
    saved = torch.load(tmp_path / "final.pt", weights_only=True)["model"]
    reference, _ = reference_train(cfg)
    start, _ = reference_train(cfg, steps=0)
    # It trained, the tied weight too (its gradient comes from both ends of the model).
    assert not torch.equal(start[EMBEDDING[family]], reference[EMBEDDING[family]])
    _assert_exact(saved, reference, family)
    if training:  # the clipping bound was hit, so the global norm (the tied weight counted once) mattered
        unclipped = replace(cfg, training=replace(cfg.training, grad_clip=0.0))
        assert max(float((reference_train(unclipped)[0][k] - reference[k]).abs().max()) for k in saved) > 1e-6


def test_one_stage_holds_the_tied_model_itself(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _tied_config(tmp_path, "llama", D=2, S=1)
    _launch(cfg, save_path=str(tmp_path / "final.safetensors"))  # safetensors refuses two names of one tensor
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "final.safetensors"))
    _assert_exact(saved, reference_train(cfg)[0], "llama")


def test_a_tied_worker_killed_mid_run_is_survived_exactly(tmp_path, monkeypatch) -> None:
    """Worker 1:1 (the last stage, holding the lm_head copy) is SIGKILLed mid-step; the next generation's tied group
    is formed from the survivors and the final parameters equal the tied model trained whole."""
    from recycle.api import train
    from recycle.runtime.tools.faults import FaultInjection

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _tied_config(tmp_path, "gpt2", steps=4)
    save = tmp_path / "final.pt"
    result = train(cfg, schedule="zb-h1", max_failures=1, save_path=str(save), progress=None,
                   start_method="forkserver", faults=((cfg.topology.rank(1, 1), FaultInjection(1, 4, "kill")),))
    (recovery,) = result.recoveries
    assert recovery.workers == ("1:1",) and "killed by SIGKILL" in recovery.causes[0], recovery.causes
    assert [m.step for m in result.steps][-1] == 4 and result.failed == ((1, 1),)
    _assert_exact(torch.load(save, weights_only=True)["model"], reference_train(cfg)[0], "gpt2")


@pytest.mark.parametrize("S", [2, 1])
def test_a_tied_run_resumes_from_its_checkpoint_bit_for_bit(tmp_path, monkeypatch, S: int) -> None:
    """Each stage's DCP shard holds its own copy of the tied weight (with S = 1: the one tensor under both names),
    and its optimizer state; resuming at step 2 of 3 ends bit for bit where the uninterrupted run did."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _tied_config(tmp_path, "gpt2", S=S, steps=3)
    ck = tmp_path / "ck"
    _launch(cfg, save_path=str(tmp_path / "full.pt"), checkpoint_dir=str(ck), checkpoint_every=2)
    assert (ck / "latest").read_text().strip() == "step000002"
    full = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    _assert_exact(full, reference_train(cfg)[0], "gpt2")
    _launch(cfg, save_path=str(tmp_path / "resumed.pt"), resume_dir=str(ck))
    resumed = torch.load(tmp_path / "resumed.pt", weights_only=True)["model"]
    assert sorted(resumed) == sorted(full) and all(torch.equal(resumed[k], full[k]) for k in full)


def test_export_of_a_tied_model_loads_tied_in_transformers_with_the_stages_logits(tmp_path, monkeypatch) -> None:
    import transformers
    from safetensors.torch import load_file

    from recycle.models.hf import hf_stages

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = _tied_config(tmp_path, "gpt2")
    export = tmp_path / "export"
    _launch(cfg, export_hf=str(export))
    exported = {f"model.{k}": v for k, v in load_file(export / "model.safetensors").items()}
    _assert_exact(exported, reference_train(cfg)[0], "gpt2")  # one copy, as save_pretrained writes a tied model
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float64).eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied again on load
    stages = hf_stages(os.path.join(tmp_path, "tied-gpt2.json"), 2, 16, 0, torch.float64)
    for stage in stages:
        own = stage.state_dict()
        stage.load_state_dict({k: exported[EMBEDDING["gpt2"] if k == HEAD else k] for k in own})
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=tokens).logits, stages[1](stages[0](tokens)))
