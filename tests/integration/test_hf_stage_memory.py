"""Per-stage construction: a worker building one stage of an 8-layer Hugging Face model grows its peak RSS by a
fraction of what building the whole model costs (each build measured in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")  # in requirements.txt; the optional extra 'hf' for users

CHILD = r"""
import json, sys, torch
def peak_kib():  # VmHWM: this address space's peak RSS, new at exec (ru_maxrss keeps the forking parent's peak)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
from recycle.models.hf import build_hf_model, hf_stage, load_hf_config
path, which = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
load_hf_config(path, 64)
before = peak_kib()
module = build_hf_model(path, 64, 0, torch.float32) if which == "whole" else hf_stage(path, 8, int(which), 64, 0,
                                                                                      torch.float32)
after = peak_kib()
print(json.dumps({"grown_kib": after - before, "params": sum(p.numel() for p in module.parameters())}))
"""


def _build(path: str, which: str) -> dict:
    src = os.path.join(os.path.dirname(__file__), "..", "..", "src")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.path.abspath(src)}
    out = subprocess.run([sys.executable, "-c", CHILD, path, which], env=env, check=True, capture_output=True,
                         text=True, timeout=240).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_stage_of_eight_costs_a_fraction_of_the_whole_model(tmp_path) -> None:
    path = tmp_path / "llama.json"
    # 8 layers of ~2.6 M parameters and 2 x 4.2 M of embedding and head: about 30 M parameters, 120 MB in float32.
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 8192, "hidden_size": 512,
                                "intermediate_size": 1280, "num_hidden_layers": 8, "num_attention_heads": 8,
                                "num_key_value_heads": 2, "max_position_embeddings": 64,
                                "tie_word_embeddings": False}))
    whole, middle = _build(str(path), "whole"), _build(str(path), "4")
    assert middle["params"] * 8 < whole["params"]
    # The whole model's tensors alone are ~115 MiB of growth; one middle stage holds ~9 % of the parameters.
    assert whole["grown_kib"] > 100 * 1024, whole
    assert middle["grown_kib"] < 0.3 * whole["grown_kib"], (middle, whole)
