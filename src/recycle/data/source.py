"""The DataSource protocol, and a user's own source named 'package.module:function' (--data-source)."""

from __future__ import annotations

import importlib
import inspect
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import torch

from recycle.errors import ConfigError

if TYPE_CHECKING:
    from recycle.config import Config

__all__ = ["DataSource", "SourceFactory", "load_data_source", "source_name", "check_microbatch"]


@runtime_checkable
class DataSource(Protocol):
    """Micro-batch `mb` (0 .. D x M - 1) of `iteration` as (inputs, targets): a pure function of its arguments, so
    any worker can load any micro-batch (a re-routed one sees exactly what its owner would have). The first stage
    feeds `inputs` to the model, the last compares its output with `targets`; other stages never call it."""

    def __call__(self, iteration: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]: ...


SourceFactory = Callable[["Config"], DataSource]  # --data-source: called once per worker that loads data


def load_data_source(path: str) -> SourceFactory:
    """Import 'package.module:function', a function (config) -> DataSource."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"data source {path!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"data source {path!r}: cannot import {module_name!r} ({exc}); put it on PYTHONPATH") \
            from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"data source {path!r}: {module_name!r} has no function {attr!r}")
    try:
        inspect.signature(factory).bind(None)
    except TypeError:
        raise ConfigError(f"data source {path!r} takes {inspect.signature(factory)}, not (config); a data source is "
                          "a function (config) -> source, where source(iteration, mb) returns (inputs, targets) "
                          "(docs/runtime.md)") from None
    except ValueError:  # no signature (some builtins): the call says what is wrong
        pass
    return factory


def source_name(factory: Callable[..., Any]) -> str:
    """'module:function' for a data source function, the form worker processes import it by."""
    module, name = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if not module or not name or "<" in name or "." in name:
        raise ConfigError(f"data source {factory!r} must be a function defined at the top level of a module (workers "
                          "import it by name); a lambda, a nested function or a method cannot be imported")
    return f"{module}:{name}"


def check_microbatch(batch: Any, where: str) -> None:
    """A source's answer is a pair of tensors (inputs, targets); their shapes are the model's business (a factory's
    model may take other than token ids)."""
    if not (isinstance(batch, tuple) and len(batch) == 2 and all(isinstance(t, torch.Tensor) for t in batch)):
        raise ConfigError(f"{where}: source(0, 0) returned {type(batch).__name__}, not a pair of tensors (inputs, "
                          "targets)")
