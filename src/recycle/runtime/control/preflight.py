"""Checks a training launch makes before any worker starts: option ranges, output paths, the checkpoint to resume.

Resume rules (docs/runtime.md, "Checkpoints and resume"):
* a checkpoint is *intact* when its recycle.json names its step and every file of the DCP folder has the SHA-256
  recorded when it was written, its .metadata unpickles with the restricted unpickler (checkpoint.read_metadata),
  and it holds the tensors the config's whole model has, with their shapes and dtypes (any number of stages);
* the step named by `latest` is tried first; a damaged one (missing, truncated, empty) is reported and the newest
  intact older step is used instead; steps newer than `latest` are never used (not known to be complete);
* a checkpoint of another model or run is an error, never a fallback: the run fingerprint (RESUME_MUST_MATCH)
  must match; RESUME_MAY_CHANGE keys may differ between legs of a run and are reported as warnings.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from recycle.config import Config
from recycle.errors import CheckpointError, ConfigError
from recycle.fileio import (UnsafeFile, atomic_write_text, check_output_dir, check_output_file, is_stream_target,
                            read_inside)
from recycle.runtime.options import LaunchOptions
from recycle.runtime.state import checkpoint
from recycle.runtime.state.optim import OPTIMIZER_KEYS, optimizer_class
from recycle.runtime.state.precision import weights_dtype

_log = logging.getLogger(__name__)

__all__ = ["check_launch", "check_save_target", "check_run_length",
           "check_model_memory", "check_outputs", "run_fingerprint", "find_resume_point", "ResumePoint", "StageSpec",
           "expected_stages", "RESUME_MUST_MATCH", "RESUME_MAY_CHANGE"]

# What makes a checkpoint the state of *this* run: the model (shapes; how the stages split it only for a
# --model-factory model, since the built-in GPT's keys are the whole model's), the numerics (dtype), the optimizer
# class (the shape of its state), what each step computes (global batch, sequence length, the seed behind init and
# dropout). The number of replicas and micro-batches may change as long as their product (the global batch in
# micro-batches) stays.
RESUME_MUST_MATCH = ("model", "model_factory", "num_stages", "dtype", "seed", "seq_len", "microbatch_size",
                     "global_microbatches", "optimizer")
# Settings a user may deliberately change between legs of a run (a new learning rate or schedule, more data);
# reported.
RESUME_MAY_CHANGE = ("lr", "weight_decay", "grad_clip", "dataset", "optimizer_args", "lr_schedule")

_STEP_DIR = re.compile(r"^step(\d{1,18})$")  # 18 digits: int() never sees 5,000 (a damaged `latest`)
_META_ABOVE_PARAMS = 20_000_000  # build shapes on the meta device above this size (below it the CPU is faster)


@dataclass(frozen=True)
class StageSpec:
    """What a stage checkpoint of this config must hold."""

    layers: tuple[int, int]
    tensors: dict[str, tuple[tuple[int, ...], torch.dtype]]  # state-dict name -> (shape, dtype)
    trainable: dict[str, tuple[int, ...]]  # the optimizer's parameters: name -> shape

    @property
    def checkpoint_bytes(self) -> int:
        """About what one stage file takes: the state dict plus two AdamW moments (in the parameters' dtype) per
        trainable parameter."""
        size = {torch.float64: 8, torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}
        state = sum(math.prod(s) * size.get(d, 4) for s, d in self.tensors.values())
        element = max((size.get(d, 4) for _, d in self.tensors.values()), default=4)
        return state + sum(2 * math.prod(s) * element for s in self.trainable.values())


@dataclass(frozen=True)
class ResumePoint:
    step: int
    path: Path
    warnings: tuple[str, ...] = ()


def check_launch(config: Config, options: LaunchOptions, end: int) -> int:
    """Everything a launch can check before spawning a worker beyond the options' own ranges; returns the step to
    start from (0 or the intact checkpoint's). Prints which checkpoint is used and any warnings."""
    check_save_target(options)
    check_export_model(config, options)
    optimizer_class(config.training)  # an unknown optimizer or argument fails here, not in every worker
    ckpt = options.checkpoint
    specs = expected_stages(config, options.model_factory) if (ckpt.resume_dir or ckpt.dir) else None
    # One checkpoint with headroom for the file format (measured: ~7 % over the raw tensor bytes for the tiny GPT).
    check_outputs(options, int(1.1 * sum(s.checkpoint_bytes for s in specs)) + 65536 * len(specs) if specs else 0)
    start = 0
    if ckpt.resume_dir:
        point = find_resume_point(config, ckpt.resume_dir, options.model_factory, specs)
        for warning in point.warnings:
            _log.warning(warning)
        if point.step > end:
            raise ConfigError(f"the checkpoint {str(point.path)!r} is at step {point.step}, past --steps {end}; "
                              f"ask for more steps than {point.step}")
        if options.progress:
            options.progress(f"resuming from {point.path} (step {point.step}; every file checked against its "
                             "recorded hash)")
        start = point.step
    check_run_length(options, start, end)
    check_model_memory(config, options)
    if ckpt.dir:
        checkpoint.preload()  # the coordinator merges each step's shards with DCP's metadata classes
        # Each checkpoint written from now on carries this fingerprint (checkpoint.mark_latest copies it).
        atomic_write_text(Path(ckpt.dir) / checkpoint.RUN_FILE,
                          _dumps(run_fingerprint(config, options.model_factory)), follow=False)
    return start


def check_export_model(config: Config, options: LaunchOptions) -> None:
    """--export-hf writes a Hugging Face model: the run must train one."""
    export = options.outputs.export_hf
    if export and (options.model_factory or not config.model.hf_config):
        model = f"--model-factory {options.model_factory!r}" if options.model_factory else "the built-in GPT"
        raise ConfigError(f"--export-hf {export!r} writes a Hugging Face model, but this run trains {model}; train "
                          "with --hf (or [model] hf_config), or write the parameters with --save")


def check_save_target(options: LaunchOptions) -> None:
    """A --save target that is a device or FIFO is written on node 0 from parts in its temporary folder, so it works
    on one node only."""
    save = options.outputs.save_path
    if save and options.cluster.nnodes > 1 and is_stream_target(save):
        raise ConfigError(f"--save {save!r} is a device or FIFO: on several nodes the stages' parts "
                          "of --save are gathered through a shared filesystem, so pass a regular file path there")


# The launcher lists every checkpoint step due in the run and scans that list about 20 times a second.
MAX_DUE_CHECKPOINTS = 10_000


def check_run_length(options: LaunchOptions, start: int, end: int) -> None:
    """--steps at most the config limit, and at most MAX_DUE_CHECKPOINTS checkpoints due from `start` to `end`
    (issue 21, item 3: `--steps 1000000000 --checkpoint-every 1` listed a billion steps before the first one)."""
    from recycle.config import SIZE_LIMITS

    limit = SIZE_LIMITS["training", "steps"][0]
    if end > limit:
        raise ConfigError(f"--steps {end} is above the limit of {limit:,} steps for one run; ask for fewer steps")
    every = options.checkpoint.every
    due = (end // every - start // every) if options.checkpoint.enabled else 0
    if due > MAX_DUE_CHECKPOINTS:
        raise ConfigError(f"--checkpoint-every {every} over steps {start + 1}..{end} is {due:,} checkpoints, above the "
                          f"limit of {MAX_DUE_CHECKPOINTS:,} for one run (the launcher tracks every due one, and each "
                          f"writes the whole model); use --checkpoint-every "
                          f"{-(-(end - start) // MAX_DUE_CHECKPOINTS)} or more")


def check_model_memory(config: Config, options: LaunchOptions | None = None, available: int | None = None,
                       workers: int | None = None, whole: bool = False) -> None:
    """Refuse a built-in GPT that cannot fit: every worker builds its own stage only (models.gpt.build_stage; the
    largest stage is counted for each), holds at least one micro-batch's activations (and, on the last stage, its
    logits) and, with --redo lost, the tensors it sent in its two newest iterations, so this node's workers (`workers`, default the node's share of D x S) need at least that much
    memory at once. `whole`: each of them holds every stage (the profiler's one process). `available`:
    MemAvailable (bytes) of /proc/meminfo by default; without it nothing is checked. A lower bound: a run it passes
    may still not fit."""
    if (options is not None and options.model_factory) or config.model.hf_config:
        return
    if available is None:
        available = _mem_available()
        if available is None:
            return
    from recycle.models.gpt import resolve_shape
    from recycle.runtime.state.migration import plan_bounds

    shape = resolve_shape(config.model, config.workload.seq_len)
    element = 8 if config.training.dtype == "float64" else 4
    D, S = config.num_replicas, config.num_stages
    nnodes = options.cluster.nnodes if options is not None else 1
    workers = workers or -(-D * S // nnodes)
    last_stage = -(-D // nnodes)  # at most this many of the node's workers hold a last stage
    tokens = config.workload.microbatch_size * config.workload.seq_len
    layouts = [(0, shape.n_layer)] if whole else plan_bounds(config, ())
    held = max(shape.stage_parameters(first, last) for first, last in layouts) * element
    boundary = tokens * shape.n_embd * element  # one micro-batch's activation (or its gradient) between two stages
    # --redo lost: each worker keeps what it sent in its two newest iterations (its M micro-batches' activations or
    # gradients at least; runtime/worker/executor.py `_sent`), to send it again after a failure.
    logged = 2 * config.num_microbatches * boundary if options is not None and options.recovery.redo == "lost" \
        and S > 1 and not whole else 0
    need = workers * (held + boundary + logged) + min(last_stage, workers) * tokens * shape.vocab_size * element
    if need > available:
        gb = 1e9
        built = "the whole model" if whole else "its stage (the largest)"
        log = (f", and with --redo lost (the default) keeps what it sent in its two newest iterations "
               f"({logged / gb:,.1f} GB; --redo iteration keeps none)") if logged else ""
        raise ConfigError(f"the built-in GPT ([model] n_layer {shape.n_layer}, n_embd {shape.n_embd}, vocab_size "
                          f"{shape.vocab_size}; micro-batches of {tokens:,} tokens) needs at least {need / gb:,.1f} GB "
                          f"on this node: each of its {workers} worker(s) builds {built} ({held / gb:,.1f} GB "
                          f"in {config.training.dtype}) and holds a micro-batch's activations{log}, but "
                          f"{available / gb:,.1f} GB are available; use a smaller [model] or smaller micro-batches, "
                          "or spread the workers over more nodes")


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_outputs(options: LaunchOptions, checkpoint_bytes: int = 0) -> None:
    """Every path the run will write, checked now rather than after the training it would cost."""
    outputs = options.outputs
    if outputs.save_path:
        check_output_file(outputs.save_path, "--save")
    if outputs.metrics_path:
        check_output_file(outputs.metrics_path, "--metrics")
    if outputs.export_hf:
        from recycle.models.hf_export import check_export_dir

        check_export_dir(outputs.export_hf)
    if options.checkpoint.dir:
        check_output_dir(options.checkpoint.dir, "--checkpoint-dir", need_bytes=checkpoint_bytes)


def run_fingerprint(config: Config, model_factory: str = "") -> dict[str, Any]:
    """The settings a checkpoint is tied to (RESUME_MUST_MATCH) and those reported when changed."""
    model: dict[str, Any]
    if model_factory:
        model = {}
    elif config.model.hf_config:
        model = {"hf_config": config.model.hf_config}
    else:
        from recycle.models.gpt import resolve_shape

        shape = resolve_shape(config.model, config.workload.seq_len)
        model = {"vocab_size": shape.vocab_size, "n_layer": shape.n_layer, "n_head": shape.n_head,
                 "n_embd": shape.n_embd, "block_size": shape.block_size, "dropout": shape.dropout}
    t, w = config.training, config.workload
    return {"model": model, "model_factory": model_factory, "num_stages": config.num_stages, "dtype": t.dtype,
            "seed": t.seed, "seq_len": w.seq_len, "microbatch_size": w.microbatch_size,
            "global_microbatches": config.num_replicas * w.num_microbatches,
            "lr": t.lr, "weight_decay": t.weight_decay, "grad_clip": t.grad_clip, "dataset": t.dataset,
            "optimizer": t.optimizer,
            "optimizer_args": {k: list(v) if isinstance(v, tuple) else v for k in OPTIMIZER_KEYS
                               if (v := getattr(t, k)) is not None},
            "lr_schedule": {"schedule": t.lr_schedule, "warmup_steps": t.warmup_steps, "min_lr": t.min_lr,
                            "lr_decay_steps": t.lr_decay_steps}}


def expected_stages(config: Config, model_factory: str = "") -> list[StageSpec]:
    """The tensors each stage of this config's model has (built on the meta device when the model is large)."""
    from recycle.runtime.worker.stage import all_stages

    S = config.num_stages
    modules: list[torch.nn.Module]
    if config.model.hf_config and not model_factory:
        from recycle.models.hf import hf_meta_stages
        from recycle.runtime.worker.stage import hf_path

        hf = hf_meta_stages(hf_path(config), S, config.workload.seq_len, weights_dtype(config.training.dtype))
        modules, layouts = list(hf), [(m.first_layer, m.end_layer) for m in hf]
    elif model_factory:
        model, layouts = all_stages(config, model_factory)
        modules = list(model.stages)
    else:
        from recycle.models.gpt import GPTStage, resolve_shape, stage_layers

        shape = resolve_shape(config.model, config.workload.seq_len)
        layouts = stage_layers(shape.n_layer, S)
        device = "meta" if shape.num_parameters > _META_ABOVE_PARAMS else "cpu"
        with torch.device(device):
            modules = [GPTStage(shape, first, last).to(weights_dtype(config.training.dtype))
                       for first, last in layouts]
    return [StageSpec((layout[0], layout[1]), {k: (tuple(v.shape), v.dtype) for k, v in m.state_dict().items()},
                      {n: tuple(p.shape) for n, p in m.named_parameters() if p.requires_grad})
            for m, layout in zip(modules, layouts)]


def find_resume_point(config: Config, root: str | Path, model_factory: str = "",
                      specs: list[StageSpec] | None = None) -> ResumePoint:
    """The newest intact checkpoint in `root` at or before `latest` (see the module docstring)."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"--resume {str(root)!r}: no checkpoint there (no such directory); pass a directory "
                              "written by --checkpoint-dir")
    steps = sorted((int(m.group(1)) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))),
                   reverse=True)
    warnings: list[str] = []
    pointer = root / "latest"
    latest: int | None = None
    reported = len(warnings)
    name = _read_pointer(root, warnings)
    if name is not None:
        match = _STEP_DIR.match(name)
        if match:
            latest = int(match.group(1))
        else:
            warnings.append(f"{pointer} holds {name[:40]!r}, not a step directory name like 'step000004'; "
                            "looking for the newest intact checkpoint instead")
    elif steps:
        if len(warnings) == reported:  # (an unreadable pointer is reported already)
            warnings.append(f"{root} has no 'latest' pointer; looking for the newest intact checkpoint")
    else:
        raise CheckpointError(f"--resume {str(root)!r}: no checkpoint there (no 'latest' file, no step directory); "
                              "pass a directory written by --checkpoint-dir")
    if latest is not None:
        candidates = [latest] + [s for s in steps if s < latest]
    else:
        candidates = steps
    if specs is None:
        specs = expected_stages(config, model_factory)
    fingerprint = run_fingerprint(config, model_factory)
    problems: list[str] = []
    for step in candidates:
        where = checkpoint.step_dir(root, step)
        problem: str | None
        if not where.is_dir():
            problem = (f"'latest' names step {step} but {where} is missing" if step == latest
                       else f"{where} is missing")
        else:
            # A factory's or Hugging Face model's stage keys are prefixed per stage (checkpoint.key_prefix).
            problem = _check_step(root, step, specs, fingerprint, warnings, model_factory or config.model.hf_config)
        if problem is None:
            if problems:
                warnings.append(f"{problems[0]}; resuming from the newest intact checkpoint, step {step}, instead")
            return ResumePoint(step, where, tuple(warnings))
        problems.append(problem)
    listed = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
    raise CheckpointError(f"--resume {str(root)!r}: no intact checkpoint ({listed or 'no step directory'}); start "
                          "without --resume or restore the checkpoint files")


def _read_pointer(root: Path, warnings: list[str]) -> str | None:
    """What `latest` says (None when there is none), read as a bounded regular file inside `root`; one that is a
    link, a FIFO or a device is reported and ignored (the step folders are checked one by one anyway)."""
    try:
        return read_inside(root, "latest", checkpoint.POINTER_LIMIT, "'latest' pointer").decode(
            "utf-8", "replace").strip()
    except UnsafeFile as exc:
        warnings.append(f"{exc}; looking for the newest intact checkpoint instead")
    except OSError:
        pass
    return None


def _check_step(root: Path, step: int, specs: list[StageSpec], fingerprint: dict[str, Any],
                warnings: list[str], model_factory: str = "") -> str | None:
    """None if the step is intact; a description if damaged. A checkpoint of another model or run raises, and so
    does one that would run code."""
    where = checkpoint.step_dir(root, step)
    try:
        manifest = checkpoint.read_manifest(where, root=root)
        if manifest["step"] != step:
            return f"{where / checkpoint.MANIFEST} says step {manifest['step']} (a misplaced folder)"
        metadata = checkpoint.read_metadata(where, verify_files=True, root=root)
    except CheckpointError as exc:
        if "refused" in str(exc):
            raise  # a file that would run code is never skipped over quietly
        return str(exc)
    _check_fingerprint(where, manifest.get("run"), fingerprint, warnings, repartition_ok=not model_factory)
    _check_tensors(where, metadata.state_dict_metadata, specs, model_factory)
    return None


def _check_tensors(where: Path, entries: dict[str, Any], specs: list[StageSpec], model_factory: str) -> None:
    """The checkpoint's model keys are exactly this config's model's (whole-model names), with the same shapes
    and dtypes; its optimizer state belongs to the model's trainable parameters."""
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    trainable: dict[str, tuple[int, ...]] = {}
    for stage, spec in enumerate(specs):
        prefix = checkpoint.key_prefix(stage, model_factory)
        expected.update({prefix + k: v for k, v in spec.tensors.items()})
        trainable.update({prefix + k: v for k, v in spec.trainable.items()})
    model = {k: v for k, v in entries.items() if not k.startswith((checkpoint.OPTIMIZER_PREFIX, "train."))}
    missing, unexpected = sorted(set(expected) - set(model)), sorted(set(model) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{where} is for another model: missing {missing[:3]}, unexpected {unexpected[:3]}; "
                              "resume with the [model] (and --model-factory) it was made with")
    for name, (shape, dtype) in expected.items():
        got = (tuple(model[name].size), model[name].properties.dtype)
        if got != (shape, dtype):
            raise CheckpointError(f"{where}: {name} is {got} but this config's model has {(shape, dtype)}; resume "
                                  "with the [model], seq_len and dtype it was made with")
    for key, entry in entries.items():
        if not key.startswith(checkpoint.OPTIMIZER_PREFIX):
            continue
        name = key[len(checkpoint.OPTIMIZER_PREFIX):].rpartition(".")[0]
        if name not in trainable or tuple(entry.size) not in ((), trainable[name]) \
                or not entry.properties.dtype.is_floating_point:
            raise CheckpointError(f"{where}: optimizer state {key!r} does not match the model's parameters; the "
                                  "checkpoint is damaged or from another model")
    if checkpoint.STEP_KEY not in entries:
        raise CheckpointError(f"{where} has no {checkpoint.STEP_KEY!r}; it was not written by recycle")


def _check_fingerprint(where: Path, saved: Any, current: dict[str, Any], warnings: list[str],
                       repartition_ok: bool) -> None:
    if not isinstance(saved, dict):
        warnings.append(f"{where} has no run fingerprint (its directory had no {checkpoint.RUN_FILE}): only its "
                        "tensor shapes were checked against the config")
        return
    # The built-in GPT's keys are the whole model's, so its stages may re-partition; a factory's split is its own.
    must = [k for k in RESUME_MUST_MATCH if not (k == "num_stages" and repartition_ok)]
    changed = [k for k in must if k in saved and saved[k] != current.get(k)]
    if changed:
        detail = ", ".join(f"{k} {saved[k]!r} -> {current.get(k)!r}" for k in changed)
        raise CheckpointError(f"{where} was made by a different run ({detail}); these must match to resume "
                              f"(see docs/runtime.md): use the config it was made with, or start without --resume")
    for k in RESUME_MAY_CHANGE:
        if k in saved and saved[k] != current.get(k):
            warnings.append(f"{k} changed since the checkpoint ({saved[k]!r} -> {current.get(k)!r}); the resumed "
                            "run continues with the new value")
    if repartition_ok and saved.get("num_stages", current["num_stages"]) != current["num_stages"]:
        warnings.append(f"the checkpoint was written with num_stages = {saved['num_stages']}; its layers are "
                        f"re-partitioned over {current['num_stages']} stages")


def _dumps(data: dict[str, Any]) -> str:
    import json

    return json.dumps(data, indent=1, sort_keys=True) + "\n"
