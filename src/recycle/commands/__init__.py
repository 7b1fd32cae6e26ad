"""CLI commands, one module each: register(subparsers) adds the parser and sets func(args) -> exit code."""

from __future__ import annotations

import argparse

__all__ = ["add_set_option"]


def add_set_option(parser: argparse.ArgumentParser) -> None:
    """`--set section.key=value`, repeatable, for every command that takes --config (recycle.config.apply_overrides)."""
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value, e.g. --set training.lr=1e-3 (repeatable; the value is read "
                             "as TOML, a bare word as a string)")
