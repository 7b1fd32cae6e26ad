"""The runtime's layout rules on the job simulator's grid: where a returning worker goes, and how a lost stage is
refilled by moves within pipelines (recycle.runtime.control.coordinator: Repairs, _balancing_moves)."""

from __future__ import annotations

from recycle.traces.model import StageLayout

__all__ = ["Slot", "balancing_moves", "return_slot"]

Slot = tuple[int, int]  # (replica, stage)


def balancing_moves(layout: StageLayout) -> list[tuple[Slot, Slot]]:
    """Move placed units until the stages' worker counts differ by at most one, as the coordinator does when a stage
    lost every replica: repeatedly, of the units in the fullest stages (ties: the lowest stage, then the highest
    rank r * S + s) whose own pipeline has a free slot in the emptiest stage (ties: the lowest), one moves there
    while the two counts differ by two or more. Applies the moves to `layout` and returns them (from, to)."""
    S = layout.num_stages
    moves: list[tuple[Slot, Slot]] = []
    while True:
        counts = [0] * S
        for _, s in layout.slot:
            counts[s] += 1
        target = min(range(S), key=lambda s: (counts[s], s))
        options = [(counts[s], -s, p * S + s, (p, s)) for (p, s) in layout.slot
                   if counts[s] - counts[target] >= 2 and (p, target) not in layout.slot]
        if not options:
            return moves
        donor = max(options)[3]
        unit = layout.slot.pop(donor)
        to = (donor[0], target)
        layout.slot[to] = unit
        layout.where[unit] = to
        layout.ready_at.pop(unit, None)  # a move is made during a restore: every worker loads the checkpoint
        moves.append((donor, to))


def return_slot(layout: StageLayout, home: Slot | None, vacated: dict[Slot, Slot]) -> Slot | None:
    """The slot a returning unit takes, as the runtime restarts a dead worker: its own (`home`, the slot it held),
    or, when a reshape's donor moved into it, the slot that donor left (`vacated[home]`, consumed); None when both
    are taken (it waits as a spare)."""
    if home is None:
        return None
    left = vacated.get(home)
    if left is not None and left not in layout.slot:
        del vacated[home]
        return left
    return home if home not in layout.slot else None
