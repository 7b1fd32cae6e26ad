"""Plan store: precompute one plan per normalized failure key into a folder; map real failure sets to plans fast."""

from __future__ import annotations

import json
import multiprocessing
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, TextIO

from recycle.config import Config
from recycle.errors import PlanError
from recycle.fileio import UnsafeFile, atomic_write_text, read_inside, relative_parts
from recycle.ir.plan import Plan
from recycle.planner.api import plan_for_key, resolve_options
from recycle.planner.failures import FailureState, check_failure_states, enumerate_keys, normalize
from recycle.planner.options import PlannerOptions
from recycle.planner.patterns import row_classes, with_shared_actions

__all__ = ["INDEX_NAME", "FORMAT_VERSION", "StoreEntry", "PlanStore", "build_store", "key_name"]

INDEX_NAME = "index.json"
FORMAT_VERSION = 1
_PLANS_DIR = "plans"
# Size bounds when reading a store (larger files are refused, not read): the index lists one line per key, a plan
# one entry per action (a D=8, S=16, M=64 plan is ~3 MB).
INDEX_LIMIT = 64 << 20
PLAN_LIMIT = 256 << 20


def key_name(key: Iterable[int]) -> str:
    """File stem for a key: (0, 1, 0, 0) -> 'k0-1-0-0'."""
    return "k" + "-".join(str(int(k)) for k in key)


@dataclass(frozen=True)
class StoreEntry:
    """One line of the index: where a key's plan lives and what it measured."""

    key: tuple[int, ...]
    file: str
    period: float
    makespan: float
    lower_bound: float
    solver: str
    status: str


def _options_dict(options: PlannerOptions) -> dict[str, Any]:
    return {"decoupled": options.decoupled, "staggered": options.staggered,
            "memory_cap": list(options.memory_cap) if options.memory_cap is not None else None,
            "search": options.search,
            **({"split_microbatches": True} if options.split_microbatches else {})}  # absent: old stores' bytes


def _options_from(d: dict[str, Any]) -> PlannerOptions:
    cap = d.get("memory_cap")
    return PlannerOptions(decoupled=bool(d["decoupled"]), staggered=bool(d["staggered"]),
                          memory_cap=tuple(int(x) for x in cap) if cap is not None else None,
                          search=bool(d.get("search", True)),
                          split_microbatches=bool(d.get("split_microbatches", False)))


def _plan_job(job: tuple[Config, tuple[int, ...], PlannerOptions, str, float]) -> tuple[tuple[int, ...], str, float]:
    """Pool worker: plan one key; returns the plan as JSON (plans travel between processes as text)."""
    config, key, options, solver, time_limit_s = job
    start = time.perf_counter()
    plan = plan_for_key(config, key, options, solver, time_limit_s)
    return key, plan.to_json(), time.perf_counter() - start


def build_store(config: Config, max_failures: int, out_dir: str | Path, options: PlannerOptions = PlannerOptions(),
                solver: str = "heuristic", time_limit_s: float = 10.0, jobs: int = 1,
                progress: TextIO | None = None) -> Path:
    """Plan every key with at most `max_failures` failures into `out_dir`; return the index path.

    Each plan is written atomically as plans/<key>.json as soon as it is done, and index.json (config fingerprint,
    options, per-key period) last, so a reader never sees an index pointing at missing plans. One progress line per
    key goes to `progress` (the CLI passes stderr).
    """
    if max_failures < 0:
        raise PlanError(f"--max-failures = {max_failures} must be >= 0")
    if jobs < 1:
        raise PlanError(f"--jobs = {jobs} must be >= 1")
    D, S = config.num_replicas, config.num_stages
    check_failure_states(D, S, max_failures)
    options = resolve_options(config, options)
    keys = list(enumerate_keys(D, S, max_failures))
    out = Path(out_dir)
    jobs_list = [(config, key, options, solver, time_limit_s) for key in keys]
    entries: dict[tuple[int, ...], StoreEntry] = {}
    started = time.perf_counter()

    def record(key: tuple[int, ...], text: str, seconds: float) -> None:
        plan = Plan.from_json(text)
        name = f"{_PLANS_DIR}/{key_name(key)}.json"
        atomic_write_text(out / name, text, follow=False)
        meta = plan.meta
        entries[key] = StoreEntry(key, name, float(meta.predicted_period or 0.0), float(meta.predicted_makespan or 0.0),
                                  float(meta.lower_bound or 0.0), meta.solver, meta.status)
        if progress is not None:
            print(f"[{len(entries)}/{len(keys)}] key=({','.join(map(str, key))}) period={meta.predicted_period:g} "
                  f"lower_bound={meta.lower_bound:g} {meta.solver}/{meta.status} ({seconds:.2f}s)",
                  file=progress, flush=True)

    if jobs > 1 and len(keys) > 1:
        # spawn: the children import only the planner, whatever the parent process has loaded (torch, threads).
        with multiprocessing.get_context("spawn").Pool(min(jobs, len(keys))) as pool:
            for key, text, seconds in pool.imap_unordered(_plan_job, jobs_list):
                record(key, text, seconds)
    else:
        for job in jobs_list:
            record(*_plan_job(job))

    index = {
        "format": FORMAT_VERSION,
        "config_name": config.name,
        "config_fingerprint": config.fingerprint(),
        "num_replicas": D,
        "num_stages": S,
        "num_microbatches": config.num_microbatches,
        "max_failures": max_failures,
        "solver": solver,
        "time_limit_s": time_limit_s,
        "options": _options_dict(options),
        "build_seconds": round(time.perf_counter() - started, 3),
        "plans": {key_name(k): {"key": list(k), "file": e.file, "period": e.period, "makespan": e.makespan,
                                "lower_bound": e.lower_bound, "solver": e.solver, "status": e.status}
                  for k, e in sorted(entries.items())},
    }
    return atomic_write_text(out / INDEX_NAME, json.dumps(index, indent=1) + "\n", follow=False)


def _read_plan(directory: Path, file: Any, rebuild: str) -> str:
    """The text of a plan file an index names: a relative path inside the store folder (like
    'plans/k0-1-0-0.json'), a regular file reached without following a link, at most PLAN_LIMIT bytes."""
    if not isinstance(file, str):
        raise PlanError(f"{directory / INDEX_NAME} names {file!r} as a plan file, not a path; {rebuild}")
    try:
        relative_parts(file)
    except UnsafeFile:
        raise PlanError(f"{directory / INDEX_NAME} names the plan file {file[:200]!r}, which is not inside the store "
                        f"folder (plan files are relative paths like 'plans/k0-1.json'); refused; {rebuild}") from None
    try:
        return read_inside(directory, file, PLAN_LIMIT, "plan file").decode("utf-8")
    except UnsafeFile as exc:
        raise PlanError(f"{exc}; {rebuild}") from None
    except FileNotFoundError:
        raise PlanError(f"{directory / file} is missing (the index names it); {rebuild}") from None


class PlanStore:
    """A loaded plan store: every plan in memory, so a lookup is a normalization plus a relabelling."""

    def __init__(self, directory: Path, config: Config, options: PlannerOptions, max_failures: int,
                 entries: dict[tuple[int, ...], StoreEntry], plans: dict[tuple[int, ...], Plan]) -> None:
        self.directory = directory
        self.config = config
        self.options = options
        self.max_failures = max_failures
        self.entries = entries
        self._plans = plans

    @classmethod
    def load(cls, directory: str | Path, config: Config) -> "PlanStore":
        """Read a store made for `config`; a store made for another config is a PlanError. The store is untrusted
        input: index.json and every plan it names are regular files inside `directory`, reached without following
        a symbolic link and read with a size bound; a plan file named outside the folder is refused."""
        directory = Path(directory)
        index_path = directory / INDEX_NAME
        rebuild = f"rebuild it with `recycle plan --config FILE --max-failures F --out {directory}`"
        try:
            raw = read_inside(directory, INDEX_NAME, INDEX_LIMIT, "plan store index")
        except (FileNotFoundError, NotADirectoryError):
            raise PlanError(f"{index_path} does not exist; build the store with `recycle plan --config FILE "
                            f"--max-failures F --out {directory}`") from None
        except UnsafeFile as exc:
            raise PlanError(f"{exc}; {rebuild}") from None
        except OSError as exc:
            raise PlanError(f"{index_path} cannot be read ({exc.strerror or exc})") from None
        try:
            index = json.loads(raw)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            raise PlanError(f"{index_path} is not valid JSON ({str(exc)[:120]}); rebuild the store") from None
        except RecursionError:
            raise PlanError(f"{index_path} nests too deeply to be a plan store index; rebuild the store") from None
        if not isinstance(index, dict):
            raise PlanError(f"{index_path} holds a JSON {type(index).__name__}, not a plan store index (an "
                            f"object); {rebuild}")
        if index.get("format") != FORMAT_VERSION:
            raise PlanError(f"{index_path} has format {index.get('format')!r}, this version reads {FORMAT_VERSION}; "
                            "rebuild the store with `recycle plan ... --out`")
        want = config.fingerprint()
        if index.get("config_fingerprint") != want:
            raise PlanError(
                f"plan store {directory} was built for config {index.get('config_name')!r} (fingerprint "
                f"{index.get('config_fingerprint')}), but the current config {config.name!r} has fingerprint {want}: "
                "its plans would time and route work wrongly; rebuild the store with `recycle plan --config "
                f"{config.source or 'FILE'} --max-failures F --out {directory}`"
            )
        try:
            options = _options_from(index["options"])
            entries: dict[tuple[int, ...], StoreEntry] = {}
            plans: dict[tuple[int, ...], Plan] = {}
            for item in index["plans"].values():
                key = tuple(int(k) for k in item["key"])
                file = item["file"]
                entries[key] = StoreEntry(key, file, float(item["period"]), float(item["makespan"]),
                                          float(item["lower_bound"]), item["solver"], item["status"])
                plans[key] = Plan.from_json(_read_plan(directory, file, rebuild))
        except (KeyError, TypeError, ValueError, AttributeError, OSError) as exc:
            raise PlanError(f"plan store {directory} is incomplete or damaged ({type(exc).__name__}: "
                            f"{str(exc)[:200]}); rebuild it with `recycle plan ... --out`") from None
        return cls(directory, config, options, int(index.get("max_failures", 0)), entries, plans)

    def share_actions(self) -> None:
        """Hold every plan as tuples of shared Actions with its row classes worked out (patterns.row_classes), before
        the run: a lookup then renames only the lists a failure moved, and its lists compare with the last plan's as
        one object per action (the coordinator's views of the new plan: ir.worker_view.PlanViews)."""
        self._plans = {key: with_shared_actions(plan) for key, plan in self._plans.items()}
        for plan in self._plans.values():
            row_classes(plan)

    def keys(self) -> list[tuple[int, ...]]:
        return sorted(self._plans)

    def __len__(self) -> int:
        return len(self._plans)

    def plan_for_key(self, key: tuple[int, ...]) -> Plan | None:
        """The stored canonical plan of a key, or None."""
        return self._plans.get(tuple(key))

    def lookup(self, failed_workers: Iterable[tuple[int, int]], state: FailureState | None = None) -> Plan:
        """The plan for a real set of failed (replica, stage) workers, on real ranks (`state`: their normalize(), if
        the caller has it).

        A key the store lacks (more failures than it was built for) is planned online by the heuristic with the
        store's options; the returned plan says so in meta.notes.
        """
        if state is None:
            state = normalize(failed_workers, self.config.num_replicas, self.config.num_stages)
        plan = self._plans.get(state.key)
        if plan is None:
            online = plan_for_key(self.config, state.key, self.options, "heuristic")
            plan = online.with_meta(notes=f"key {state.key} not in store {self.directory} (built for up to "
                                          f"{self.max_failures} failures): planned online by the heuristic; "
                                          f"{online.meta.notes}")
        return state.to_real(plan)
