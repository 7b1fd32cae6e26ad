"""Everything the NCCL path needs before its first communicator: environment, version gate, init arguments, shrink."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, MutableMapping, TypedDict

import torch

from recycle.errors import ConfigError

__all__ = ["Setting", "VersionRule", "nccl_settings", "nccl_environment", "apply_nccl_environment",
           "prepare_nccl", "check_nccl_version", "nccl_version", "init_kwargs", "InitKwargs", "supports_shrink",
           "VERSION_RULES", "MIN_NCCL", "SHRINK_MIN_NCCL", "SHRINK_BROKEN_FROM"]

Version = tuple[int, int, int]

# torch's getCvarBool (torch/csrc/distributed/c10d/Utils.hpp) accepts exactly these (case-insensitive); any other
# value makes ProcessGroupNCCL's constructor raise, so we refuse it before the run starts.
_TRUE = frozenset({"y", "yes", "1", "t", "true"})
_FALSE = frozenset({"n", "no", "0", "f", "false"})


@dataclass(frozen=True)
class Setting:
    """One environment variable the NCCL path sets unless the user did.

    `aliases`: older names torch still reads for the same setting (its getCvar* gives the first name priority, so a
    user's legacy name counts as the user's value). `allowed`: for a setting whose wrong value breaks recovery, the
    test a user's value must pass (None: any well-formed user value is kept); `rule` says it in words.
    """

    name: str
    value: str
    why: str
    kind: str = "bool"  # "bool", "int" or "str": how a user's value is checked for being well-formed
    aliases: tuple[str, ...] = ()
    allowed: Callable[[str], bool] | None = None
    rule: str = ""


def _is_false(value: str) -> bool:
    return value.strip().lower() in _FALSE


def nccl_settings(timeout_s: float, version: Version | None = None) -> tuple[Setting, ...]:
    """The settings, in the order they are applied. `timeout_s`: the generation's collective timeout (the
    non-blocking init gets the same bound). `version`: the NCCL in use, where known (it picks one default)."""
    if not timeout_s > 0 or math.isinf(timeout_s):
        raise ConfigError(f"the NCCL timeout is {timeout_s!r} s; it must be a finite number of seconds > 0 (the "
                          "generation's collective timeout, e.g. --timeout 30)")
    # NCCL 2.26 brought random hangs in non-blocking mode; torch 2.7.1 stopped choosing it by itself for eager init
    # for that reason (ProcessGroupNCCL::useNonblocking; pytorch#153960, #154055). We do not turn it back on there.
    nonblocking = "0" if version is not None and (2, 26, 0) <= tuple(version[:3]) < (2, 27, 0) else "1"
    return (
        # 0 = no handling, 1 = abort the communicator and tear the process down, 2 = abort the communicator only
        # (CleanUpOnly), 3 = tear down without aborting (torch's default). 1 and 3 kill the survivor before Python
        # can recover (reference 3a, 3c.6); 2 keeps the process and lets the watchdog abort a timed-out
        # communicator, which releases a main thread stuck on a spinning kernel even if our watcher never fires.
        # 0 is also acceptable (torch's _abort_process_group docstring suggests it): then only our watcher aborts.
        Setting("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2",
                "a collective error or timeout aborts the communicator, never the process",
                kind="int", aliases=("NCCL_ASYNC_ERROR_HANDLING",),
                allowed=lambda v: int(v) in (0, 2),
                rule="must be 2 (abort the communicator only) or 0 (no handling): 1 and 3 terminate the process "
                     "on a peer's failure, so a survivor dies instead of recovering"),
        # The watchdog rethrowing a CUDA error terminates the process (NVRx in-process restart requires 0).
        Setting("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0",
                "a CUDA error seen by the watchdog is reported, not rethrown (rethrowing terminates the process)",
                allowed=_is_false,
                rule="must be false: the watchdog rethrowing a CUDA error terminates the process "
                     "(nvidia-resiliency-ext's in-process restart requires TORCH_NCCL_RETHROW_CUDA_ERRORS=0)"),
        # The heartbeat monitor SIGABRTs the process when the watchdog thread makes no progress for
        # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, e.g. while it waits in an abort of a communicator with a dead peer
        # (reference 3c.7). A user who wants that last resort may keep it: it fires after minutes, not seconds.
        Setting("TORCH_NCCL_ENABLE_MONITORING", "0",
                "no SIGABRT of the process while the watchdog waits on a hung communicator"),
        # On a timeout or error the watchdog asks every rank for a flight-recorder dump (written by the monitor
        # thread to per-rank files) and then sleeps 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s by default)
        # before its clean-up (ProcessGroupNCCL::Watchdog::runLoop). Debug output only; the sleep delays the
        # CleanUpOnly abort above by a minute.
        Setting("TORCH_NCCL_DUMP_ON_TIMEOUT", "0", "no flight-recorder dump on every collective timeout"),
        Setting("TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC", "0",
                "the watchdog's clean-up after a timeout starts at once instead of after 4 x 15 s", kind="int"),
        # NVLS (NVLink SHARP) must be off for in-process abort and restart (NVRx usage guide; reference 3c.4).
        Setting("NCCL_NVLS_ENABLE", "0", "NVLink SHARP off: NVLS communicators are not safe to abort in place",
                kind="int", allowed=lambda v: int(v) == 0,
                rule="must be 0: NVLS (NVLink SHARP) must be off for an in-process abort and restart "
                     "(nvidia-resiliency-ext usage guide)"),
        # Without blocking wait, wait() only orders the streams and the watchdog thread runs; with it there is no
        # watchdog at all (ProcessGroupNCCL constructor) and every wait blocks the calling CPU thread. The recovery
        # design (a watcher thread aborts; reference 3d) assumes the stream-side wait; the watcher's abort does not
        # depend on it (only the watchdog's safety net above goes), so a user's value is kept.
        Setting("TORCH_NCCL_BLOCKING_WAIT", "0", "wait() orders streams; the watchdog thread stays on",
                aliases=("NCCL_BLOCKING_WAIT",)),
        # A blocking ncclCommInitRank with a dead peer hangs (nccl#289, #1677); non-blocking init with a timeout
        # raises instead. torchft sets TORCH_NCCL_NONBLOCKING_TIMEOUT to its own timeout, else "the default
        # timeout of 30 minutes" applies and it "hangs on error" (reference 3a). Not verified on a GPU here:
        # torchft PR #320 reports "NCCL Error 7: operation in progress" from non-blocking mode plus eager init on
        # 2026 torch builds; `make gpu-check` runs both modes. TORCH_NCCL_USE_COMM_NONBLOCKING=0 opts out.
        Setting("TORCH_NCCL_USE_COMM_NONBLOCKING", nonblocking,
                "communicator init and teardown return instead of hanging on a dead peer"),
        Setting("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, math.ceil(timeout_s))),
                "a non-blocking NCCL call gives up after the generation's timeout, not after 30 min", kind="int",
                allowed=lambda v: int(v) > 0,
                rule="must be a whole number of seconds > 0"),
    )


def nccl_environment(timeout_s: float, version: Version | None = None) -> dict[str, str]:
    """Our value of every setting (before a user's environment is taken into account)."""
    return {s.name: s.value for s in nccl_settings(timeout_s, version)}


def _well_formed(setting: Setting, value: str) -> bool:
    text = value.strip().lower()
    if setting.kind == "bool":
        return text in _TRUE or text in _FALSE
    if setting.kind == "int":
        try:
            int(text)
        except ValueError:
            return False
        return True
    return True


def _user_value(env: Mapping[str, str], setting: Setting) -> tuple[str, str] | None:
    """(variable, value) of the user's own setting, if any: the main name first, then the legacy ones."""
    for name in (setting.name, *setting.aliases):
        if name in env:
            return name, env[name]
    return None


def apply_nccl_environment(env: MutableMapping[str, str], timeout_s: float,
                           version: Version | None = None) -> list[str]:
    """Set every setting the user has not set in `env` (a worker passes os.environ, before its first process
    group). A user's value is kept unless it would break recovery; then a ConfigError names the variable, the value,
    the rule and the fix, and nothing is changed. Returns the names of the variables set."""
    settings = nccl_settings(timeout_s, version)
    todo: list[Setting] = []
    for setting in settings:
        found = _user_value(env, setting)
        if found is None:
            todo.append(setting)
            continue
        name, value = found
        legacy = "" if name == setting.name else f" (the legacy name of {setting.name})"
        if not _well_formed(setting, value) or (setting.allowed is not None and not setting.allowed(value)):
            rule = setting.rule or ("must be one of " + ", ".join(sorted(_TRUE | _FALSE)) if setting.kind == "bool"
                                    else "must be an integer")
            raise ConfigError(f"environment {name}={value!r}{legacy} cannot be used for the NCCL backend: {rule}; "
                              f"fix: unset {name} (recycle then sets {setting.name}={setting.value}: {setting.why}) "
                              "or set an allowed value")
    for setting in todo:
        env[setting.name] = setting.value
    return [s.name for s in todo]


@dataclass(frozen=True)
class VersionRule:
    """NCCL versions in [first, last] (inclusive) are refused, for `reason` (with its public source)."""

    first: Version
    last: Version
    reason: str


MIN_NCCL: Version = (2, 26, 2)
VERSION_RULES: tuple[VersionRule, ...] = (
    # ncclCommAbort hangs on 2.25.1 and NCCL 2.26.2 fixed it (pytorch#149153; torch moved to 2.26.2, #149351).
    # Below 2.22 there is no group abort, and aborting several communicators one by one deadlocks (pytorch#119797,
    # #132291); torchft uses abort only from 2.25 and asks for >= 2.26 (reference 3a). So: at least 2.26.2.
    VersionRule((0, 0, 0), (2, 26, 1),
                "ncclCommAbort hangs there (2.25.1: pytorch#149153, fixed in 2.26.2; below 2.22 there is no group "
                "abort, and aborting communicators one by one deadlocks: pytorch#119797)"),
    # nvidia-resiliency-ext's README: its in-process restart segfaults on NCCL 2.28.3 to 2.28.8 (reference 3c.4).
    VersionRule((2, 28, 3), (2, 28, 8),
                "an in-process abort and restart segfaults there (nvidia-resiliency-ext README: 2.28.3-2.28.8)"),
)


def _text(version: tuple[int, ...]) -> str:
    return ".".join(str(part) for part in version[:3])


def check_nccl_version(version: Version) -> None:
    """Refuse an NCCL build known to hang or crash when a survivor aborts its communicators."""
    v = tuple(int(part) for part in version[:3])
    for rule in VERSION_RULES:
        if rule.first <= v <= rule.last:
            span = f"below {_text(MIN_NCCL)}" if rule.first == (0, 0, 0) else \
                f"{_text(rule.first)} to {_text(rule.last)}"
            raise ConfigError(
                f"NCCL {_text(v)} (torch {torch.__version__}) cannot be used for recovery: NCCL versions {span} are "
                f"refused because {rule.reason}; fix: use NCCL >= {_text(MIN_NCCL)} and not 2.28.3-2.28.8, e.g. "
                "`pip install 'nvidia-nccl-cu12>=2.28.9'` (or -cu13, as torch.version.cuda says: the library "
                "torch's CUDA wheels load) or a torch CUDA build that bundles such an NCCL; or train on gloo "
                "(recycle.train(..., backend='gloo'))")


def nccl_version() -> Version | None:
    """The NCCL that torch loaded, as (major, minor, patch); None where torch has no CUDA or NCCL."""
    try:
        import torch.distributed as dist

        if not torch.cuda.is_available() or not dist.is_available() or not dist.is_nccl_available():
            return None
        found = torch.cuda.nccl.version()  # (major, minor, patch) or (major, minor, patch, suffix)
        return int(found[0]), int(found[1]), int(found[2])
    except (AttributeError, RuntimeError, ImportError, TypeError, ValueError, IndexError):
        return None


def prepare_nccl(env: MutableMapping[str, str], timeout_s: float) -> list[str]:
    """What a worker runs before its first NCCL process group: the version gate (where torch reports a version),
    then apply_nccl_environment. Returns the names of the variables set."""
    version = nccl_version()
    if version is not None:
        check_nccl_version(version)
    return apply_nccl_environment(env, timeout_s, version)


class InitKwargs(TypedDict, total=False):
    """The keyword arguments init_kwargs may add to dist.init_process_group (typed, so the call is checked)."""

    device_id: torch.device


def init_kwargs(device: torch.device | str, backend: str = "nccl") -> InitKwargs:
    """Extra init_process_group arguments: on NCCL `device_id`, which binds the group to its GPU and creates the
    communicator at init (eager init). torchft: "always eager init to avoid duplicate communicators for p2p ops";
    split_group needs the bound device. gloo (or a CPU device) gets none: device_id must be an accelerator."""
    device = torch.device(device)
    if backend != "nccl" or device.type != "cuda":
        return {}
    if device.index is None:
        raise ConfigError(f"device {device} has no index; the NCCL backend needs one GPU per worker, e.g. cuda:0")
    return {"device_id": device}


SHRINK_MIN_NCCL: Version = (2, 27, 0)
SHRINK_BROKEN_FROM: Version = (2, 31, 0)


def supports_shrink(backend: str, version: Version | None = None) -> bool:
    """Whether the next generation may be formed by dist.shrink_group / split_group on `backend` (else: full init).

    nccl: ncclCommShrink exists from NCCL 2.27 (pytorch#164518). From 2.31 shrink_group(SHRINK_ABORT) hangs because
    survivors destroy the parent instead of aborting it (pytorch#194679, fix #194775 open in 2026-08), so not
    there. Open risk even in range: ncclCommShrink can hang when the excluded ranks exit without calling it
    (nccl#2397), which is what a dead peer does; not yet run on a GPU here.
    gloo: no. Measured on torch 2.13.0+cpu: ProcessGroupGloo.supports_shrinking is False (shrink_group raises
    TypeError), and split_group refuses a group without a bound accelerator device, which gloo on CPU cannot have
    (tests/unit/test_nccl_env.py checks the first against the installed torch).
    """
    if backend == "nccl":
        if version is None:
            return False
        v = tuple(int(part) for part in version[:3])
        return SHRINK_MIN_NCCL <= v < SHRINK_BROKEN_FROM
    return False
