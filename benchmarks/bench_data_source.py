"""The data source's cost per micro-batch against torch.utils.data reading the same memmap, side by side in one run.

Both read (seq_len + 1)-token windows of one nanoGPT-style uint16 token file and return int64 (inputs, targets):
- recycle: the DataSource of `[training] dataset = FILE, token_dtype = "uint16"` (TokenWindows: offsets hashed
  from (iteration, mb), each window read with pread), called as a worker calls it;
- torch: a map-style torch.utils.data.Dataset over np.memmap (nanoGPT's window slicing), batched by a DataLoader
  (num_workers=0, the same per-call work in the calling process) with a seeded RandomSampler.
Each mode runs a warm-up pass first (the file is then in the page cache for both), then is timed over N micro-batches;
the table gives microseconds per micro-batch and recycle's ratio to torch (below 1: recycle is cheaper).

Run: .venv/bin/python benchmarks/bench_data_source.py [--tokens 100000000] [--batches 300]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, RandomSampler

from recycle.config import parse_config
from recycle.runtime.worker.data import data_source

SHAPES = ((8, 256), (8, 1024), (32, 1024), (16, 4096))  # (microbatch_size, seq_len)


class MemmapWindows(Dataset):
    """Window i of the token file: tokens [i, i + seq_len + 1) as (inputs, targets), as nanoGPT slices its memmap."""

    def __init__(self, path: Path, seq_len: int) -> None:
        self.data = np.memmap(path, dtype=np.uint16, mode="r")
        self.seq_len = seq_len

    def __len__(self) -> int:
        return len(self.data) - self.seq_len - 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = torch.from_numpy(self.data[i:i + self.seq_len + 1].astype(np.int64))
        return window[:-1], window[1:]


def config(path: Path, size: int, seq: int):
    return parse_config({"topology": {"num_replicas": 1, "num_stages": 1},
                         "workload": {"num_microbatches": 4, "microbatch_size": size, "seq_len": seq},
                         "costs": {"forward": 1, "backward_input": 1, "backward_weight": 1},
                         "training": {"dataset": str(path), "token_dtype": "uint16"}})


def time_recycle(path: Path, size: int, seq: int, batches: int) -> float:
    load = data_source(config(path, size, seq))
    for i in range(batches):  # warm-up: the same windows the timed pass reads
        load(0, i)
    t0 = time.perf_counter()
    for i in range(batches):
        load(0, i)
    return (time.perf_counter() - t0) / batches


def time_torch(path: Path, size: int, seq: int, batches: int) -> float:
    data = MemmapWindows(path, seq)

    def loader() -> DataLoader:
        sampler = RandomSampler(data, replacement=True, num_samples=size * batches,
                                generator=torch.Generator().manual_seed(0))
        return DataLoader(data, batch_size=size, sampler=sampler, num_workers=0)

    for _ in loader():  # warm-up over the same windows
        pass
    t0 = time.perf_counter()
    for _ in loader():
        pass
    return (time.perf_counter() - t0) / batches


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=100_000_000, help="uint16 ids in the token file (default 100 M)")
    p.add_argument("--batches", type=int, default=300, help="micro-batches timed per mode and shape")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "train.bin"
        rng = np.random.default_rng(0)
        with open(path, "wb") as f:
            for start in range(0, args.tokens, 1 << 24):
                rng.integers(0, 50257, size=min(1 << 24, args.tokens - start), dtype=np.uint16).tofile(f)
        print(f"token file: {args.tokens:,} uint16 ids ({path.stat().st_size / 2**20:,.0f} MiB), "
              f"{args.batches} micro-batches per mode and shape")
        print(f"{'micro-batch':>14} {'recycle us':>11} {'torch us':>10} {'ratio':>7}")
        for size, seq in SHAPES:
            ours = time_recycle(path, size, seq, args.batches)
            theirs = time_torch(path, size, seq, args.batches)
            print(f"{f'{size} x {seq}':>14} {ours * 1e6:>11.1f} {theirs * 1e6:>10.1f} {ours / theirs:>7.2f}")


if __name__ == "__main__":
    main()
