"""CLI commands, one module each: register(subparsers) adds the parser and sets func(args) -> exit code."""

from __future__ import annotations

import argparse
import json

from recycle.config import CHECKPOINTING_MODES

__all__ = ["add_set_option", "add_checkpointing_option", "checkpointing_override"]


def add_set_option(parser: argparse.ArgumentParser) -> None:
    """`--set section.key=value`, repeatable, for every command that takes --config (recycle.config.apply_overrides)."""
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value, e.g. --set training.lr=1e-3 (repeatable; the value is read "
                             "as TOML, a bare word as a string)")


def add_checkpointing_option(p: argparse.ArgumentParser) -> None:
    """--activation-checkpointing, the override of [model] activation_checkpointing."""
    p.add_argument("--activation-checkpointing", default=None, choices=CHECKPOINTING_MODES,
                   help="keep only each stage's input ('full') or each transformer block's input ('per_layer') from "
                        "F and recompute the rest in B and W (same as [model] activation_checkpointing; default: the "
                        "config's, 'none')")


def checkpointing_override(args: argparse.Namespace) -> list[str]:
    """The --set entry of --activation-checkpointing (none when the flag is not given)."""
    mode = getattr(args, "activation_checkpointing", None)
    return [f"model.activation_checkpointing={json.dumps(mode)}"] if mode else []
