"""Which command-line flags name output paths, and the check the CLI runs on them before a command starts."""

from __future__ import annotations

import argparse

from recycle.fileio import check_output_dir, check_output_file

__all__ = ["OUTPUTS", "check_command_outputs"]

# command -> (argument dest, flag as the user typed it, "file" | "dir" | "new-dir"). Checked before any work, so that a
# mistyped or unwritable path costs seconds, not a finished plan store or training run.
OUTPUTS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "schedule": (("gantt", "--gantt", "file"), ("trace", "--trace", "file"), ("csv", "--csv", "file")),
    "plan": (("gantt", "--gantt", "file"), ("save", "--save", "file"), ("out", "--out", "dir")),
    "train": (("save", "--save", "file"), ("metrics", "--metrics", "file"),
              ("checkpoint_dir", "--checkpoint-dir", "dir"), ("tensorboard", "--tensorboard", "dir"),
              ("export_hf", "--export-hf", "new-dir")),
    "profile": (("out", "--out", "file"),),
    "simulate": (("out", "--out", "dir"),),
    "demo": (("out", "--out", "dir"),),
}


def check_command_outputs(args: argparse.Namespace) -> None:
    """Raise an OutputError naming the flag, the path, the rule and the fix for the first unusable output."""
    for dest, flag, kind in OUTPUTS.get(getattr(args, "command", "") or "", ()):
        value = getattr(args, dest, None)
        if not value:
            continue
        if kind == "new-dir":  # absent or empty (an export is renamed into place)
            from recycle.models.hf_export import check_export_dir

            check_export_dir(value, flag)
        else:
            (check_output_file if kind == "file" else check_output_dir)(value, flag)
