"""Hugging Face models: a GPT-2-shaped causal LM built from a config JSON (random init, nothing downloaded), split by
decoder layers, trains on D x S processes to the parameters of the same HF model trained whole in one process."""

from __future__ import annotations

import os

import pytest
import torch

from recycle.config import load_config
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import ClusterOptions, DebugOptions, LaunchOptions, OutputOptions
from recycle.runtime.tools.reference import reference_train
from recycle.schedules.fault_free import build_schedule

pytest.importorskip("transformers")  # in requirements.txt; the optional extra 'hf' for users

HF_JSON = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "hf-tiny-gpt2.json")
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
def test_a_hugging_face_gpt2_trains_like_the_whole_model_in_one_process(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = tmp_path / "hf.toml"
    path.write_text(TOML.format(hf=os.path.abspath(HF_JSON)))
    cfg = load_config(path)
    save = tmp_path / "final.pt"
    launch(cfg, build_schedule(cfg, "zb-h1", staggered=True),
           LaunchOptions(outputs=OutputOptions(save_path=str(save)), cluster=ClusterOptions(start_method="forkserver"),
                         debug=DebugOptions(verify_replicas=True), progress=None))
    saved = torch.load(save, weights_only=True)["model"]  # the stages keep the HF model's names
    reference, _ = reference_train(cfg)
    assert sorted(saved) == sorted(reference)
    assert any(k.startswith("model.transformer.h.3.") for k in saved)
    for key, ref in reference.items():
        assert float((saved[key] - ref).abs().max()) <= 1e-9 * max(1.0, float(ref.abs().max())), key
