"""An ordinary PyTorch model split with torch.distributed.pipelining's `pipeline()` and `SplitPoint`s, trained on
D=2 x S=2 worker processes, then checked against the same model trained whole in this process (float64).

    python examples/pipelining_split.py      (~1 min on a laptop CPU; 4 worker processes)
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import recycle
from recycle.models.split import StageModel, causal_lm_loss, split_model
from recycle.runtime.worker.data import data_source
from recycle.runtime.worker.process import make_optimizer

CONFIG = {
    "topology": {"num_replicas": 2, "num_stages": 2},
    "workload": {"num_microbatches": 2, "microbatch_size": 2, "seq_len": 16},
    "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
    "training": {"steps": 3, "lr": 1e-2, "seed": 7, "dtype": "float64"},
}


class SmallLM(nn.Module):
    """Nothing here knows about pipelines: no stage classes, no boundary shapes."""

    def __init__(self, width: int = 24, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))
        self.head = nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def make_model(config) -> SmallLM:
    torch.manual_seed(config.training.seed)
    return SmallLM()


def stages(config, num_stages: int) -> StageModel:
    """The model factory every worker calls: pipeline() splits at blocks.2; the loss goes on the last stage."""
    example = torch.zeros(config.workload.microbatch_size, config.workload.seq_len, dtype=torch.long)
    return StageModel(tuple(split_model(make_model(config), ["blocks.2"], example)), causal_lm_loss)


def train_whole(config) -> dict[str, torch.Tensor]:
    """The same training, one process, the whole model: the D*M micro-batches of each step, loss scaled 1/(D*M)."""
    model = make_model(config).double()
    optimizer = make_optimizer(model, config.training)
    load = data_source(config)
    total = config.num_replicas * config.num_microbatches
    for step in range(config.training.steps):
        for mb in range(total):
            tokens, targets = load(step, mb)
            (causal_lm_loss(model(tokens), targets) / total).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model.state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/examples/pipelining_split")
    args = parser.parse_args()
    config = recycle.config_from_dict(CONFIG)
    save = f"{args.out}/final.pt"
    result = recycle.train(config, model_factory=stages, save_path=save, progress=None)
    print(f"trained {result.end_step} steps on {config.num_replicas}x{config.num_stages} workers; final loss "
          f"{result.steps[-1].loss:.4f}")
    trained = torch.load(save, weights_only=True)["model"]  # pipeline() keeps the model's parameter names
    whole = train_whole(config)
    worst = max(float((trained[k] - v).abs().max()) for k, v in whole.items())
    print(f"max difference to the whole model trained in one process: {worst:.1e} (float64)")
    if worst > 1e-9:
        raise SystemExit("the pipeline run does not match the single-process reference")


if __name__ == "__main__":
    main()
