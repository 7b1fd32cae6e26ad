"""Plans of a trace replay, planned once per run and kept on disk across runs, every entry validated when read."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from recycle.config import Config
from recycle.errors import OutputError, RecycleError
from recycle.fileio import UnsafeFile, atomic_write_text, read_inside
from recycle.inputs import UnsafeJSON, strict_json_loads
from recycle.ir.plan import Plan
from recycle.ir.validate import check_plan_matches, validate_plan
from recycle.planner.options import PlannerOptions

__all__ = ["CACHE_FORMAT", "CODE_DIRS", "PlanCache", "CacheStats", "code_version", "default_cache_dir",
           "ENTRY_LIMIT_BYTES"]

CACHE_FORMAT = 1
# The sources whose code decides a plan and its period (planner, simulator, IR, fault-free schedules, config
# parsing) and the partition search's inputs: any edit to them makes every entry a miss.
CODE_DIRS = ("planner", "sim", "ir", "schedules")
CODE_FILES = ("__init__.py", "config.py", "traces/plan_cache.py")
ENTRY_LIMIT_BYTES = 64 << 20  # a D=20, S=4, M=8 plan is ~20 kB; anything far larger is not ours


def code_version(root: Path | None = None, files: Iterable[Path] | None = None) -> str:
    """The package version (read from recycle/__init__.py, whose bytes are hashed too) and a hash of the planner's
    source files (relative names and bytes, sorted)."""
    root = root or Path(__file__).resolve().parents[1]
    if files is None:
        paths = [p for d in CODE_DIRS for p in (root / d).rglob("*.py")] + [root / f for f in CODE_FILES]
    else:
        paths = list(files)
    digest = hashlib.sha256()
    for path in sorted(paths, key=lambda p: str(p)):
        name = str(path.relative_to(root)) if path.is_relative_to(root) else path.name
        digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    init = root / "__init__.py"
    found = re.search(r'^__version__ = "([^"]+)"', init.read_text(), re.M) if init.is_file() else None
    return f"{found.group(1) if found else 'unknown'}+{digest.hexdigest()[:20]}"


def default_cache_dir() -> Path:
    """$RECYCLE_CACHE_DIR, else $XDG_CACHE_HOME/recycle/plans, else ~/.cache/recycle/plans."""
    if os.environ.get("RECYCLE_CACHE_DIR"):
        return Path(os.environ["RECYCLE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "recycle" / "plans"


@dataclass
class CacheStats:
    """What the cache did in one run: entries served from disk, planned (misses), written, and rejected (a corrupt,
    foreign or invalid entry: ignored and rebuilt)."""

    hits: int = 0
    misses: int = 0
    written: int = 0
    rejected: int = 0
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"hits": self.hits, "misses": self.misses, "written": self.written, "rejected": self.rejected,
                "reasons": self.reasons[:10]}


def _options_dict(options: PlannerOptions) -> dict[str, Any]:
    # split_microbatches and rules only when set: every entry made without them keeps its name.
    return {"decoupled": options.decoupled, "staggered": options.staggered, "search": options.search,
            "memory_cap": list(options.memory_cap) if options.memory_cap is not None else None,
            **({"split_microbatches": True} if options.split_microbatches else {}),
            **({"rules": options.rules} if options.rules is not None else {})}


def _config_hash(config: Config) -> str:
    blob = json.dumps(config.planning_dict(), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


class _Rejected(Exception):
    """An entry on disk that is not a valid answer to the question asked (it is ignored and rebuilt)."""


class PlanCache:
    """The periods of the planner's plans for a replay: each (config, failure key, options) planned once per run
    (an in-memory memo), and with `root` also kept on disk as one JSON file per entry, named by the SHA-256 of its
    inputs (the config's planning values, the key, the options, the solver and `code_version()`), so a change of
    any of them is a miss. An entry is never trusted: it is read as plain JSON (no pickle) from a regular file
    inside `root` (no link followed), must repeat exactly the inputs it was asked for, and its plan must pass
    `validate_plan`, match the config's shape and the key's canonical failures; its period is then re-simulated
    rather than read. An entry that fails any check is counted as rejected, ignored and replaced. Entries are
    written atomically. The layer-partition choice per key is kept the same way (`choice`), its periods coming
    from the plan entries."""

    def __init__(self, root: str | Path | None = None, code: str | None = None,
                 progress: Callable[[str], None] | None = None, progress_every: int = 20,
                 period_only: bool = True) -> None:
        self.root = Path(root) if root is not None else None
        # Plans made with `period_plan_for_key` (the full planner's period, sooner where schedules reach the bound);
        # False: `plan_for_key`'s own plans (benchmarks/bench_replay.py times the two).
        self.period_only = period_only
        self.code = code if code is not None else code_version()
        self.stats = CacheStats()
        self.progress = progress
        self.progress_every = max(1, progress_every)
        self._periods: dict[str, float] = {}
        self._choices: dict[str, Any] = {}
        self._config_hashes: dict[int, tuple[Config, str]] = {}
        if self.root is not None:
            try:
                self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as exc:
                raise OutputError(f"--plan-cache {self.root}: cannot create the folder ({exc.strerror}); pass a "
                                  "writable folder or --no-plan-cache") from None
            if not self.root.is_dir():
                raise OutputError(f"--plan-cache {self.root} is not a folder; pass a folder or --no-plan-cache")

    # -- entries ------------------------------------------------------------------------------------------------
    def _config_hash(self, config: Config) -> str:
        """_config_hash, once per config object of the run (the object is kept, so its id stays its own)."""
        known = self._config_hashes.get(id(config))
        if known is None or known[0] is not config:
            known = (config, _config_hash(config))
            self._config_hashes[id(config)] = known
        return known[1]

    def _inputs(self, kind: str, config: Config, **more: Any) -> tuple[str, dict[str, Any]]:
        inputs = {"format": CACHE_FORMAT, "kind": kind, "code": self.code, "config": self._config_hash(config),
                  **more}
        blob = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest(), inputs

    def _read(self, name: str, inputs: dict[str, Any]) -> Any | None:
        """The entry's value, or None when absent; _Rejected when it is there but not ours or not readable."""
        if self.root is None:
            return None
        try:
            data = read_inside(self.root, f"{name}.json", ENTRY_LIMIT_BYTES, "plan cache entry")
        except FileNotFoundError:
            return None
        except (UnsafeFile, OSError) as exc:
            raise _Rejected(str(exc)) from None
        try:
            entry = strict_json_loads(data)
        except (ValueError, UnsafeJSON, UnicodeDecodeError) as exc:
            raise _Rejected(f"not valid JSON ({exc})") from None
        if not isinstance(entry, dict) or entry.get("inputs") != inputs or "value" not in entry:
            raise _Rejected("its inputs are not the ones asked for (a foreign or edited entry)")
        return entry["value"]

    def _write(self, name: str, inputs: dict[str, Any], value: Any) -> None:
        if self.root is None:
            return
        text = json.dumps({"inputs": inputs, "value": value}, sort_keys=True, separators=(",", ":"),
                          allow_nan=False)
        # follow=False: whatever sits at the entry's path (a planted link) is replaced, never written through.
        # durable=False: no fsync per entry (a cold replay writes hundreds); an entry a crash truncates is not
        # JSON or not ours when read, so it is rejected and rebuilt like any other bad entry.
        try:
            atomic_write_text(self.root / f"{name}.json", text, follow=False, durable=False)
        except OutputError as exc:  # a full or read-only disk costs the next run its plans, not this run's replay
            if not any(r.startswith("not written") for r in self.stats.reasons):
                self.stats.reasons.append(f"not written: {exc}")
            return
        self.stats.written += 1

    def _planned(self) -> None:
        """Count a miss; every `progress_every` of them, a progress line (cold replays plan for minutes)."""
        self.stats.misses += 1
        if self.progress and self.stats.misses % self.progress_every == 0:
            self.progress(f"planning: {self.stats.misses} plan(s) and partition choice(s) made, {self.stats.hits} "
                          "read from the cache")

    def _reject(self, name: str, why: str) -> None:
        self.stats.rejected += 1
        self.stats.reasons.append(f"{name[:12]}: {why}")

    # -- plans --------------------------------------------------------------------------------------------------
    def period(self, config: Config, key: Sequence[int], options: PlannerOptions = PlannerOptions(),
               solver: str = "heuristic", time_limit_s: float = 10.0) -> float:
        """`plan_for_key(config, key, options, solver, time_limit_s).meta.predicted_period`, planned at most once
        per run and, for the heuristic solver (deterministic), once across runs."""
        from recycle.planner.api import period_plan_for_key, plan_for_key, resolve_options

        key = tuple(int(k) for k in key)
        resolved = resolve_options(config, options)
        name, inputs = self._inputs("plan", config, key=list(key), options=_options_dict(resolved), solver=solver,
                                    time_limit_s=float(time_limit_s) if solver == "exact" else 0.0)
        if name in self._periods:
            return self._periods[name]
        value: float | None = None
        if solver == "heuristic":  # the exact solver depends on its time limit and the machine: never kept
            try:
                raw = self._read(name, inputs)
                if raw is not None:
                    value = self._checked_period(raw, config, key, resolved)
                    self.stats.hits += 1
            except _Rejected as exc:
                self._reject(name, str(exc))
        if value is None:
            self._planned()
            # Only the period is used: where the schedules estimated at the lower bound settle it, planning stops
            # there, with the full planner's period (period_plan_for_key).
            plan = period_plan_for_key(config, key, options) if solver == "heuristic" and self.period_only else \
                plan_for_key(config, key, options, solver, time_limit_s)
            assert plan.meta.predicted_period is not None
            value = float(plan.meta.predicted_period)
            if solver == "heuristic":
                self._write(name, inputs, plan.to_dict())
        self._periods[name] = value
        return value

    def _checked_period(self, raw: Any, config: Config, key: tuple[int, ...], options: PlannerOptions) -> float:
        """The period of a cached plan, re-simulated once the plan is checked to answer (config, key, options)."""
        from recycle.planner.failures import canonical_failed

        try:
            plan = validate_plan(Plan.from_dict(raw))
            check_plan_matches(plan, config.num_replicas, config.num_stages, config.num_microbatches,
                               "the cached plan")
        except RecycleError as exc:
            raise _Rejected(f"its plan is invalid: {exc}") from None
        if plan.failed != canonical_failed(key) or tuple(plan.meta.failure_key) != key:
            raise _Rejected(f"its plan is for failed workers {sorted(plan.failed)}, not key {key}")
        if plan.staggered != options.staggered or (options.memory_cap or ()) != tuple(plan.meta.memory_cap) or \
                (plan.pieces and not options.split_microbatches):
            raise _Rejected("its plan was made under other options")
        if plan.meta.config_fingerprint != config.fingerprint():
            raise _Rejected("its plan was made for another config")
        from recycle.sim.simulator import simulate

        try:
            result = simulate(plan, config)
        except RecycleError as exc:
            raise _Rejected(f"its plan does not simulate: {exc}") from None
        caps = options.memory_cap
        if plan.pieces:  # a piece holds its share of a slot (the simulator's count takes it whole)
            from recycle.planner.split import within_cap

            over = caps is not None and not within_cap(plan, caps)
        else:
            over = caps is not None and any(peak > caps[rank % config.num_stages]
                                            for rank, peak in enumerate(result.peak_activations))
        if over:
            raise _Rejected("its plan holds more micro-batches than the memory cap allows")
        period = result.period
        if not (math.isfinite(period) and period > 0):
            raise _Rejected(f"its plan simulates to period {period}")
        return float(period)

    # -- partition choices --------------------------------------------------------------------------------------
    def _choice_inputs(self, config: Config, key: Sequence[int], configured: Sequence[int], options: PlannerOptions,
                       solver: str, search: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return self._inputs("partition-choice", config, key=[int(k) for k in key], configured=list(configured),
                            options=_options_dict(options), solver=solver, search=search)

    def has_choice(self, config: Config, key: Sequence[int], configured: Sequence[int], options: PlannerOptions,
                   solver: str, search: dict[str, Any]) -> bool:
        """Whether `choice` would find this choice made already (in this run, or an entry on disk, unchecked)."""
        name, _ = self._choice_inputs(config, key, configured, options, solver, search)
        return name in self._choices or (self.root is not None and (self.root / f"{name}.json").is_file())

    def choice(self, config: Config, key: Sequence[int], configured: Sequence[int], options: PlannerOptions,
               solver: str, search: dict[str, Any], make: Callable[[], Any], check: Callable[[dict], Any]) -> Any:
        """The partition choice for `key`: `make()` on a miss (its `to_dict()` kept), else `check(stored)` on the
        stored dict, which must rebuild the choice from it (re-deriving every period it can) or raise RecycleError
        (the entry is then rejected and the choice made again)."""
        key = tuple(int(k) for k in key)
        name, inputs = self._choice_inputs(config, key, configured, options, solver, search)
        if name in self._choices:
            return self._choices[name]
        found = None
        try:
            raw = self._read(name, inputs)
            if raw is not None:
                if not isinstance(raw, dict):
                    raise _Rejected("its value is not an object")
                try:
                    found = check(raw)
                except (RecycleError, KeyError, TypeError, ValueError) as exc:
                    raise _Rejected(f"its choice does not hold: {exc}") from None
                self.stats.hits += 1
        except _Rejected as exc:
            self._reject(name, str(exc))
        if found is None:
            self._planned()
            found = make()
            self._write(name, inputs, found.to_dict())
        self._choices[name] = found
        return found
