"""A Hugging Face GPT-2-shaped model (tiny config, random init, nothing downloaded) split by decoder layers and
trained on D=2 x S=2 worker processes, then checked against the same HF model trained whole in this process.
Needs the extra: pip install 'recycle[hf]'. The CLI equivalent: recycle train --config C --hf examples/hf-tiny-gpt2.json

    python examples/hf_gpt2.py      (~1 min on a laptop CPU; 4 worker processes)
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched: the model is built from its config

import torch  # noqa: E402

import recycle  # noqa: E402
from recycle.runtime.tools.reference import reference_train  # noqa: E402

HERE = Path(__file__).resolve().parent
CONFIG = {
    "topology": {"num_replicas": 2, "num_stages": 2},
    "workload": {"num_microbatches": 2, "microbatch_size": 2, "seq_len": 16},
    "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
    "model": {"hf_config": str(HERE / "hf-tiny-gpt2.json")},
    "training": {"steps": 2, "lr": 1e-2, "seed": 0, "dtype": "float64"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/examples/hf_gpt2")
    args = parser.parse_args()
    config = recycle.config_from_dict(CONFIG)
    save = f"{args.out}/final.pt"
    result = recycle.train(config, save_path=save, progress=None)
    print(f"trained {result.end_step} steps; losses {', '.join(f'{m.loss:.4f}' for m in result.steps)}")
    trained = torch.load(save, weights_only=True)["model"]  # names as in the HF model: model.transformer.h.0...
    whole, _ = reference_train(config)
    worst = max(float((trained[k] - v).abs().max()) for k, v in whole.items())
    print(f"{len(trained)} tensors; max difference to the HF model trained whole in one process: {worst:.1e}")
    if worst > 1e-9:
        raise SystemExit("the pipeline run does not match the single-process reference")


if __name__ == "__main__":
    main()
