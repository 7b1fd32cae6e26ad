"""Chaos for soak runs (`recycle train --chaos SEED,RATE`): seeded decisions of which worker to kill or freeze (with
tensor parallelism: which one of its T processes), when a whole stage goes, and how long a repair takes. Pure
decisions; the launcher carries them out with real signals."""

from __future__ import annotations

import random
from dataclasses import dataclass

from recycle.errors import ConfigError

__all__ = ["ChaosSpec", "ChaosEvent", "ChaosMonkey", "parse_chaos"]


@dataclass(frozen=True)
class ChaosSpec:
    seed: int
    rate: float  # failure events per completed step
    hang_share: float = 0.2  # of failures: a frozen worker (SIGSTOP) instead of a SIGKILL
    stage_loss_share: float = 0.1  # of failures: every live replica of one stage at once (needs a checkpoint)
    repair_s: tuple[float, float] = (0.5, 2.0)  # a dead worker is started again after a delay drawn from this range


@dataclass(frozen=True)
class ChaosEvent:
    kind: str  # "kill", "hang" or "stage-loss"
    ranks: tuple[int, ...]
    step: int  # completed steps when it was decided
    repair_after_s: tuple[float, ...]  # per rank: when its replacement is started
    tp_ranks: tuple[int, ...] = ()  # per rank, with T > 1: the one of its processes hit (the others are fenced)


def parse_chaos(text: str) -> ChaosSpec:
    """'7,0.5' -> ChaosSpec(seed=7, rate=0.5)."""
    parts = text.split(",")
    try:
        seed, rate = int(parts[0]), float(parts[1])
        if len(parts) != 2 or not 0 < rate <= 1:
            raise ValueError
    except (ValueError, IndexError):
        raise ConfigError(f"--chaos {text!r} must be SEED,RATE with an integer seed and 0 < RATE <= 1 failures per "
                          "step, e.g. --chaos 7,0.3") from None
    return ChaosSpec(seed, rate)


class ChaosMonkey:
    """Decides, once per completed step, whether something fails and what."""

    def __init__(self, spec: ChaosSpec, num_stages: int, tp_degree: int = 1) -> None:
        self.spec = spec
        self.num_stages = num_stages
        self.tp_degree = tp_degree
        self.rng = random.Random(spec.seed)

    def decide(self, step: int, live: list[int], can_lose_stage: bool) -> ChaosEvent | None:
        """An event for this step, or None. Never takes a stage's last replica except as a whole-stage loss, and
        only when the run can restore it (a complete checkpoint exists)."""
        if self.rng.random() >= self.spec.rate:
            return None
        by_stage: dict[int, list[int]] = {}
        for rank in live:
            by_stage.setdefault(rank % self.num_stages, []).append(rank)
        draw = self.rng.random()
        if can_lose_stage and draw < self.spec.stage_loss_share:
            stage = self.rng.choice(sorted(by_stage))
            ranks = tuple(by_stage[stage])
            return ChaosEvent("stage-loss", ranks, step, tuple(self._repair() for _ in ranks),
                              self._tp_ranks(len(ranks)))
        spare = [r for ranks in by_stage.values() if len(ranks) > 1 for r in ranks]
        if not spare:
            return None
        rank = self.rng.choice(sorted(spare))
        kind = "hang" if draw >= 1 - self.spec.hang_share else "kill"
        return ChaosEvent(kind, (rank,), step, (self._repair(),), self._tp_ranks(1))

    def _tp_ranks(self, count: int) -> tuple[int, ...]:
        """With T > 1, the process hit in each of `count` workers (drawn after the rest, so that T = 1 draws the
        same events as before)."""
        return tuple(self.rng.randrange(self.tp_degree) for _ in range(count)) if self.tp_degree > 1 else ()

    def _repair(self) -> float:
        low, high = self.spec.repair_s
        return self.rng.uniform(low, high)
