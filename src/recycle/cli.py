"""`recycle <command>`: thin entry point that parses arguments, runs one command and maps errors to exit codes."""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
from typing import Sequence

from recycle.errors import RecycleError

__all__ = ["main", "COMMANDS"]

# Each command lives in recycle.commands.<module> and exposes register(subparsers) -> parser with func set. The
# one-line help of each is repeated here so `recycle --help` lists every command without importing any of them
# (train pulls in torch: 2.5 s); tests/unit/test_cli_startup.py checks the lines match the modules'.
COMMAND_HELP = {
    "schedule": "time a fault-free schedule (GPipe, 1F1B, ZB-H1) on a config",
    "plan": "adaptive plan for failed workers, or a plan store for up to F failures",
    "train": "train the built-in GPT on real processes (gloo on CPU, NCCL on CUDA)",
    "coordinator": "run the job's store and coordinator alone, for training nodes started with `recycle train "
                   "--coordinator separate`",
    "profile": "measure per-stage F/B/W/optimizer times, memory and comm costs into a config",
    "simulate": "replay a failure trace over a job: ReCycle vs baseline models",
    "demo": "run the demo: tables on stdout, charts into --out",
}
COMMANDS = tuple(COMMAND_HELP)

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool whose reader (e.g. `head`) went away


LOG_LEVELS = ("debug", "info", "warning", "error")


def _add_logging_flags(parser: argparse.ArgumentParser, top: bool) -> None:
    # On the top parser and on every command, so `recycle -q train` and `recycle train -q` both work; a command's
    # copy has no defaults (SUPPRESS), or it would overwrite a value given before the command name.
    group = parser.add_argument_group("logging")
    default = (lambda value: value) if top else (lambda value: argparse.SUPPRESS)
    group.add_argument("-v", "--verbose", action="count", default=default(0),
                       help="more detail (debug messages, each with its module's name)")
    group.add_argument("-q", "--quiet", action="count", default=default(0),
                       help="only warnings and errors (no progress lines or bars); -qq: only errors")
    group.add_argument("--log-level", choices=LOG_LEVELS, default=default(None),
                       help="the recycle logger's level (wins over -v/-q; default info)")


_TOP_OPTIONS_WITH_VALUE = ("--log-level",)


def _command_name(argv: Sequence[str]) -> str:
    """The first argument that is not a top-level option or its value (`recycle --log-level debug train`)."""
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in _TOP_OPTIONS_WITH_VALUE:
            skip = True
        elif not arg.startswith("-"):
            return arg
    return ""


class Terminated(BaseException):
    """SIGTERM (a scheduler's stop, `kill`): unwound like Ctrl-C so every worker is stopped and reaped first. A
    BaseException, like KeyboardInterrupt: an `except Exception` on the way (logging's emit, for one) must not
    swallow it."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated()


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The CLI parser. With `argv`, only the command it names is imported and fully registered (the others get a
    stub with their help line), so start-up stays fast; without, every command is registered."""
    parser = argparse.ArgumentParser(prog="recycle", description="Resilient data x pipeline parallel training "
                                     "by pipeline adaptation (ReCycle).")
    _add_logging_flags(parser, top=True)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = None if argv is None else _command_name(argv)
    for name in COMMANDS:
        if chosen is not None and name != chosen:
            sub.add_parser(name, help=COMMAND_HELP[name])
            continue
        module = importlib.import_module(f"recycle.commands.{name.replace('-', '_')}")
        _add_logging_flags(module.register(sub), top=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from recycle.log_setup import configure_logging  # not before: `--help` never imports logging

    configure_logging(args.verbose, args.quiet, args.log_level)
    if args.command == "train":  # its launcher must stop its workers (and say so); other commands die quietly as is
        signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        from recycle.outputs import check_command_outputs

        check_command_outputs(args)
        result = args.func(args)
        sys.stdout.flush()  # a closed pipe shows up here, inside the handler, not at interpreter exit
    except RecycleError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("stopped by SIGTERM (every worker process was stopped; the newest complete checkpoint, if the run "
              "writes them, is where --resume picks up)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except BrokenPipeError:
        # The reader stopped early (`recycle ... | head`): not an error of ours. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
