"""Hugging Face models: a causal LM of each supported family (gpt2, llama, mistral, qwen2) built from a config JSON
(random init, nothing downloaded), split by decoder layers, trains on D x S processes to the parameters of the same HF
model trained whole in one process."""

from __future__ import annotations

import os

import pytest
import torch

from recycle.config import load_config
from recycle.models.hf import build_hf_model
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import ClusterOptions, DebugOptions, LaunchOptions, OutputOptions
from recycle.runtime.tools.reference import reference_train
from recycle.schedules.fault_free import build_schedule

pytest.importorskip("transformers")  # in requirements.txt; the optional extra 'hf' for users

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "..", "examples")
# A parameter of decoder layer 3, which the second stage holds (the stages keep the whole model's names).
LAYER_3 = {"gpt2": "model.transformer.h.3.", "llama": "model.model.layers.3.", "mistral": "model.model.layers.3.",
           "qwen2": "model.model.layers.3."}
TOML = """
[topology]
num_replicas = 2
num_stages = 2
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
steps = 2
lr = 0.01
dtype = "float64"
seed = 4
"""


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", sorted(LAYER_3))
def test_a_hugging_face_model_trains_like_the_whole_model_in_one_process(tmp_path, monkeypatch, family: str) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "hf.toml"
    path.write_text(TOML.format(hf=os.path.abspath(os.path.join(EXAMPLES, f"hf-tiny-{family}.json"))))
    cfg = load_config(path)
    save = tmp_path / "final.pt"
    launch(cfg, build_schedule(cfg, "zb-h1", staggered=True),
           LaunchOptions(outputs=OutputOptions(save_path=str(save)), cluster=ClusterOptions(start_method="forkserver"),
                         debug=DebugOptions(verify_replicas=True), progress=None))
    saved = torch.load(save, weights_only=True)["model"]  # the stages keep the HF model's names
    reference, _ = reference_train(cfg)
    assert sorted(saved) == sorted(reference)
    assert any(k.startswith(LAYER_3[family]) for k in saved)
    initial = build_hf_model(os.path.join(EXAMPLES, f"hf-tiny-{family}.json"), 16, 4, torch.float64).state_dict()
    assert all(not torch.equal(initial[k], reference[k]) for k in reference if k.endswith("proj.weight"))  # it trained
    for key, ref in reference.items():
        assert float((saved[key] - ref).abs().max()) <= 1e-9 * max(1.0, float(ref.abs().max())), key


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_llama_worker_killed_mid_run_on_a_token_file_is_survived_exactly(tmp_path, monkeypatch) -> None:
    """Issue 24: the user's model and data together under a failure. An HF Llama (rotary, RMSNorm, GQA) trains on a
    nanoGPT-style uint16 token file; worker 1:1 is SIGKILLed before its fifth action of step 2; the survivors re-route
    its micro-batches and the final parameters equal the whole model trained in one process."""
    import numpy as np

    from recycle.api import train
    from recycle.runtime.tools.faults import FaultInjection

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    np.random.default_rng(3).integers(0, 256, size=8_000).astype(np.uint16).tofile(tmp_path / "train.bin")
    path = tmp_path / "hf.toml"
    path.write_text(TOML.format(hf=os.path.abspath(os.path.join(EXAMPLES, "hf-tiny-llama.json")))
                    .replace("steps = 2", 'steps = 4\ndataset = "train.bin"\ntoken_dtype = "uint16"'))
    cfg = load_config(path)
    save = tmp_path / "final.pt"
    result = train(cfg, schedule="zb-h1", max_failures=1, save_path=str(save), progress=None,
                   start_method="forkserver", faults=((cfg.topology.rank(1, 1), FaultInjection(1, 4, "kill")),))
    (recovery,) = result.recoveries
    assert recovery.workers == ("1:1",) and "killed by SIGKILL" in recovery.causes[0], recovery.causes
    assert [m.step for m in result.steps][-1] == 4 and result.failed == ((1, 1),)
    saved = torch.load(save, weights_only=True)["model"]
    reference, _ = reference_train(cfg)
    for key, ref in reference.items():
        assert float((saved[key] - ref).abs().max()) <= 1e-9 * max(1.0, float(ref.abs().max())), key


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_training_from_pretrained_weights_is_exact_against_the_reference_from_the_same_file(
        tmp_path, monkeypatch, family: str) -> None:
    from safetensors.torch import load_file

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = tmp_path / "pretrained"  # made here: a tiny model of another seed, saved as transformers does
    build_hf_model(os.path.join(EXAMPLES, f"hf-tiny-{family}.json"), 16, 123, torch.float64).model \
        .save_pretrained(folder)
    path = tmp_path / "hf.toml"
    path.write_text(TOML.format(hf=str(folder)))  # hf_config = the folder: its config.json and its weights
    cfg = load_config(path)
    file = {f"model.{k}": v for k, v in load_file(folder / "model.safetensors").items()}
    start, _ = reference_train(cfg, steps=0)
    assert sorted(start) == sorted(file) and all(torch.equal(start[k], file[k]) for k in file)  # the reference too
    save = tmp_path / "final.pt"
    launch(cfg, build_schedule(cfg, "zb-h1", staggered=True),
           LaunchOptions(outputs=OutputOptions(save_path=str(save)), cluster=ClusterOptions(start_method="forkserver"),
                         debug=DebugOptions(verify_replicas=True), progress=None))
    saved = torch.load(save, weights_only=True)["model"]
    reference, _ = reference_train(cfg)
    assert sorted(saved) == sorted(reference)
    assert all(not torch.equal(file[k], reference[k]) for k in reference if k.endswith("proj.weight"))  # it trained
    for key, ref in reference.items():
        assert float((saved[key] - ref).abs().max()) <= 1e-9 * max(1.0, float(ref.abs().max())), key


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_hf_writes_the_trained_model_as_transformers_loads_it(tmp_path, monkeypatch) -> None:
    import transformers
    from safetensors.torch import load_file

    from recycle.models.hf import hf_stages

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config_json = os.path.abspath(os.path.join(EXAMPLES, "hf-tiny-llama.json"))
    path = tmp_path / "hf.toml"
    path.write_text(TOML.format(hf=config_json))
    cfg = load_config(path)
    export = tmp_path / "export"
    export.mkdir()  # an empty folder is taken
    launch(cfg, build_schedule(cfg, "zb-h1", staggered=True),
           LaunchOptions(outputs=OutputOptions(export_hf=str(export)),
                         cluster=ClusterOptions(start_method="forkserver"), progress=None))
    assert sorted(os.listdir(tmp_path)) == ["export", "hf.toml"]  # no stage part or temporary folder left
    exported = {f"model.{k}": v for k, v in load_file(export / "model.safetensors").items()}
    reference, _ = reference_train(cfg)
    assert sorted(exported) == sorted(reference)
    for key, ref in reference.items():  # the trained weights (the pipeline is exact against the reference)
        assert float((exported[key] - ref).abs().max()) <= 1e-9 * max(1.0, float(ref.abs().max())), key
    stages = hf_stages(config_json, 2, 16, 0, torch.float64)
    for stage in stages:
        stage.load_state_dict({k: exported[k] for k in stage.state_dict()})
    loaded = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float64).eval()
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = stages[1](stages[0](tokens))
        assert torch.equal(loaded(input_ids=tokens).logits, ours)
