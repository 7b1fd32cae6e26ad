"""Tensor parallel inside a worker against data parallel at equal total processes: fault-free step period, side by
side in one run, with exactness against the single-process reference.

The fair comparison: the same model and the same global batch (D x M micro-batches) on the same number of processes,
the process budget spent either on data-parallel replicas (T=1) or on tensor-parallel ranks per worker (T=2):
  D=2 x S=2 x T=1, M=4   (4 processes: two pipelines, each stage's weights whole)
  D=1 x S=2 x T=2, M=8   (4 processes: one pipeline, each stage sharded over two ranks)
plus D=1 x S=2 x T=1, M=8 (2 processes) for what the second pair of processes buys either way.

Second part, stage-to-stage traffic between two T=2 workers (4 processes, gloo): the runtime's way, TP rank t sends
the whole (replicated) activation to TP rank t of the next stage, against Megatron's scatter-gather, each rank sends
its 1/T slice and the receivers all-gather it inside their worker. Timed per message over a range of sizes.

Honest expectations on this machine: TP is a GPU technique. On CPU gloo every row-parallel layer adds an all-reduce
in the forward and one in the backward (4 per transformer block per micro-batch, over loopback TCP), DTensor adds
Python dispatch to every sharded op, and the machine has 2 cores, so the T=2 rows measure that cost, not a speed-up.
The point is correctness and the recorded cost; the ratios say how large the cost is here.

Run: PYTHONPATH=src .venv/bin/python benchmarks/bench_tensor_parallel.py [--steps 6] [--layers 4] [--hidden 64]
[--heads 4] [--seq 32] [--rounds 1] [--traffic-only]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from recycle.config import Config, parse_config
from recycle.runtime.control.launcher import launch
from recycle.runtime.options import ClusterOptions, LaunchOptions, OutputOptions
from recycle.runtime.tools.reference import reference_train
from recycle.schedules.fault_free import build_schedule


@dataclass(frozen=True)
class Layout:
    D: int
    T: int
    M: int

    @property
    def name(self) -> str:
        return f"D={self.D} x S=2 x T={self.T}, M={self.M}"


LAYOUTS = (Layout(2, 1, 4), Layout(1, 2, 8), Layout(1, 1, 8))


def _config(args: argparse.Namespace, layout: Layout) -> Config:
    return parse_config({
        "topology": {"num_replicas": layout.D, "num_stages": 2, "gpus_per_worker": layout.T},
        "workload": {"num_microbatches": layout.M, "microbatch_size": 2, "seq_len": args.seq},
        "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
        "model": {"preset": "custom", "n_layer": args.layers, "n_embd": args.hidden, "n_head": args.heads,
                  "vocab_size": 256},
        "training": {"steps": args.steps, "lr": 0.01, "dtype": "float64", "seed": 3},
    }, name="bench-tensor-parallel")


def _run(config: Config, tmp: str) -> tuple[float, float]:
    """(median step period in s, skipping the first step; max relative error of the final weights vs reference)."""
    save = Path(tmp) / "final.pt"
    result = launch(config, build_schedule(config, "1f1b"), LaunchOptions(
        outputs=OutputOptions(save_path=str(save)), cluster=ClusterOptions(start_method="forkserver"), progress=None))
    got = torch.load(save, weights_only=True)["model"]
    ref, _ = reference_train(config)
    error = max(float((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)) for k in ref)
    return statistics.median(s.period_s for s in result.steps[1:]), error


TRAFFIC_ELEMENTS = (2 * 32 * 64, 4 * 128 * 256, 4 * 512 * 1024)  # float64 activations [batch, seq, hidden]


def _traffic_rank(rank: int, port: int, repeats: int, out: str) -> None:
    """World ranks 0, 1: the sending worker's TP ranks 0, 1; ranks 2, 3: the receiving worker's."""
    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.TCPStore("127.0.0.1", port, 4, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4, timeout=datetime.timedelta(seconds=60))
    receivers = dist.new_group([2, 3], timeout=datetime.timedelta(seconds=60))
    tp, sending = rank % 2, rank < 2
    peer = rank + 2 if sending else rank - 2
    results = {}
    for elements in TRAFFIC_ELEMENTS:
        whole = torch.randn(elements, dtype=torch.float64)
        times = {"pairwise": [], "scatter_gather": []}
        for _ in range(repeats):
            for mode in times:
                dist.barrier()
                start = time.perf_counter()
                if mode == "pairwise":
                    (dist.send if sending else dist.recv)(whole, peer)
                else:
                    part = whole.chunk(2)[tp].contiguous()
                    if sending:
                        dist.send(part, peer)
                    else:
                        dist.recv(part, peer)
                        parts = [torch.empty_like(part) for _ in range(2)]
                        dist.all_gather(parts, part, group=receivers)
                        torch.cat(parts)
                times[mode].append(time.perf_counter() - start)
        results[elements] = {mode: statistics.median(t) for mode, t in times.items()}
    if rank == 2:
        Path(out).write_text(json.dumps({str(k): v for k, v in results.items()}))
    dist.destroy_process_group()


def traffic(repeats: int = 30) -> list[dict[str, float]]:
    """Per-message time of the two ways (medians over `repeats`, the receiving TP rank 0's clock)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "traffic.json")
        port = 29700 + os.getpid() % 200
        mp.spawn(_traffic_rank, args=(port, repeats, out), nprocs=4)
        measured = json.loads(Path(out).read_text())
    rows = []
    for elements in TRAFFIC_ELEMENTS:
        times = measured[str(elements)]
        rows.append({"bytes": elements * 8, "pairwise_ms": times["pairwise"] * 1e3,
                     "scatter_gather_ms": times["scatter_gather"] * 1e3,
                     "ratio": times["scatter_gather"] / times["pairwise"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds (each number: the median)")
    parser.add_argument("--traffic-only", action="store_true", help="only the stage-to-stage traffic part")
    args = parser.parse_args()
    if not args.traffic_only:
        steps(args)
    print("stage-to-stage message between two T=2 workers, gloo loopback (median per message, receiver's clock):")
    print(f"{'bytes':>10s} {'rank t -> rank t, whole ms':>26s} {'1/T slices + all-gather ms':>27s} {'ratio':>6s}")
    rows = traffic()
    for row in rows:
        print(f"{row['bytes']:10d} {row['pairwise_ms']:26.3f} {row['scatter_gather_ms']:27.3f} {row['ratio']:6.2f}")
    print(json.dumps(rows))


def steps(args: argparse.Namespace) -> None:
    periods: dict[Layout, list[float]] = {layout: [] for layout in LAYOUTS}
    errors: dict[Layout, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):  # interleaved, so machine load hits every layout alike
            for layout in LAYOUTS:
                period, error = _run(_config(args, layout), tmp)
                periods[layout].append(period)
                errors[layout] = max(errors.get(layout, 0.0), error)
    print(f"GPT n_layer={args.layers} n_embd={args.hidden} n_head={args.heads}, seq {args.seq}, micro-batch 2, "
          f"global batch 8 micro-batches, 1F1B, float64, gloo on CPU, {args.steps} steps x {args.rounds} round(s)")
    base = statistics.median(periods[LAYOUTS[0]])
    print(f"{'layout':28s} {'processes':>9s} {'median period ms':>17s} {'x of row 1':>10s} {'max rel err vs ref':>19s}")
    rows = []
    for layout in LAYOUTS:
        period = statistics.median(periods[layout])
        rows.append({"layout": layout.name, "processes": layout.D * 2 * layout.T, "period_ms": period * 1e3,
                     "ratio": period / base, "max_rel_err": errors[layout]})
        print(f"{layout.name:28s} {layout.D * 2 * layout.T:9d} {period * 1e3:17.1f} {period / base:10.2f} "
              f"{errors[layout]:19.2e}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
