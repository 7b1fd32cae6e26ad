"""`recycle <command>`: thin entry point that parses arguments, runs one command and maps errors to exit codes."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from recycle.errors import RecycleError

__all__ = ["main", "COMMANDS"]

# Each command lives in recycle.commands.<module> and exposes register(subparsers) -> parser with func set.
COMMANDS = ("schedule", "plan", "train", "profile", "simulate", "demo")

EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a tool whose reader (e.g. `head`) went away


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="recycle", description="Resilient data x pipeline parallel training "
                                     "by pipeline adaptation (ReCycle).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"recycle.commands.{name.replace('-', '_')}")
        except ModuleNotFoundError as exc:
            if exc.name != f"recycle.commands.{name.replace('-', '_')}":
                raise
            continue  # command not built yet
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
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
    except BrokenPipeError:
        # The reader stopped early (`recycle ... | head`): not an error of ours. Point stdout at /dev/null so the
        # interpreter's final flush does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
