"""recycle: resilient data x pipeline parallel training by pipeline adaptation (ReCycle, SOSP'24).

The public API (docs/api.md) is importable from here: `recycle.load_config`, `recycle.plan`, `recycle.train`, ...
Its functions are loaded on first use, so `import recycle` does not import torch or the planner.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_API = ("load_config", "config_from_dict", "parse_workers", "plan", "fault_free_plan", "select_plan", "plan_store",
        "load_plan_store", "simulate", "simulate_trace", "train")
_OTHER = {"Config": "recycle.config", "RecycleError": "recycle.errors", "ConfigError": "recycle.errors",
          "PlanError": "recycle.errors", "RuntimeFailure": "recycle.errors"}

__all__ = ["__version__", *_API, *_OTHER]


def __getattr__(name: str) -> Any:
    import importlib

    if name in _API:
        return getattr(importlib.import_module("recycle.api"), name)
    if name in _OTHER:
        return getattr(importlib.import_module(_OTHER[name]), name)
    raise AttributeError(f"module 'recycle' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
