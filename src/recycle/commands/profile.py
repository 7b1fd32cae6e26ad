"""`recycle profile`: measure the real model's per-stage costs on this machine and write them as a "us" config."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict

from recycle.commands import add_checkpointing_option, add_set_option, checkpointing_override
from recycle.config import Config, ModelSpec, load_config
from recycle.errors import ConfigError

__all__ = ["register", "run"]


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "profile", help="measure per-stage F/B/W/optimizer times, memory and comm costs into a config",
        description="Measure the config's model stage by stage on this machine (one thread, like a worker): "
                    "forward, backward-input, backward-weight, fused backward and optimizer times (medians), "
                    "activation bytes per micro-batch, message sizes, parameter and optimizer-state bytes, and "
                    "gloo p2p/all-reduce costs between 2 processes. Writes the input config with time_unit = "
                    "\"us\" and the measured [costs], [memory] and [communication] sections, ready for "
                    "`recycle plan --config OUT` and `recycle train --emulate-costs`.")
    p.add_argument("--config", required=True, help="TOML config whose [model] and [workload] to profile")
    add_set_option(p)
    p.add_argument("--hf", default="", metavar="CONFIG_JSON|DIR",
                   help="profile the Hugging Face causal LM of this config JSON or save_pretrained folder (as "
                        "`recycle train --hf`; same as [model] hf_config)")
    p.add_argument("--model-factory", default="", metavar="MODULE:FUNC",
                   help="profile the stages of this model factory (as `recycle train --model-factory`)")
    add_checkpointing_option(p)
    p.add_argument("--out", required=True, metavar="COSTS.toml", help="where to write the profiled config")
    p.add_argument("--repeats", type=int, default=20, metavar="N", help="timed repeats per action (default 20)")
    p.add_argument("--warmup", type=int, default=3, metavar="N", help="untimed warm-up repeats (default 3)")
    p.add_argument("--comm", choices=("measure", "defaults"), default="measure",
                   help="measure p2p/all-reduce with 2 gloo processes (a few seconds), or use documented "
                        "loopback defaults")
    p.add_argument("--json", action="store_true", help="print the measurements as one JSON object")
    p.set_defaults(func=run)
    return p


MAX_REPEATS = 10_000


def _say_what_is_profiled(config: Config, model_factory: str) -> None:
    """Name the model measured (the one `recycle train` would train), so that a config without [model] does not
    silently profile the default one."""
    if model_factory:
        print(f"profiling the stages of model factory {model_factory!r}", file=sys.stderr)
        return
    if config.model.hf_config:
        from recycle.models.hf import describe_hf_model
        from recycle.runtime.worker.stage import hf_path

        print(f"profiling {describe_hf_model(hf_path(config), config.workload.seq_len)}", file=sys.stderr)
        return
    from recycle.models.gpt import resolve_shape

    shape = resolve_shape(config.model, config.workload.seq_len)
    what = (f"the built-in GPT, preset {config.model.preset!r} ({shape.n_layer} layers, n_embd {shape.n_embd}, "
            f"{shape.num_parameters:,} parameters)")
    if config.model == ModelSpec():
        print(f"note: {config.source or config.name} has no [model] settings: profiling {what}; add a [model] "
              "section to profile another model", file=sys.stderr)
    else:
        print(f"profiling {what}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from recycle.runtime.tools.profiler import profile_config, write_profile  # imports torch: only when used

    hf = [f"model.hf_config={json.dumps(os.path.abspath(args.hf))}"] if args.hf else []
    config = load_config(args.config, [*args.set, *hf, *checkpointing_override(args)])
    for flag, value in (("--repeats", args.repeats), ("--warmup", args.warmup)):
        if value > MAX_REPEATS:
            raise ConfigError(f"{flag} {value} is above the limit of {MAX_REPEATS:,} (each times every stage's "
                              "actions once more; the medians settle within tens); use e.g. 20")
    from recycle.runtime.control.preflight import check_model_memory
    from recycle.runtime.worker.stage import check_one_model

    check_one_model(config, args.model_factory)
    if not args.model_factory:
        check_model_memory(config, workers=1, whole=True)  # this process builds every stage
    _say_what_is_profiled(config, args.model_factory)
    profile = profile_config(config, repeats=args.repeats, warmup=args.warmup, comm=args.comm,
                             model_factory=args.model_factory)
    path, _ = write_profile(config, profile, args.out)
    if args.json:
        print(json.dumps({"out": str(path), "stages": [asdict(s) for s in profile.stages],
                          "comm": asdict(profile.comm), "repeats": profile.repeats, "warmup": profile.warmup}))
        return 0
    print(f"{config.name}: D={config.num_replicas} S={config.num_stages} M={config.num_microbatches}, "
          f"micro-batch {config.workload.microbatch_size} x {config.workload.seq_len} tokens, "
          f"{config.training.dtype}; median of {profile.repeats} repeats, 1 thread")
    checkpointing = config.model.activation_checkpointing
    if checkpointing != "none":  # B and W include the recompute; act KiB is what the checkpointed regions keep
        print(f"activation checkpointing {checkpointing!r}: a backward rebuilds up to 'rebuilt KiB' at a time")
    rebuilt = f" {'rebuilt KiB':>11}" if checkpointing != "none" else ""
    header = f"{'stage':>5} {'F us':>8} {'B us':>8} {'W us':>8} {'BW us':>8} {'OPT us':>8} {'act KiB':>9} " \
             f"{'msg KiB':>8} {'param KiB':>10}{rebuilt}"
    print(header)
    for s, st in enumerate(profile.stages):
        rebuilt = f" {st.recompute_bytes / 1024:11.1f}" if checkpointing != "none" else ""
        print(f"{s:>5} {st.forward_us:8.0f} {st.backward_input_us:8.0f} {st.backward_weight_us:8.0f} "
              f"{st.backward_fused_us:8.0f} {st.optimizer_us:8.0f} {st.activation_bytes / 1024:9.1f} "
              f"{st.message_bytes / 1024:8.1f} {st.parameter_bytes / 1024:10.1f}{rebuilt}")
    c = profile.comm
    print(f"comm ({c.source}): p2p {c.p2p_latency_us:.1f} us + bytes / {c.p2p_bandwidth:.0f} B/us; all-reduce "
          f"{c.allreduce_latency_us:.1f} us per ring step + bytes / {c.allreduce_bandwidth:.0f} B/us")
    print(f"wrote {path}")
    return 0
