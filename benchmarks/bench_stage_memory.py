"""Peak RSS of building one stage of a model against building the whole model, side by side in one run: a Hugging
Face Llama (default), or the built-in GPT (--builtin).

Each measurement runs in a fresh interpreter: import transformers and read the config (the baseline peak RSS), then
build, then read the peak RSS again (VmHWM: getrusage's ru_maxrss would keep the parent's peak across
exec); the table gives the growth over the baseline.
- whole: `build_hf_model` (every tensor), which is also what a worker allocated before per-stage construction
  (it built the whole model and kept its slice);
- stage s alone: `hf_stage(path, S, s, ...)`, what a worker builds now: the model laid out on the meta device and
  only stage s's tensors allocated and initialised.
The default config is a Llama of 8 decoder layers, hidden 768, 12 query / 4 key-value heads, MLP 2048, vocabulary
32,000 (about 100 M parameters, float32), split into S = 8 stages: the first stage has the embedding, the last the
output head, a middle one a decoder layer only.

With --pretrained the model is first saved with save_pretrained (one model.safetensors), and every measurement
starts from those weights: the whole model read from the file, against one stage reading only its own tensors.
With --tied the Llama ties its word embeddings: the last stage then also holds its copy of the embedding (as its
lm_head weight), so its stage is the same size as untied.

With --builtin the model is the built-in GPT of the same depth, width and vocabulary: `full_model` (what every worker
built before per-stage construction, then kept its slice) against `models.gpt.build_stage` (only the
stage's tensors allocated, in the run's dtype, each initialised from its own (seed, name) stream).

Run: .venv/bin/python benchmarks/bench_stage_memory.py [--hidden 768] [--layers 8] [--vocab 32000] [--stages 8]
[--pretrained] [--tied] [--builtin] (--hidden 3072: about 1.0 B parameters, 4 GB in float32 for the whole model)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

MIB = 1024 * 1024

CHILD = r"""
import json, sys, torch
def peak_kib():  # VmHWM: this address space's peak RSS, new at exec (ru_maxrss keeps the forking parent's peak)
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:"))
path, stages, which, weights = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4] or None
torch.set_num_threads(1)
if path.endswith(".json"):
    from recycle.models.hf import build_hf_model, hf_stage, load_hf_config
    load_hf_config(path, 64)
    before = peak_kib()
    if which == "whole":
        module = build_hf_model(path, 64, 0, torch.float32, weights)
    else:
        module = hf_stage(path, stages, int(which), 64, 0, torch.float32, weights)
else:  # the built-in GPT: "layers,hidden,vocab"
    from recycle.config import ModelSpec
    from recycle.models.gpt import build_stage, full_model
    n_layer, n_embd, vocab = (int(v) for v in path.split(","))
    spec = ModelSpec(preset="custom", vocab_size=vocab, n_layer=n_layer, n_head=n_embd // 64, n_embd=n_embd)
    before = peak_kib()
    if which == "whole":
        module = full_model(spec, 64, 0, torch.float32)
    else:
        module = build_stage(spec, stages, int(which), 0, torch.float32, 64)
after = peak_kib()
params = sum(p.numel() for p in module.parameters())
print(json.dumps({"grown_kib": after - before, "params": params}))
"""

SAVE = r"""
import sys, torch
from recycle.models.hf import build_hf_model
build_hf_model(sys.argv[1], 64, 1, torch.float32).model.save_pretrained(sys.argv[2])
"""


def measure(path: str, stages: int, which: str, weights: str = "") -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", CHILD, path, str(stages), which, weights], env=env, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--stages", type=int, default=8)
    parser.add_argument("--pretrained", action="store_true",
                        help="start every build from the model's weights saved with save_pretrained")
    parser.add_argument("--tied", action="store_true", help="the Llama ties its word embeddings")
    parser.add_argument("--builtin", action="store_true", help="measure the built-in GPT instead of a Llama")
    args = parser.parse_args()
    if args.builtin:
        report(f"{args.layers},{args.hidden},{args.vocab}", args.stages,
               f"built-in GPT: {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab:,}")
        return
    heads = args.hidden // 64
    config = {"model_type": "llama", "vocab_size": args.vocab, "hidden_size": args.hidden,
              "intermediate_size": args.hidden * 8 // 3 // 256 * 256 or 256, "num_hidden_layers": args.layers,
              "num_attention_heads": heads,
              "num_key_value_heads": next(d for d in range(max(1, heads // 3), 0, -1) if heads % d == 0),
              "max_position_embeddings": 64, "tie_word_embeddings": args.tied}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama.json")
        with open(path, "w") as f:
            json.dump(config, f)
        weights = ""
        if args.pretrained:  # in a process of its own: Linux keeps a process's peak RSS across exec into children
            weights = os.path.join(tmp, "pretrained")
            subprocess.run([sys.executable, "-c", SAVE, path, weights], env={**os.environ, "HF_HUB_OFFLINE": "1"},
                           check=True, capture_output=True)
        start = "from the saved weights" if weights else "random init"
        report(path, args.stages, f"Llama: {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab:,}, "
               f"{'tied' if args.tied else 'untied'} embeddings; {start}", weights)


def report(path: str, stages: int, what: str, weights: str = "") -> None:
    """The table: the whole model, then the first, a middle and the last stage, each built alone."""
    whole = measure(path, stages, "whole", weights)
    print(f"{what}; {whole['params']:,} parameters (float32); S = {stages}")
    print(f"{'built':<16} {'parameters':>12} {'peak RSS growth MiB':>20} {'ratio to whole':>15}")
    print(f"{'whole model':<16} {whole['params']:>12,} {whole['grown_kib'] / 1024:>20.1f} {1.0:>15.3f}")
    for s in sorted({0, stages // 2, stages - 1}):
        stage = measure(path, stages, str(s), weights)
        print(f"{f'stage {s} alone':<16} {stage['params']:>12,} {stage['grown_kib'] / 1024:>20.1f} "
              f"{stage['grown_kib'] / whole['grown_kib']:>15.3f}")


if __name__ == "__main__":
    main()
