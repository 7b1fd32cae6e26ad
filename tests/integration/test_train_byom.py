"""Bring your own model: stage modules from a user factory train exactly like the same stages chained in one
process (per-stage AdamW, the same micro-batches, loss scaled 1/(D*M))."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from recycle.config import parse_config
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import ClusterOptions, DebugOptions, LaunchOptions, OutputOptions
from recycle.runtime.state.optim import AdamW
from recycle.runtime.worker.data import data_source
from recycle.schedules.fault_free import build_schedule


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(256, 16)
        self.lin = nn.Linear(16, 16)

    def boundary_shape(self, batch: int, seq: int) -> tuple[int, ...]:
        return (batch, seq, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(self.emb(tokens)))


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 256)  # same parameter name as _Embed.lin: the merged save keeps stages apart

    def boundary_shape(self, batch: int, seq: int) -> tuple[int, ...]:
        return (batch, seq, 256)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.lin(x)
        return F.cross_entropy(logits.view(-1, 256), targets.reshape(-1))


def two_stage_mlp(config, num_stages: int) -> list[nn.Module]:
    """The factory: deterministic in the seed, like build_stages."""
    torch.manual_seed(config.training.seed)
    return [_Embed(), _Head()]


def config():
    return parse_config({
        "topology": {"num_replicas": 2, "num_stages": 2},
        "workload": {"num_microbatches": 2, "microbatch_size": 2, "seq_len": 8},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "training": {"steps": 2, "lr": 0.01, "dtype": "float64", "seed": 5},
    }, name="byom")


def chained_reference(cfg) -> list[dict[str, torch.Tensor]]:
    stages = [s.double() for s in two_stage_mlp(cfg, 2)]
    optimizers = [AdamW(s.parameters(), lr=cfg.training.lr, weight_decay=cfg.training.weight_decay) for s in stages]
    load = data_source(cfg)
    total = cfg.num_replicas * cfg.num_microbatches
    for step in range(cfg.training.steps):
        for mb in range(total):
            tokens, targets = load(step, mb)
            (stages[1](stages[0](tokens), targets) / total).backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
    return [s.state_dict() for s in stages]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_user_factory_trains_like_the_chained_stages(tmp_path) -> None:
    cfg = config()
    save = tmp_path / "final.pt"
    launch(cfg, build_schedule(cfg, "zb-h1", staggered=True),
           LaunchOptions(model_factory=f"{__name__}:two_stage_mlp", outputs=OutputOptions(save_path=str(save)),
                         cluster=ClusterOptions(start_method="forkserver"), debug=DebugOptions(verify_replicas=True),
                         progress=None))
    saved = torch.load(save, weights_only=True)
    assert saved["model"] is None  # both stages have a parameter named lin.weight
    for got, ref in zip(saved["stages"], chained_reference(cfg)):
        for key in ref:
            assert float((got[key] - ref[key]).abs().max()) < 1e-12, key
