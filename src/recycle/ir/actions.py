"""Plan actions (F, B, W, BW, OPT) and their compact text tokens, e.g. "2F7", "0BW3", "1OPT"."""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

from recycle.errors import PlanError

__all__ = ["Kind", "Action", "COMPUTE_KINDS", "BACKWARD_KINDS"]


class Kind(str, Enum):
    F = "F"  # forward
    B = "B"  # backward-input: the input-gradient, sent upstream (critical path)
    W = "W"  # backward-weight: the weight-gradient, deferrable into bubbles
    BW = "BW"  # fused backward (coupled B and W)
    OPT = "OPT"  # the stage's DP gradient all-reduce plus optimizer step, once per iteration

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.W, Kind.BW})
BACKWARD_KINDS = frozenset({Kind.B, Kind.BW})  # the actions that send an input-gradient upstream

_TOKEN = re.compile(r"^(\d+)(BW|OPT|F|B|W)(\d*)$")
_KINDS = {kind.value: kind for kind in Kind}  # a dict lookup: Kind(text) is an Enum call, a third of a plan's parse
# Parsed tokens: a plan read from JSON repeats the same few thousand tokens (Actions are immutable, so one object per
# token is shared); bounded so that no input grows it without limit.
_PARSED: dict[str, "Action"] = {}
_PARSED_LIMIT = 1 << 16


@dataclass(frozen=True, slots=True)
class Action:
    """One unit of work on one worker: `kind` of micro-batch `mb` at `stage` (mb = -1 for OPT)."""

    kind: Kind
    stage: int
    mb: int = -1

    def __str__(self) -> str:
        if self.kind is Kind.OPT:
            return f"{self.stage}OPT"
        return f"{self.stage}{self.kind.value}{self.mb}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @classmethod
    def parse(cls, token: str) -> "Action":
        """Inverse of str(): parse("2F7") == Action(Kind.F, 2, 7)."""
        known = _PARSED.get(token) if cls is Action else None
        if known is not None:
            return known
        action = cls._parse(token)
        if cls is Action and len(_PARSED) < _PARSED_LIMIT:
            _PARSED[token] = action
        return action

    @classmethod
    def _parse(cls, token: str) -> "Action":
        match = _TOKEN.match(token.strip())
        if not match:
            raise PlanError(
                f"action token {token!r} is malformed; expected <stage><kind><microbatch> with kind in "
                "F, B, W, BW (e.g. '2F7', '0BW3') or <stage>OPT (e.g. '1OPT')"
            )
        stage, kind, mb = match.groups()
        if kind == "OPT":
            if mb:
                raise PlanError(f"action token {token!r}: OPT takes no micro-batch; write '{stage}OPT'")
            return cls(Kind.OPT, int(stage))
        if not mb:
            raise PlanError(f"action token {token!r} needs a micro-batch id after {kind!r}, e.g. '{stage}{kind}0'")
        return cls(_KINDS[kind], int(stage), int(mb))
