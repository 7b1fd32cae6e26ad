"""The built-in sources' sampler: micro-batches of (seq_len + 1)-token windows of a token stream, each a pure
function of (iteration, micro-batch), in one of two orders, from the training part or the held-out tail."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from recycle.data.corpus import builtin_corpus, splitmix64
from recycle.data.tokens import TokenStream, check_length, stream_of_bytes
from recycle.errors import ConfigError

__all__ = ["ORDERS", "SPLITS", "TokenWindows", "builtin_windows", "permute"]

# "random": each sample a window at an offset hashed from (iteration, mb, sample), overlapping, with replacement
# (the seed does not enter; the micro-batches every earlier run trained on). "epochs": the stream cut into
# disjoint windows, each epoch visiting every window once in an order permuted from (seed, epoch).
ORDERS = ("random", "epochs")
SPLITS = ("train", "eval")  # eval: the held-out tail, windows in file order (the same every evaluation)
_MASK64 = (1 << 64) - 1


def permute(index: int, n: int, key: int) -> int:
    """A bijection of [0, n) chosen by `key`, evaluated at `index` without building it (a 4-round Feistel network
    on the smallest even number of bits that covers n, cycle-walking out-of-range values back in), so an epoch's
    order costs no memory whatever the corpus size."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    x = index
    while True:
        left, right = x >> half, x & mask
        for round_ in range(4):
            left, right = right, left ^ (splitmix64(right ^ ((key + round_ * 0x9E3779B97F4A7C15) & _MASK64)) & mask)
        x = (left << half) | right
        if x < n:
            return x


@dataclass(frozen=True)
class TokenWindows:
    """A DataSource over a token stream: (inputs, targets), each int64 [microbatch_size, seq_len], targets the
    inputs shifted by one token. `per_iteration` is the micro-batches of one iteration over all replicas (D x M),
    so the epochs order numbers every sample of the run once. The last `eval_fraction` of the stream is held out:
    the train split never reads it, the eval split reads only it."""

    stream: TokenStream
    microbatch_size: int
    seq_len: int
    per_iteration: int
    order: str = "random"
    seed: int = 0
    eval_fraction: float = 0.0
    split: str = "train"

    def __post_init__(self) -> None:
        if self.order not in ORDERS or self.split not in SPLITS:
            raise ValueError(f"order {self.order!r} / split {self.split!r}: not one of {ORDERS} / {SPLITS}")
        held = int(len(self.stream) * self.eval_fraction)
        seq = self.seq_len
        check_length(self.stream, seq + 2 + held, f"[workload] seq_len = {seq}" +
                     (f" with [training] eval_fraction = {self.eval_fraction} ({held} held out)" if held else ""))
        if self.eval_fraction > 0 and held < seq + 1:
            raise ConfigError(f"dataset {self.stream.source!r}: [training] eval_fraction = {self.eval_fraction} holds "
                              f"out {held} {self.stream.unit}, fewer than one window of seq_len + 1 = {seq + 1}; "
                              "use a larger eval_fraction or a longer corpus")

    @property
    def _bounds(self) -> tuple[int, int]:
        """[start, end) of this split's part of the stream."""
        n = len(self.stream)
        cut = n - int(n * self.eval_fraction)
        return (0, cut) if self.split == "train" else (cut, n)

    def _offsets(self, iteration: int, mb: int) -> list[int]:
        start, end = self._bounds
        size, seq = self.microbatch_size, self.seq_len
        if self.split == "train" and self.order == "random":
            span = end - start - seq - 1
            return [start + splitmix64((iteration << 40) ^ (mb << 20) ^ sample) % span for sample in range(size)]
        windows = (end - start - 1) // seq
        first = (iteration * self.per_iteration + mb) * size
        if self.split == "eval":
            return [start + (g % windows) * seq for g in range(first, first + size)]
        out = []
        for g in range(first, first + size):
            epoch, position = divmod(g, windows)
            out.append(start + permute(position, windows, splitmix64((self.seed << 32) ^ epoch)) * seq)
        return out

    def __call__(self, iteration: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
        stream, span = self.stream, self.seq_len + 1
        window = np.stack([stream.read(o, span) for o in self._offsets(iteration, mb)]).astype(np.int64)
        # numpy's copies, not torch's .contiguous(): torch parallelises a copy this size over its intra-op threads,
        # which costs milliseconds on a busy host (a worker's compute threads are busy).
        inputs, targets = np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])
        return torch.from_numpy(inputs), torch.from_numpy(targets)


def builtin_windows(microbatch_size: int, seq_len: int) -> TokenWindows:
    """The built-in corpus in the default order, for any micro-batch shape (what a config that leaves the
    [training] data keys out trains on, at its own shape)."""
    return TokenWindows(stream_of_bytes(builtin_corpus(), "builtin"), microbatch_size, seq_len, per_iteration=1)
