"""recycle: resilient data x pipeline parallel training by pipeline adaptation (ReCycle, SOSP'24).

The public API (see docs/api.md) is re-exported here from recycle.api, lazily: `import recycle` imports neither
torch nor the planner; each function imports what it needs when called.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["load_config", "config_from_dict", "apply_overrides", "Config", "Plan", "planner_options", "plan",
           "schedule", "plan_store", "load_plan_store", "read_plan", "pipelining_csv", "simulate", "load_trace",
           "simulate_trace", "select_plan", "train", "factory_name", "RecycleError", "__version__"]


def __getattr__(name: str) -> object:
    # PEP 562: resolve the API names on first use, so `import recycle` stays cheap (tests/unit/test_api.py).
    if name in __all__:
        from recycle import api

        return getattr(api, name)
    raise AttributeError(f"module 'recycle' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
