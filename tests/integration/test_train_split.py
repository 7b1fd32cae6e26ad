"""Models split the PyTorch way: the stage modules of torch.distributed.pipelining's `pipeline()` with a
`loss_fn(output, targets)`, their boundary shapes found on the meta device, train exactly like the whole model in
one process (float64, 1e-9)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recycle.config import parse_config
from recycle.models.split import StageModel, causal_lm_loss, split_model
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import ClusterOptions, DebugOptions, LaunchOptions, OutputOptions
from recycle.runtime.worker.data import data_source
from recycle.runtime.worker.process import make_optimizer
from recycle.schedules.fault_free import build_schedule


class TinyLM(nn.Module):
    """An ordinary model: nothing in it knows about stages or boundary shapes."""

    def __init__(self, width: int = 16, depth: int = 4) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return self.head(x)


def make_model(config) -> TinyLM:
    torch.manual_seed(config.training.seed)
    return TinyLM()


def pipelined_tiny_lm(config, num_stages: int) -> StageModel:
    """The factory: split at the layers with pipeline(), the loss applied to the last stage's logits."""
    model = make_model(config)
    example = torch.zeros(config.workload.microbatch_size, config.workload.seq_len, dtype=torch.long)
    per_stage = len(model.layers) // num_stages
    points = [f"layers.{s * per_stage}" for s in range(1, num_stages)]
    return StageModel(tuple(split_model(model, points, example)), causal_lm_loss)


def config(num_stages: int = 2):
    return parse_config({
        "topology": {"num_replicas": 2, "num_stages": num_stages},
        "workload": {"num_microbatches": 2, "microbatch_size": 2, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "training": {"steps": 2, "lr": 0.01, "dtype": "float64", "seed": 3},
    }, name="split")


def whole_model_reference(cfg) -> dict[str, torch.Tensor]:
    model = make_model(cfg).double()
    optimizer = make_optimizer(model, cfg.training)
    load = data_source(cfg)
    total = cfg.num_replicas * cfg.num_microbatches
    for step in range(cfg.training.steps):
        for mb in range(total):
            tokens, targets = load(step, mb)
            (causal_lm_loss(model(tokens), targets) / total).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_pipelining_split_model_trains_like_the_whole_model(tmp_path) -> None:
    cfg = config()
    save = tmp_path / "final.pt"
    launch(cfg, build_schedule(cfg, "zb-h1", staggered=True),
           LaunchOptions(model_factory=f"{__name__}:pipelined_tiny_lm", outputs=OutputOptions(save_path=str(save)),
                         cluster=ClusterOptions(start_method="forkserver"), debug=DebugOptions(verify_replicas=True),
                         progress=None))
    saved = torch.load(save, weights_only=True)["model"]  # pipeline() keeps the model's names: one state dict
    reference = whole_model_reference(cfg)
    assert sorted(saved) == sorted(reference)
    for key, ref in reference.items():
        assert float((saved[key] - ref).abs().max()) <= 1e-9 * max(1.0, float(ref.abs().max())), key
