"""Project error types: every error a user can cause names the value, the rule and the fix."""

from __future__ import annotations

__all__ = ["RecycleError", "ConfigError", "PlanError", "FailureStateError", "TraceError", "RuntimeFailure",
           "CheckpointError", "OutputError"]


class RecycleError(Exception):
    """Base class for errors caused by user input; the CLI prints them without a traceback and exits 2."""


class ConfigError(RecycleError):
    """A configuration file or value is invalid."""


class PlanError(RecycleError):
    """A plan violates the plan rules (routing, order, dependencies) or does not match its config."""


class FailureStateError(RecycleError):
    """A failure set cannot be served by pipeline adaptation (e.g. a stage lost every replica)."""


class TraceError(RecycleError):
    """A failure or availability trace is malformed."""


class RuntimeFailure(RecycleError):
    """A training run failed (a worker died or raised); the message names the worker."""


class CheckpointError(ConfigError):
    """A checkpoint cannot be resumed from: missing, damaged, unsafe, or made for another model or run."""


class OutputError(RecycleError):
    """An output file or directory cannot be written (unwritable, not a directory, disk full)."""
