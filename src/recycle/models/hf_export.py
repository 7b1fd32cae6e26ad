"""HF format out: the trained parameters of a Hugging Face model written as a folder that
`transformers.AutoModelForCausalLM.from_pretrained` loads (save_pretrained's layout: config.json and
model.safetensors), made in a temporary folder beside the target and renamed into place."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

import torch

from recycle.errors import OutputError
from recycle.fileio import check_output_dir

__all__ = ["STAGE_PREFIX", "check_export_dir", "export_hf"]

STAGE_PREFIX = "model."  # the stage modules hold the HF model as `.model` (models.hf._HFStage, HFCausalLM)


def check_export_dir(path: str | Path, flag: str = "--export-hf") -> None:
    """Before any training: `path` must be absent or an empty folder, and creatable/writable where it is."""
    p = Path(path)
    if p.is_dir() and any(p.iterdir()):
        raise OutputError(f"{flag} {str(path)!r} is a folder that is not empty; the export would replace its files: "
                          "give a new or empty folder")
    check_output_dir(p, flag)
    _check_writable(p.absolute().parent, flag, path)


def _check_writable(parent: Path, flag: str, given: str | Path) -> None:
    # The export is made beside the target and renamed into place, so the parent (when it exists) takes a new folder.
    if parent.is_dir():
        try:
            made = tempfile.mkdtemp(prefix=".recycle-probe-", dir=parent)
        except OSError as exc:
            raise OutputError(f"{flag} {str(given)!r}: cannot create a folder in {str(parent)!r}: "
                              f"{exc.strerror or exc}; pick a writable location") from None
        os.rmdir(made)


def export_hf(config_path: str | Path, seq_len: int, state: Mapping[str, torch.Tensor], path: str | Path) -> Path:
    """Write the whole model's state (the stages' keys, "model." + the HF name) with the run's HF config as a
    from_pretrained folder at `path`, atomically: every tensor under its HF name, in the dtype it was trained in."""
    from safetensors.torch import save_file

    from recycle.models.hf import CONFIG_FILE, load_hf_config, meta_model, tied_copies
    from recycle.models.hf_weights import WEIGHTS_FILE

    config = load_hf_config(config_path, seq_len)
    tensors = {}
    for key, value in state.items():
        if not key.startswith(STAGE_PREFIX):
            raise ValueError(f"{key!r} is not a parameter of a Hugging Face stage (no {STAGE_PREFIX!r} prefix)")
        tensors[key[len(STAGE_PREFIX):]] = value.detach().cpu().contiguous()
    # A tied weight once, under the embedding's name: from_pretrained ties the lm_head to it again.
    for copy, original in tied_copies(config).items():
        if copy in tensors and original in tensors and not torch.equal(tensors[copy], tensors[original]):
            raise ValueError(f"the tied weight's copies {copy!r} and {original!r} differ")
        tensors.pop(copy, None)
    model = meta_model(config)
    expected = set(model.state_dict()) - set(tied_copies(config))
    if set(tensors) != expected:  # a bug in the stages' names, not the user's
        raise ValueError(f"the trained stages' tensors differ from the model's: missing "
                         f"{sorted(expected - set(tensors))[:3]}, unexpected {sorted(set(tensors) - expected)[:3]}")
    dtypes = {t.dtype for t in tensors.values()}
    config.architectures = [type(model).__name__]
    config.use_cache = True  # the runtime trains without a KV cache; generation with the export wants one
    if len(dtypes) == 1:
        config.dtype = str(next(iter(dtypes))).removeprefix("torch.")
    target = Path(path).absolute()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        (tmp / CONFIG_FILE).write_text(config.to_json_string(use_diff=True))
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for file in (CONFIG_FILE, WEIGHTS_FILE):  # safetensors writes 0600; an export is ordinary, readable output
            os.chmod(tmp / file, 0o644)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        os.replace(tmp, target)  # onto an absent or empty folder; a non-empty one raises instead of being replaced
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise OutputError(f"--export-hf {str(path)!r}: cannot write the export ({exc.strerror or exc}); the trained "
                          "weights are lost unless --save or checkpoints were written too") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
