"""Training data: a built-in byte-level corpus (generated, no download) or a UTF-8 text file, and the
deterministic micro-batch sampler every worker uses to load any micro-batch of any iteration."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from recycle.errors import ConfigError

if TYPE_CHECKING:
    from recycle.config import Config

__all__ = ["TextDataset", "builtin_corpus", "load_dataset", "config_dataset", "microbatch", "BUILTIN"]

BUILTIN = "builtin"
_MASK64 = (1 << 64) - 1

# A small vocabulary and sentence grammar: enough structure (word spelling, agreement, punctuation) that the loss
# visibly falls within a few hundred steps of the tiny model, and it is identical on every Python version.
_SUBJECTS = ("the worker", "a pipeline", "the stage", "every replica", "the planner", "a micro-batch", "the optimizer",
             "the coordinator", "each peer", "the scheduler", "a bubble", "the gradient")
_VERBS = ("sends", "receives", "computes", "reroutes", "stashes", "reduces", "waits for", "fills", "skips",
          "replays", "steps over", "checks")
_OBJECTS = ("the activation", "its gradient", "the weights", "a message", "the next batch", "an idle slot",
            "the failed worker", "the plan", "every stage", "the loss", "the bubble", "a checkpoint")
_TAILS = (".", ".", ".", "!", " again.", " quickly.", " in order.", " before the step.", " after the barrier.")


def _splitmix64(x: int) -> int:
    """A tiny, well-mixed 64-bit hash (SplitMix64); independent of Python's and torch's RNGs."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def builtin_corpus(num_sentences: int = 8000, seed: int = 1234) -> bytes:
    """The built-in corpus: `num_sentences` generated English-like sentences (about 40 bytes each)."""
    parts = []
    state = seed
    for i in range(num_sentences):
        state = _splitmix64(state + i)
        s, v, o, t = (state & 0xFF) % len(_SUBJECTS), ((state >> 8) & 0xFF) % len(_VERBS), \
            ((state >> 16) & 0xFF) % len(_OBJECTS), ((state >> 24) & 0xFF) % len(_TAILS)
        sentence = f"{_SUBJECTS[s]} {_VERBS[v]} {_OBJECTS[o]}{_TAILS[t]}"
        parts.append(sentence[0].upper() + sentence[1:])
        parts.append("\n" if (state >> 32) % 5 == 0 else " ")
    return "".join(parts).encode("utf-8")


@dataclass(frozen=True)
class TextDataset:
    """A byte sequence as a 1-D int64 tensor, and where it came from."""

    tokens: torch.Tensor
    source: str

    def __len__(self) -> int:
        return int(self.tokens.numel())


def load_dataset(dataset: str, seq_len: int, base_dir: str | Path | None = None) -> TextDataset:
    """`dataset` is "builtin" or a path to a UTF-8 text file (relative paths resolve against `base_dir`)."""
    if dataset == BUILTIN:
        data, source = builtin_corpus(), BUILTIN
    else:
        path = Path(dataset)
        if not path.is_absolute() and base_dir is not None and not path.exists():
            path = Path(base_dir) / path
        if not path.is_file():
            raise ConfigError(f"[training] dataset = {dataset!r} is not a file; give a path to a UTF-8 text file "
                              "or \"builtin\"")
        data = path.read_bytes()
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ConfigError(f"[training] dataset = {dataset!r} is not UTF-8 text ({exc}); convert it to UTF-8 "
                              "or use \"builtin\"") from None
        source = str(path)
    if len(data) < seq_len + 2:
        raise ConfigError(f"dataset {source!r} has {len(data)} bytes but [workload] seq_len = {seq_len} needs at "
                          f"least {seq_len + 2}; use a longer text or a shorter seq_len")
    return TextDataset(torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64), source)


def config_dataset(config: Config) -> TextDataset:
    """The config's `[training] dataset` for its `[workload] seq_len`; a relative path is looked up beside the
    config file too."""
    return load_dataset(config.training.dataset, config.workload.seq_len,
                        base_dir=os.path.dirname(config.source) or None)


def microbatch(dataset: TextDataset, iteration: int, mb: int, microbatch_size: int,
               seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, targets), each [microbatch_size, seq_len]; a pure function of (iteration, mb), so any worker can
    load any micro-batch and a re-routed micro-batch sees exactly the data its owner would have."""
    span = len(dataset) - seq_len - 1
    rows = []
    for sample in range(microbatch_size):
        key = _splitmix64((iteration << 40) ^ (mb << 20) ^ sample)
        rows.append(key % span)
    offsets = torch.tensor(rows, dtype=torch.int64)
    index = offsets[:, None] + torch.arange(seq_len + 1)[None, :]
    window = dataset.tokens[index]
    return window[:, :-1].contiguous(), window[:, 1:].contiguous()
