"""The built-in corpus: generated English-like sentences (no download), the same bytes on every Python version."""

from __future__ import annotations

__all__ = ["builtin_corpus", "splitmix64"]

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


def splitmix64(x: int) -> int:
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
        state = splitmix64(state + i)
        s, v, o, t = (state & 0xFF) % len(_SUBJECTS), ((state >> 8) & 0xFF) % len(_VERBS), \
            ((state >> 16) & 0xFF) % len(_OBJECTS), ((state >> 24) & 0xFF) % len(_TAILS)
        sentence = f"{_SUBJECTS[s]} {_VERBS[v]} {_OBJECTS[o]}{_TAILS[t]}"
        parts.append(sentence[0].upper() + sentence[1:])
        parts.append("\n" if (state >> 32) % 5 == 0 else " ")
    return "".join(parts).encode("utf-8")
