"""Per-worker action lists stored as flat integer arrays, materialised as Action tuples only when first read."""

from __future__ import annotations

from typing import Any, Iterator, Sequence, overload

from recycle.ir.actions import Action, Kind

__all__ = ["KIND_CODES", "CompactActions", "new_action"]

KIND_CODES = (Kind.F, Kind.B, Kind.W, Kind.BW, Kind.OPT)  # code i in the arrays is KIND_CODES[i]

_NEW = object.__new__
# The slots' member descriptors, read from the class dict (the checker takes `Action.kind` for the instance field).
_SET_KIND, _SET_STAGE, _SET_MB = (vars(Action)[name].__set__ for name in ("kind", "stage", "mb"))


def new_action(kind: Kind, stage: int, mb: int) -> Action:
    """Action(kind, stage, mb) without the frozen dataclass's __init__ (it sets each slot through
    object.__setattr__): about twice as fast, which matters for the ~400k actions of a 1,024-worker plan."""
    action = _NEW(Action)
    _SET_KIND(action, kind)
    _SET_STAGE(action, stage)
    _SET_MB(action, mb)
    return action


class CompactActions(Sequence[tuple[Action, ...]]):
    """`Plan.actions` for large plans: rank r's list is rows bounds[r]:bounds[r + 1] of the flat (code, stage, mb)
    arrays (codes index KIND_CODES, mb -1 for OPT).

    It reads like the tuple of Action tuples it stands for (indexing, iteration, len, ==, hash, pickling give a
    plain tuple); the Action objects are built on first access, so a consumer that reads the arrays (the planner's
    own timing of the plan) never pays for ~400k objects.
    """

    __slots__ = ("bounds", "code", "stage", "mb", "_rows")

    def __init__(self, bounds: Sequence[int], code: Sequence[int], stage: Sequence[int], mb: Sequence[int]) -> None:
        self.bounds, self.code, self.stage, self.mb = bounds, code, stage, mb
        self._rows: tuple[tuple[Action, ...], ...] | None = None

    @property
    def rows(self) -> tuple[tuple[Action, ...], ...]:
        """The Action tuples (built once)."""
        if self._rows is None:
            kinds = [KIND_CODES[c] for c in _as_list(self.code)]
            flat = list(map(new_action, kinds, _as_list(self.stage), _as_list(self.mb)))
            cut = _as_list(self.bounds)
            self._rows = tuple(tuple(flat[cut[r]:cut[r + 1]]) for r in range(len(cut) - 1))
        return self._rows

    def __len__(self) -> int:
        return len(self.bounds) - 1

    @overload
    def __getitem__(self, index: int) -> tuple[Action, ...]: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[tuple[Action, ...], ...]: ...

    def __getitem__(self, index: Any) -> Any:
        return self.rows[index]

    def __iter__(self) -> Iterator[tuple[Action, ...]]:
        return iter(self.rows)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, CompactActions):
            other = other.rows
        return self.rows == other

    def __hash__(self) -> int:
        return hash(self.rows)

    def __reduce__(self) -> tuple[Any, ...]:
        return (tuple, (self.rows,))

    def __repr__(self) -> str:
        return repr(self.rows)


def _as_list(values: Sequence[int]) -> list[int]:
    """Python ints from a numpy array (tolist) or any sequence."""
    tolist = getattr(values, "tolist", None)
    return tolist() if tolist is not None else list(values)
