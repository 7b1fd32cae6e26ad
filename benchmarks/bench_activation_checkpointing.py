"""Activation checkpointing: the memory a micro-batch keeps against the recompute it costs, per mode, side by side.

For each [model] activation_checkpointing mode ("none", "full", "per_layer") the profiler (the one `recycle profile`
runs) drives the runtime's StageExecutor on every stage of the same model, one thread, and measures:
- kept: the bytes a micro-batch holds between its actions (F to W): the tensors autograd saves, counted by
  torch.autograd.graph.saved_tensors_hooks during a real F, plus the stage input, output and output-gradient;
- rebuilt: what one B or W rebuilds at a time (the largest checkpointed region's saved tensors);
- F, B, W: median action times (B and W include the recompute).
The modes are measured in interleaved rounds (none, full, per_layer, none, ...), each number the median over rounds,
so machine load hits them alike. Printed per stage and summed over stages, with ratios against "none", and how many
live micro-batches a worker budget of 4 unchecked micro-batches admits (the planner's cap,
recycle.planner.memory_cap). The last line is JSON.

Run: .venv/bin/python benchmarks/bench_activation_checkpointing.py [--layers 8] [--hidden 128] [--seq 128]
[--batch 4] [--stages 2] [--rounds 3] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import replace

import torch

from recycle.config import CHECKPOINTING_MODES, Config, parse_config
from recycle.runtime.tools.profiler import StageProfile, profile_stages

KIB = 1024


def _config(args: argparse.Namespace) -> Config:
    return parse_config({
        "topology": {"num_replicas": 1, "num_stages": args.stages},
        "workload": {"num_microbatches": 4, "microbatch_size": args.batch, "seq_len": args.seq},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"n_layer": args.layers, "n_embd": args.hidden, "n_head": max(1, args.hidden // 64),
                  "vocab_size": 256},
        "training": {"dtype": "float32"},
    }, name="bench-activation-checkpointing")


def _median_profile(runs: list[StageProfile]) -> dict[str, float]:
    return {key: statistics.median(getattr(r, key) for r in runs)
            for key in ("forward_us", "backward_input_us", "backward_weight_us", "activation_bytes", "recompute_bytes")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)  # as a worker runs
    config = _config(args)
    runs: dict[str, list[tuple[StageProfile, ...]]] = {mode: [] for mode in CHECKPOINTING_MODES}
    for _ in range(args.rounds):
        for mode in CHECKPOINTING_MODES:
            moded = replace(config, model=replace(config.model, activation_checkpointing=mode))
            runs[mode].append(profile_stages(moded, repeats=args.repeats, warmup=2))
    S = args.stages
    per_stage = {mode: [_median_profile([r[s] for r in runs[mode]]) for s in range(S)] for mode in CHECKPOINTING_MODES}

    print(f"built-in GPT: {args.layers} layers, hidden {args.hidden}, micro-batch {args.batch} x {args.seq} tokens, "
          f"float32, {S} stages; medians of {args.rounds} interleaved rounds x {args.repeats} repeats, 1 thread")
    print(f"{'mode':>10} {'stage':>5} {'kept KiB':>9} {'rebuilt KiB':>11} {'F ms':>7} {'B ms':>7} {'W ms':>7}")
    for mode in CHECKPOINTING_MODES:
        for s, p in enumerate(per_stage[mode]):
            print(f"{mode:>10} {s:>5} {p['activation_bytes'] / KIB:9.1f} {p['recompute_bytes'] / KIB:11.1f} "
                  f"{p['forward_us'] / 1e3:7.2f} {p['backward_input_us'] / 1e3:7.2f} "
                  f"{p['backward_weight_us'] / 1e3:7.2f}")

    summary = {}
    base = per_stage["none"]
    budget = [4 * p["activation_bytes"] for p in base]  # per stage: room for 4 unchecked micro-batches
    for mode in CHECKPOINTING_MODES:
        stages = per_stage[mode]
        kept = sum(p["activation_bytes"] for p in stages)
        compute = sum(p["forward_us"] + p["backward_input_us"] + p["backward_weight_us"] for p in stages)
        caps = [int(max(1, (b - p["recompute_bytes"]) // max(1, p["activation_bytes"])))
                for b, p in zip(budget, stages)]
        summary[mode] = {"kept_bytes_per_microbatch": int(kept),
                         "rebuilt_bytes": [int(p["recompute_bytes"]) for p in stages],
                         "fbw_ms_per_microbatch": round(compute / 1e3, 3), "cap_at_4_unchecked": caps}
    print(f"\n{'mode':>10} {'kept KiB/mb':>12} {'kept vs none':>13} {'F+B+W ms/mb':>12} {'time vs none':>13} "
          f"{'cap (budget = 4 unchecked)':>27}")
    for mode, row in summary.items():
        kept_ratio = row["kept_bytes_per_microbatch"] / summary["none"]["kept_bytes_per_microbatch"]
        time_ratio = row["fbw_ms_per_microbatch"] / summary["none"]["fbw_ms_per_microbatch"]
        row["kept_vs_none"], row["time_vs_none"] = round(kept_ratio, 4), round(time_ratio, 3)
        print(f"{mode:>10} {row['kept_bytes_per_microbatch'] / KIB:12.1f} {kept_ratio:12.3f}x "
              f"{row['fbw_ms_per_microbatch']:12.2f} {time_ratio:12.2f}x {str(row['cap_at_4_unchecked']):>27}")
    print(json.dumps({"bench": "activation_checkpointing", "layers": args.layers, "hidden": args.hidden,
                      "seq": args.seq, "batch": args.batch, "stages": S, "modes": summary}))


if __name__ == "__main__":
    main()
