"""Job configuration: TOML -> frozen dataclasses, validated with messages that name the key, the rule and the fix."""

from __future__ import annotations

import hashlib
import json
import math
import tomllib
import types
import typing
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, is_dataclass, replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from recycle.errors import ConfigError

__all__ = [
    "Topology",
    "Workload",
    "StageCosts",
    "Memory",
    "Communication",
    "ModelSpec",
    "Training",
    "Config",
    "load_config",
    "parse_config",
    "config_from_dict",
    "apply_overrides",
    "TIME_UNITS",
    "uniform_config",
    "SIZE_LIMITS",
    "MAX_PLAN_PAIRS",
    "LR_SCHEDULES",
    "CHECKPOINTING_MODES",
]

TIME_UNITS = ("slot", "us")
# Larger magnitudes overflow the simulator's sums to inf (1e15 us is 30 years; 1e15 bytes is a petabyte).
MAX_MAGNITUDE = 1e15
MAX_INT = 2**63 - 1  # what torch, numpy and every store record hold in a 64-bit integer
MAX_CONFIG_BYTES = 16 * 1024 * 1024  # a config with per-stage lists for the most stages is a few hundred KB

# Upper bounds on the sizes a config sets (issue 21, item 3): far above any job run so far (Llama 3 405B: 16,384 GPUs
# as 128 pipelines x 16 stages x 8-way tensor parallelism, 126 layers, a vocabulary of 128,256), low enough that
# no loop or allocation sized by them runs away before a message. Every command builds at least one whole plan
# (every (stage, micro-batch) pair of every pipeline), so D x S x M is bounded too (MAX_PLAN_PAIRS).
SIZE_LIMITS: dict[tuple[str, str], tuple[int, str]] = {
    ("topology", "num_replicas"): (65_536, "4x the 16,384 GPUs of Llama 3's largest job, one replica each"),
    ("topology", "num_stages"): (1_024, "8x the deepest model's layer count of 126 (Llama 3 405B), one layer per "
                                 "stage"),
    ("topology", "gpus_per_worker"): (1_024, "a worker is one tensor-parallel group (8 GPUs in Llama 3)"),
    ("topology", "workers_per_node"): (1_024, "a node holds a few workers (8 GPUs in a DGX node)"),
    ("workload", "num_microbatches"): (65_536, "per pipeline per iteration; schedules use 1-8 x num_stages"),
    ("workload", "microbatch_size"): (1_048_576, "samples per micro-batch"),
    ("workload", "seq_len"): (1_048_576, "a million tokens, the longest contexts trained"),
    ("model", "vocab_size"): (2_097_152, "16x Llama 3's 128,256 tokens"),
    ("model", "n_layer"): (1_024, "8x Llama 3 405B's 126 layers"),
    ("model", "n_head"): (65_536, "at most one head per channel of n_embd"),
    ("model", "n_embd"): (65_536, "4x Llama 3 405B's 16,384"),
    ("training", "steps"): (1_000_000_000, "a billion steps; Llama 3 405B trained for about 1.2 million"),
    ("training", "warmup_steps"): (1_000_000_000, "at most [training] steps' limit"),
    ("training", "lr_decay_steps"): (1_000_000_000, "at most [training] steps' limit"),
    ("training", "wsd_decay_steps"): (1_000_000_000, "at most [training] steps' limit"),
    ("training", "eval_every"): (1_000_000_000, "at most [training] steps' limit"),
    ("training", "eval_batches"): (65_536, "an evaluation of 65,536 global batches already outlasts most steps"),
}
CHECKPOINTING_MODES = ("none", "full", "per_layer")  # [model] activation_checkpointing (recycle.models.checkpointing)
LR_SCHEDULES = ("constant", "cosine", "linear", "wsd")  # [training] lr_schedule (runtime.state.optim.lr_factor)
# Tokens a micro-batch carries (microbatch_size x seq_len): every worker allocates activations of this many tokens.
MAX_MICROBATCH_TOKENS = 16_777_216  # Llama 3's whole global batch of 16M tokens in one micro-batch
MAX_GPUS = 1_048_576  # D x S x gpus_per_worker: 64x Llama 3's 16,384 GPUs
# A plan holds about 3 actions per (stage, micro-batch) of each pipeline: ~1.4 KB and ~20 us to build and time each
# (a 1,000 x 4 x 250 schedule: 1.4 GB, 20 s), so D x S x M stays below about a million.
MAX_PLAN_PAIRS = 1_048_576

Floats = tuple[float, ...]
Ints = tuple[int, ...]


# The TOML schema (`_SCHEMA`, after Config) is read off the dataclasses below: a field's type hint gives its TOML
# type, a field without a default is a required key. Field metadata says what a hint cannot:
#   per_stage: one number for all stages or a list with one per stage (a tuple of S values in the dataclass);
#   default:   the value when the TOML leaves the key out, for a field whose dataclass has no default (None: the
#              section's builder derives it);
#   toml:      False for a field that is not a TOML key.
def _per_stage(default: float | None = None, required: bool = False) -> Any:
    """A per-stage field; `default` (before expansion to one per stage) when the TOML leaves it out."""
    return field(metadata={"per_stage": True} if required else {"per_stage": True, "default": default})


def _toml_default(default: Any) -> Any:
    """A field the TOML may leave out (then `default`), though the dataclass makes callers pass it."""
    return field(metadata={"default": default})


@dataclass(frozen=True)
class Topology:
    num_replicas: int
    num_stages: int
    gpus_per_worker: int = 1  # a worker may be a tensor-parallel group; losing any GPU loses the worker
    # Workers per node, ranks numbered replica * S + stage (a pipeline's stages are packed onto consecutive nodes);
    # 0 = not given: every message is priced at the p2p cost. See Communication.inter_node_*.
    workers_per_node: int = 0
    # Virtual stages: the model is cut into num_stages x chunks_per_worker chunks and each worker holds
    # chunks_per_worker of them, placed by chunk_layout (recycle.ir.chunks): "interleaved" (worker w holds chunks
    # w, w+S, ...) or "v" (C = 2: chunks w and 2S-1-w, the ZBV / DualPipeV shape). 1 = one stage per worker.
    chunks_per_worker: int = 1
    chunk_layout: str = "interleaved"

    def node(self, rank: int) -> int:
        """The node hosting `rank` (0 for every rank when workers_per_node is not given)."""
        return rank // self.workers_per_node if self.workers_per_node > 0 else 0

    @property
    def num_workers(self) -> int:
        return self.num_replicas * self.num_stages

    def rank(self, replica: int, stage: int) -> int:
        return replica * self.num_stages + stage

    def worker(self, rank: int) -> tuple[int, int]:
        return divmod(rank, self.num_stages)


@dataclass(frozen=True)
class Workload:
    num_microbatches: int  # per pipeline per iteration
    microbatch_size: int = 1  # samples per micro-batch
    seq_len: int = 64  # tokens per sample (runtime and throughput in tokens)


@dataclass(frozen=True)
class StageCosts:
    """Per-stage durations in the config's time unit."""

    forward: Floats = _per_stage(required=True)
    backward_input: Floats = _per_stage(required=True)
    backward_weight: Floats = _per_stage(required=True)
    optimizer: Floats = _per_stage(0.0)
    backward_fused: Floats = _per_stage()  # B+W in one action; defaults to backward_input + backward_weight

    def backward(self, stage: int) -> float:
        return self.backward_input[stage] + self.backward_weight[stage]


@dataclass(frozen=True)
class Memory:
    activation_bytes: Ints = _per_stage(0)  # per micro-batch, held from F start to W end (BW end when coupled)
    capacity_bytes: int = _toml_default(0)  # activation budget per worker; 0 = unlimited
    parameter_bytes: Ints = _per_stage(0)  # per stage, for re-join state transfer and all-reduce size
    optimizer_state_bytes: Ints = _per_stage(0)  # per stage (e.g. Adam moments, fp32 master weights)
    # Per stage, with activation checkpointing: what one B or W rebuilds and frees again (the largest checkpointed
    # region's activations), held by one micro-batch at a time on top of the live micro-batches' activation_bytes.
    recompute_bytes: Ints = _per_stage(0)


@dataclass(frozen=True)
class Communication:
    p2p_latency: float = _toml_default(0.0)  # time units per message
    p2p_bandwidth: float = _toml_default(0.0)  # bytes per time unit; 0 = infinite
    # Per stage: size of stage s's forward output (= input-gradient sent back to s).
    activation_message_bytes: Ints = _per_stage(0)
    allreduce_latency: float = _toml_default(0.0)  # time units per ring step
    allreduce_bandwidth: float = _toml_default(0.0)  # bytes per time unit; 0 = infinite
    gradient_bytes: Ints = _per_stage(0)  # per stage: bytes all-reduced by the stage's DP group
    # Messages between workers on different nodes ([topology] workers_per_node); None = the p2p values.
    inter_node_latency: float | None = None
    inter_node_bandwidth: float | None = None

    def transfer_time(self, nbytes: float) -> float:
        """Time to move `nbytes` of state over one p2p link (0 when there is nothing to move or bandwidth is
        infinite)."""
        if self.p2p_bandwidth <= 0 or nbytes <= 0:
            return 0.0
        return self.p2p_latency + nbytes / self.p2p_bandwidth

    def p2p_time(self, stage_boundary: int) -> float:
        """Time to send stage `stage_boundary`'s forward output (or the matching input-gradient back)."""
        size = self.activation_message_bytes[stage_boundary]
        transfer = size / self.p2p_bandwidth if self.p2p_bandwidth > 0 else 0.0
        return self.p2p_latency + transfer

    def inter_node_time(self, stage_boundary: int) -> float:
        """Like p2p_time, for a message that crosses nodes (the inter-node latency and bandwidth when given)."""
        latency = self.p2p_latency if self.inter_node_latency is None else self.inter_node_latency
        bandwidth = self.p2p_bandwidth if self.inter_node_bandwidth is None else self.inter_node_bandwidth
        size = self.activation_message_bytes[stage_boundary]
        return latency + (size / bandwidth if bandwidth > 0 else 0.0)

    def allreduce_time(self, stage: int, num_live: int) -> float:
        """Ring all-reduce cost over `num_live` replicas: 2(n-1) steps, each moving 1/n of the buffer."""
        if num_live <= 1:
            return 0.0
        steps = 2 * (num_live - 1)
        size = self.gradient_bytes[stage]
        transfer = steps / num_live * size / self.allreduce_bandwidth if self.allreduce_bandwidth > 0 else 0.0
        return steps * self.allreduce_latency + transfer


@dataclass(frozen=True)
class ModelSpec:
    """The built-in GPT used by the runtime. Planner and simulator read only the layer partition, and only to
    re-partition layers (`recycle.planner.partition`)."""

    preset: str = "tiny"
    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    # Layers per stage of the configured partition (its per-stage [costs] and [memory] follow it); empty = n_layer
    # split as evenly as possible, earlier stages taking the extra layer (models.gpt.stage_layers).
    layers_per_stage: tuple[int, ...] = ()
    hf_config: str = ""  # a Hugging Face config JSON (or save_pretrained folder): train that causal LM instead
    hf_weights: str = ""  # its initial weights: a .safetensors file or save_pretrained folder (recycle.models.hf)
    # "none", "full" (keep each stage's input, recompute the stage in B and W) or "per_layer" (keep each block's
    # input, recompute one block at a time): recycle.models.checkpointing. [costs] and [memory] are the stage's as it
    # runs in this mode (`recycle profile` measures them so).
    activation_checkpointing: str = "none"


@dataclass(frozen=True)
class Training:
    """Runtime training settings."""

    steps: int = 4
    lr: float = 1e-3
    weight_decay: float = 0.0
    grad_clip: float = 0.0  # 0 = no clipping
    seed: int = 0
    dtype: str = "float32"  # "float32", "float64", or "bfloat16" (bf16 autocast, float32 weights and state)
    # The corpus (recycle.runtime.worker.data): "builtin", a UTF-8 text file (its bytes, or its tokens with
    # `tokenizer`), a token file (with `token_dtype`), or a Hugging Face dataset folder from save_to_disk (column
    # `dataset_column`).
    dataset: str = "builtin"
    token_dtype: str = ""  # "uint16" or "uint32": `dataset` is a token file of ids of that width (nanoGPT's .bin)
    tokenizer: str = ""  # a local tokenizer.json (tokenizers) that encodes a text `dataset` or text column
    dataset_column: str = ""  # of a Hugging Face dataset; "" = "text" with a tokenizer, else "input_ids"
    data_order: str = "random"  # "random" (hashed window offsets) or "epochs" (disjoint windows shuffled from seed)
    eval_fraction: float = 0.0  # the corpus's tail held out from training, for evaluation
    eval_every: int = 0  # evaluate on the held-out split after every this many steps (0 = never)
    eval_batches: int = 1  # global batches (D x M micro-batches each) of the held-out split per evaluation
    data_source: str = ""  # "package.module:function" (config) -> DataSource, instead of `dataset` (--data-source)
    optimizer: str = "AdamW"  # any torch.optim optimizer class, by name
    # Optimizer arguments passed only when set (None: the optimizer's own default); lr and weight_decay always are.
    betas: tuple[float, float] | None = None
    eps: float | None = None
    momentum: float | None = None
    dampening: float | None = None
    nesterov: bool | None = None
    amsgrad: bool | None = None
    # After the warm-up (torch.optim.lr_scheduler.LambdaLR; runtime.state.optim.lr_factor): "constant", "cosine" or
    # "linear" decay to min_lr, or "wsd" (warmup-stable-decay: constant, then a linear decay over the last
    # wsd_decay_steps).
    lr_schedule: str = "constant"
    warmup_steps: int = 0  # linear warm-up: step k (0-based) uses lr * (k + 1) / warmup_steps
    min_lr: float = 0.0  # where the decay ends
    lr_decay_steps: int = 0  # the step at which the decay reaches min_lr; 0 = [training] steps
    wsd_decay_steps: int = 0  # "wsd": the decay's length (it ends at lr_decay_steps); required there, else 0


@dataclass(frozen=True)
class Config:
    name: str
    time_unit: str
    topology: Topology
    workload: Workload
    costs: StageCosts
    memory: Memory
    communication: Communication
    model: ModelSpec = field(default_factory=ModelSpec)
    training: Training = field(default_factory=Training)
    source: str = field(default="", metadata={"toml": False})  # path the config was read from, for messages

    @property
    def num_replicas(self) -> int:
        return self.topology.num_replicas

    @property
    def num_stages(self) -> int:
        return self.topology.num_stages

    @property
    def num_microbatches(self) -> int:
        return self.workload.num_microbatches

    def planning_dict(self) -> dict[str, Any]:
        """Everything that affects plans and their timing (not the runtime's model or training settings)."""
        # The node keys are left out while unset, so configs without them keep their fingerprints (plan stores).
        topology = {k: v for k, v in asdict(self.topology).items() if k != "workers_per_node" or v}
        if self.topology.chunks_per_worker == 1:  # one chunk per worker: the fingerprints of before chunks existed
            del topology["chunks_per_worker"], topology["chunk_layout"]
        comm = {k: v for k, v in asdict(self.communication).items() if not k.startswith("inter_node") or v is not None}
        # Likewise recompute_bytes while every stage's is 0 (no activation checkpointing).
        memory = {k: v for k, v in asdict(self.memory).items() if k != "recompute_bytes" or any(v)}
        return {
            "time_unit": self.time_unit,
            "topology": topology,
            "workload": asdict(self.workload),
            "costs": asdict(self.costs),
            "memory": memory,
            "communication": comm,
        }

    def fingerprint(self) -> str:
        """A stable hash of the planning-relevant config; plan stores carry it."""
        cached = self.__dict__.get("_fingerprint")
        if cached is None:
            # Computed once per instance: the planner asks for it several times per plan (a trace replay plans
            # hundreds), and every field is immutable (frozen dataclasses of numbers, strings and tuples).
            blob = json.dumps(self.planning_dict(), sort_keys=True, separators=(",", ":"))
            cached = hashlib.sha256(blob.encode()).hexdigest()[:16]
            object.__setattr__(self, "_fingerprint", cached)
        return cached

    def one_chunk(self) -> "Config":
        """This config with one stage per worker (itself when it has one): the same workers, costs and memory."""
        if self.topology.chunks_per_worker == 1:
            return self
        return replace(self, topology=replace(self.topology, chunks_per_worker=1, chunk_layout="interleaved"))

    def with_topology(self, num_replicas: int | None = None, num_stages: int | None = None,
                      num_microbatches: int | None = None) -> "Config":
        """A copy with a new D, S or M; per-stage lists must then be uniform (or S unchanged)."""
        raw = self.to_dict()
        if num_replicas is not None:
            raw["topology"]["num_replicas"] = num_replicas
        if num_stages is not None and num_stages != self.num_stages:
            for section, keys in _PER_STAGE_KEYS.items():
                for key in keys:
                    values = raw[section][key]
                    if len(set(values)) != 1:
                        raise ConfigError(
                            f"cannot change num_stages of {self.name!r}: [{section}] {key} = {list(values)} differs "
                            "per stage; give per-stage values for the new stage count instead"
                        )
                    raw[section][key] = values[0]
            raw["topology"]["num_stages"] = num_stages
        if num_microbatches is not None:
            raw["workload"]["num_microbatches"] = num_microbatches
        return parse_config(raw, name=self.name, source=self.source)

    def to_dict(self) -> dict[str, Any]:
        d = self.planning_dict()
        d["model"] = asdict(self.model)
        d["training"] = {k: v for k, v in asdict(self.training).items() if v is not None}  # None = not set
        d["name"] = self.name
        for section in d.values():
            if isinstance(section, dict):
                for k, v in section.items():
                    if isinstance(v, tuple):
                        section[k] = list(v)
        return d


def _kind(hint: Any, per_stage: bool) -> str:
    """The TOML type `_check_type` checks for a field with this type hint."""
    if isinstance(hint, types.UnionType):  # `X | None`: None means "not set", which TOML cannot write
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    if typing.get_origin(hint) is tuple:
        item, *rest = typing.get_args(hint)
        if rest != [Ellipsis]:
            return "floatpair"  # tuple[float, float]
        if per_stage:
            return "stageint" if item is int else "stagefloat"
        return "intlist"
    return {int: "int", float: "float", str: "str", bool: "bool"}[hint]


def _keys(cls: type) -> dict[str, str]:
    """TOML key -> kind, for the fields of dataclass `cls` that are TOML keys (in field order)."""
    hints = typing.get_type_hints(cls)
    return {f.name: _kind(hints[f.name], bool(f.metadata.get("per_stage")))
            for f in fields(cls) if f.metadata.get("toml", True) and not is_dataclass(hints[f.name])}


def _required(f: Field) -> bool:
    return f.default is MISSING and f.default_factory is MISSING and "default" not in f.metadata


_CONFIG_HINTS = typing.get_type_hints(Config)
_SECTIONS: dict[str, type] = {f.name: _CONFIG_HINTS[f.name] for f in fields(Config)
                              if is_dataclass(_CONFIG_HINTS[f.name])}  # TOML table -> its dataclass
_SCHEMA: dict[str, dict[str, str]] = {section: _keys(cls) for section, cls in _SECTIONS.items()}
_TOP_LEVEL = _keys(Config)
_REQUIRED = {section: tuple(f.name for f in fields(cls) if _required(f)) for section, cls in _SECTIONS.items()}
_PER_STAGE_KEYS = {section: tuple(f.name for f in fields(cls) if f.metadata.get("per_stage"))
                   for section, cls in _SECTIONS.items()}


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read and validate a TOML config file, with `section.key=value` overrides applied (see apply_overrides)."""
    from recycle.inputs import read_input_text

    path = Path(path)
    text = read_input_text(path, f"config file {str(path)!r}", MAX_CONFIG_BYTES,
                           "pass --config with a path to a TOML file (e.g. configs/toy.toml)")
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}; fix the syntax at that line") from None
    except RecursionError:
        raise ConfigError(f"config file {str(path)!r} nests arrays or tables too deeply to read; a config nests "
                          "two levels") from None
    except ValueError:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise ConfigError(f"config file {str(path)!r} holds an integer of more than 4,300 digits; every value of a "
                          "config fits in 64 bits") from None
    raw = apply_overrides(raw, overrides)
    return parse_config(raw, name=raw.get("name", path.stem), source=str(path))


def config_from_dict(raw: Mapping[str, Any], overrides: Sequence[str] = (), name: str = "config") -> Config:
    """Validate a mapping shaped like the TOML file (sections as dicts) and build the Config; the same rules and
    messages as load_config. `overrides` are applied first."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"a config must be a mapping of sections (got {type(raw).__name__}); pass e.g. "
                          "{'topology': {...}, 'workload': {...}, 'costs': {...}}")
    raw = apply_overrides(raw, overrides)
    return parse_config(raw, name=raw.get("name", name))


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `raw` with each `section.key=value` (or top-level `key=value`) set. The value is read as a TOML
    value (`1e-3`, `4`, `[1, 2]`, `"text"`, `true`); a bare word that is not TOML is taken as a string. Unknown
    sections and keys are refused naming the known ones; types are checked by parse_config as for the file."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for text in overrides:
        name, sep, value_text = text.partition("=")
        name = name.strip()
        if not sep or not name:
            raise ConfigError(f"override {text!r} must look like section.key=value, e.g. training.lr=1e-3")
        section, dot, key = name.rpartition(".")
        if not dot:
            if name not in _TOP_LEVEL:
                raise ConfigError(f"override {text!r}: {name!r} is not a top-level key ({', '.join(sorted(_TOP_LEVEL))}"
                                  f"); name a section key as section.key, sections: {', '.join(sorted(_SCHEMA))}")
        elif section not in _SCHEMA:
            raise ConfigError(f"override {text!r}: unknown section {section!r}; known sections: "
                              f"{', '.join(sorted(_SCHEMA))}")
        elif key not in _SCHEMA[section]:
            raise ConfigError(f"override {text!r}: unknown key {key!r} in [{section}]; known keys: "
                              f"{', '.join(sorted(_SCHEMA[section]))}")
        value = _override_value(value_text.strip())
        if dot:
            table = out.setdefault(section, {})
            if not isinstance(table, dict):
                raise ConfigError(f"override {text!r}: {section!r} is not a table in the config")
            table[key] = value
        else:
            out[name] = value
    return out


def _override_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word such as a path: the key's type check decides whether a string is right
    except RecursionError:
        raise ConfigError(f"override value {text[:40]!r}... nests arrays too deeply to read") from None
    except ValueError:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise ConfigError(f"override value {text[:20]!r}... is an integer of more than 4,300 digits; every value of "
                          "a config fits in 64 bits") from None


def _where(source: str, section: str, key: str) -> str:
    prefix = f"{source}: " if source else ""
    return f"{prefix}[{section}] {key}" if section else f"{prefix}{key}"


def _check_type(value: Any, kind: str, where: str) -> Any:
    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    def is_num(v: Any) -> bool:
        return (is_int(v) or isinstance(v, float)) and not isinstance(v, bool)

    if kind == "int":
        if not is_int(value):
            raise ConfigError(f"{where} = {value!r} must be an integer; write it without quotes or decimals")
        if abs(value) > MAX_INT:
            raise ConfigError(f"{where} = {value} does not fit in 64 bits (|value| <= 2**63 - 1); use a smaller "
                              "number")
        return value
    if kind == "float":
        if not is_num(value):
            raise ConfigError(f"{where} = {value!r} must be a number")
        if not math.isfinite(float(value)):
            raise ConfigError(f"{where} = {value!r} must be finite; use 0 to mean 'infinite bandwidth'")
        if abs(value) > MAX_MAGNITUDE:
            raise ConfigError(f"{where} = {value!r} is too large (|value| <= {MAX_MAGNITUDE:g}); check the unit")
        return float(value)
    if kind == "intlist":
        if not isinstance(value, list) or not all(is_int(v) for v in value):
            raise ConfigError(f"{where} = {value!r} must be a list of whole numbers, one per stage, e.g. [8, 8, 8, 8]")
        if any(abs(v) > MAX_INT for v in value):
            raise ConfigError(f"{where}: every entry must fit in 64 bits (|value| <= 2**63 - 1); use smaller numbers")
        return tuple(value)
    if kind == "str":
        if not isinstance(value, str):
            raise ConfigError(f"{where} = {value!r} must be a string in quotes")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"{where} = {value!r} must be true or false (without quotes)")
        return value
    if kind == "floatpair":
        if not (isinstance(value, list) and len(value) == 2):
            raise ConfigError(f"{where} = {value!r} must be a list of two numbers, e.g. [0.9, 0.95]")
        return tuple(_check_type(v, "float", where) for v in value)
    if kind in ("stagefloat", "stageint"):
        check = is_int if kind == "stageint" else is_num
        conv = int if kind == "stageint" else float
        what = "an integer" if kind == "stageint" else "a number"
        if isinstance(value, list):
            for v in value:
                if not check(v):
                    raise ConfigError(f"{where} = {value!r}: every entry must be {what}")
                if not math.isfinite(v) or abs(v) > MAX_MAGNITUDE:
                    raise ConfigError(f"{where} = {value!r}: entry {v!r} must be a finite number with |value| <= "
                                      f"{MAX_MAGNITUDE:g} (nan and inf are not durations or sizes)")
            return [conv(v) for v in value]
        if not check(value):
            raise ConfigError(f"{where} = {value!r} must be {what} for all stages or a list with one per stage")
        if not math.isfinite(value) or abs(value) > MAX_MAGNITUDE:
            raise ConfigError(f"{where} = {value!r} must be a finite number with |value| <= {MAX_MAGNITUDE:g} "
                              "(nan and inf are not durations or sizes)")
        return conv(value)
    raise AssertionError(kind)


def _per_stage_tuple(value: Any, num_stages: int, where: str) -> tuple:
    if isinstance(value, list):
        if len(value) != num_stages:
            raise ConfigError(
                f"{where} has {len(value)} entries but num_stages = {num_stages}; give one value per stage "
                "or a single number for all stages"
            )
        return tuple(value)
    return (value,) * num_stages


def parse_config(raw: dict[str, Any], name: str = "config", source: str = "") -> Config:
    """Validate a raw TOML mapping and build the frozen Config."""
    top, checked = _check_keys(raw, source)
    time_unit = top.get("time_unit", "slot")
    if time_unit not in TIME_UNITS:
        raise ConfigError(f"{_where(source, '', 'time_unit')} = {time_unit!r} must be one of {list(TIME_UNITS)}")
    topology = _topology(checked["topology"], source)
    workload = _workload(checked["workload"], source)
    _check_plan_size(topology, workload, source)
    S = topology.num_stages
    return Config(
        name=top.get("name", name),
        time_unit=time_unit,
        topology=topology,
        workload=workload,
        costs=_costs(checked["costs"], S, source),
        memory=_memory(checked["memory"], S, source),
        communication=_communication(checked["communication"], S, source),
        model=_model(checked["model"], S, source),
        training=_training(checked["training"], source),
        source=source,
    )


def _check_keys(raw: Mapping[str, Any], source: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(top-level values, section -> key -> value), every key known and of its type, every required key given."""
    checked: dict[str, dict[str, Any]] = {s: {} for s in _SCHEMA}
    top: dict[str, Any] = {}
    for key, value in raw.items():
        if key in _TOP_LEVEL:
            top[key] = _check_type(value, _TOP_LEVEL[key], _where(source, "", key))
            continue
        if key not in _SCHEMA:
            known = ", ".join(sorted([*_SCHEMA, *_TOP_LEVEL]))
            raise ConfigError(f"{_where(source, '', key)}: unknown section or key {key!r}; known: {known}")
        if not isinstance(value, dict):
            raise ConfigError(f"{_where(source, '', key)} must be a table; write it as [{key}]")
        for sub, v in value.items():
            if sub not in _SCHEMA[key]:
                known = ", ".join(sorted(_SCHEMA[key]))
                raise ConfigError(f"{_where(source, key, sub)}: unknown key {sub!r} in [{key}]; known keys: {known}")
            checked[key][sub] = _check_type(v, _SCHEMA[key][sub], _where(source, key, sub))
    for section, keys in _REQUIRED.items():
        for key in keys:
            if key not in checked[section]:
                raise ConfigError(f"{_where(source, section, key)} is missing; it is required, add it under [{section}]")
    return top, checked


def _fill(section: str, values: dict[str, Any], num_stages: int, source: str) -> dict[str, Any]:
    """A section's checked values with the TOML defaults of its fields filled in and per-stage values expanded to
    one per stage (each >= 0). A field left out with no TOML default keeps its dataclass default."""
    out: dict[str, Any] = {}
    for f in fields(_SECTIONS[section]):
        value = values.get(f.name, f.metadata.get("default"))
        if value is None:
            continue
        if f.metadata.get("per_stage"):
            value = _stage_values(value, num_stages, _where(source, section, f.name))
        out[f.name] = value
    return out


def _stage_values(value: Any, num_stages: int, where: str) -> tuple:
    out = _per_stage_tuple(value, num_stages, where)
    for v in out:
        if v < 0:
            raise ConfigError(f"{where} = {value!r} must be >= 0 (durations and sizes cannot be negative)")
    return out


def _at_least(values: Any, section: str, keys: Sequence[str], low: int, source: str, why: str = "") -> None:
    """Each of `keys` of the section's dataclass `values` is >= `low` (a None, meaning not set, passes)."""
    for key in keys:
        if (getattr(values, key) or 0) < low:
            raise ConfigError(f"{_where(source, section, key)} = {getattr(values, key)} must be >= {low}{why}")


def _at_most(values: Any, section: str, source: str) -> None:
    """Each key of the section with a SIZE_LIMITS entry is at most its limit (a None, meaning not set, passes)."""
    for (sec, key), (limit, why) in SIZE_LIMITS.items():
        value = getattr(values, key) if sec == section else None
        if value is not None and value > limit:
            raise ConfigError(f"{_where(source, section, key)} = {value} is above the limit of {limit:,} ({why}); "
                              "use a smaller value")


def _topology(t: dict[str, Any], source: str) -> Topology:
    topology = Topology(**t)
    _at_least(topology, "topology", ("num_replicas", "num_stages", "gpus_per_worker"), 1, source)
    _at_least(topology, "topology", ("workers_per_node",), 0, source,
              " (0 = not given: all messages priced at the p2p cost)")
    _at_most(topology, "topology", source)
    _check_chunks(topology, source)
    gpus = topology.num_workers * topology.gpus_per_worker
    if gpus > MAX_GPUS:
        raise ConfigError(f"{_where(source, 'topology', 'num_replicas')}: D x S x gpus_per_worker = "
                          f"{topology.num_replicas} x {topology.num_stages} x {topology.gpus_per_worker} = {gpus:,} "
                          f"GPUs is above the limit of {MAX_GPUS:,} (64x Llama 3's 16,384); use fewer replicas or "
                          "stages")
    return topology


def _check_chunks(topology: Topology, source: str) -> None:
    """chunks_per_worker >= 1 and a known chunk_layout; the V layout pairs exactly two chunks per worker."""
    from recycle.ir.chunks import CHUNK_LAYOUTS, MAX_CHUNKS

    chunks, layout = topology.chunks_per_worker, topology.chunk_layout
    if not 1 <= chunks <= MAX_CHUNKS:
        raise ConfigError(f"{_where(source, 'topology', 'chunks_per_worker')} = {chunks} must be in [1, {MAX_CHUNKS}] "
                          "(model chunks, i.e. virtual stages, per worker); use 1 for one stage per worker or 2 for "
                          "interleaved / V-shape schedules")
    if layout not in CHUNK_LAYOUTS:
        raise ConfigError(f"{_where(source, 'topology', 'chunk_layout')} = {layout!r} is unknown; choose one of "
                          f"{list(CHUNK_LAYOUTS)} (interleaved: worker w holds chunks w, w+S, ...; v: chunks w and "
                          "2S-1-w)")
    if layout == "v" and chunks != 2:
        raise ConfigError(f"{_where(source, 'topology', 'chunk_layout')} = 'v' needs chunks_per_worker = 2 (a worker "
                          f"holds chunks w and 2S-1-w), but chunks_per_worker = {chunks}; set chunks_per_worker = 2 "
                          "or chunk_layout = \"interleaved\"")


def _workload(w: dict[str, Any], source: str) -> Workload:
    workload = Workload(**w)
    _at_least(workload, "workload", ("num_microbatches", "microbatch_size", "seq_len"), 1, source)
    _at_most(workload, "workload", source)
    tokens = workload.microbatch_size * workload.seq_len
    if tokens > MAX_MICROBATCH_TOKENS:
        raise ConfigError(f"{_where(source, 'workload', 'microbatch_size')}: microbatch_size x seq_len = "
                          f"{workload.microbatch_size} x {workload.seq_len} = {tokens:,} tokens per micro-batch is "
                          f"above the limit of {MAX_MICROBATCH_TOKENS:,} (Llama 3's whole 16M-token batch; every "
                          "worker holds activations of this many tokens); use smaller micro-batches and more of them")
    return workload


def _check_plan_size(topology: Topology, workload: Workload, source: str) -> None:
    """Every command builds at least one whole plan of the config (the simulator's 1F1B reference included): refuse
    D x S x M (stage, micro-batch) pairs above MAX_PLAN_PAIRS before any is built."""
    # Chunked workers hold chunks_per_worker virtual stages: S counts those here (a pair is one chunk's).
    D, S, M = topology.num_replicas, topology.num_stages * topology.chunks_per_worker, workload.num_microbatches
    if D * S * M > MAX_PLAN_PAIRS:
        raise ConfigError(f"{_where(source, 'workload', 'num_microbatches')}: D x S x M = {D} x {S} x {M} = "
                          f"{D * S * M:,} (stage, micro-batch) pairs is above the limit of {MAX_PLAN_PAIRS:,} (a plan "
                          "holds ~3 actions per pair, each ~1.4 KB and ~20 us to build and time: a million take "
                          "1.5 GB and 20 s); use fewer micro-batches or replicas")


def _costs(c: dict[str, Any], S: int, source: str) -> StageCosts:
    values = _fill("costs", c, S, source)
    forward, backward_input, backward_weight = values["forward"], values["backward_input"], values["backward_weight"]
    values.setdefault("backward_fused", tuple(bi + bw for bi, bw in zip(backward_input, backward_weight)))
    for s in range(S):
        if forward[s] <= 0:
            raise ConfigError(f"{_where(source, 'costs', 'forward')}: stage {s} has forward = {forward[s]}; "
                              "a forward must take positive time")
        if backward_input[s] + backward_weight[s] <= 0:
            raise ConfigError(f"{_where(source, 'costs', 'backward_input')}: stage {s} has zero backward time; "
                              "backward_input + backward_weight must be positive")
    return StageCosts(**values)


def _memory(m: dict[str, Any], S: int, source: str) -> Memory:
    memory = Memory(**_fill("memory", m, S, source))
    capacity = memory.capacity_bytes
    if capacity < 0:
        raise ConfigError(f"{_where(source, 'memory', 'capacity_bytes')} = {capacity} must be >= 0 (0 = unlimited)")
    if capacity > 0:
        for s in range(S):
            if memory.activation_bytes[s] == 0:
                raise ConfigError(f"{_where(source, 'memory', 'activation_bytes')} is 0 for stage {s} but "
                                  f"capacity_bytes = {capacity}; give activation bytes per micro-batch or set "
                                  "capacity_bytes = 0 (unlimited)")
            if memory.activation_bytes[s] > capacity:
                raise ConfigError(f"{_where(source, 'memory', 'activation_bytes')}: stage {s} needs "
                                  f"{memory.activation_bytes[s]} bytes per micro-batch, more than capacity_bytes = "
                                  f"{capacity}; raise capacity_bytes, use more stages or smaller micro-batches")
            if memory.activation_bytes[s] + memory.recompute_bytes[s] > capacity:
                raise ConfigError(f"{_where(source, 'memory', 'recompute_bytes')}: stage {s} needs "
                                  f"{memory.activation_bytes[s]} bytes per micro-batch plus "
                                  f"{memory.recompute_bytes[s]} rebuilt in a backward, more than capacity_bytes = "
                                  f"{capacity}; raise "
                                  "capacity_bytes, use more stages, smaller micro-batches or [model] "
                                  "activation_checkpointing = 'per_layer' (a smaller region to rebuild)")
    return memory


def _communication(cm: dict[str, Any], S: int, source: str) -> Communication:
    comm = Communication(**_fill("communication", cm, S, source))
    latencies_and_bandwidths = [f.name for f in fields(Communication) if not f.metadata.get("per_stage")]
    _at_least(comm, "communication", latencies_and_bandwidths, 0, source)
    return comm


def _model(m: dict[str, Any], S: int, source: str) -> ModelSpec:
    model = ModelSpec(**m)
    if model.layers_per_stage:
        per_stage = model.layers_per_stage
        where = _where(source, "model", "layers_per_stage")
        if len(per_stage) != S or any(n < 1 for n in per_stage):
            raise ConfigError(f"{where} = {list(per_stage)} must give one count >= 1 per stage ({S} stages): every "
                              "stage holds at least one layer")
        if "n_layer" in m and m["n_layer"] != sum(per_stage):
            raise ConfigError(f"{where} = {list(per_stage)} sums to {sum(per_stage)} layers but [model] n_layer = "
                              f"{m['n_layer']}; make them agree or drop n_layer (it defaults to the sum)")
        model = replace(model, n_layer=sum(per_stage))
    _at_least(model, "model", ("vocab_size", "n_layer", "n_head", "n_embd"), 1, source)
    _at_most(model, "model", source)
    if not 0 <= model.dropout <= 1:
        raise ConfigError(f"{_where(source, 'model', 'dropout')} = {model.dropout} must be in [0, 1] (the "
                          "probability of zeroing an activation, as torch.nn.Dropout takes it); e.g. 0 or 0.1")
    if model.activation_checkpointing not in CHECKPOINTING_MODES:
        raise ConfigError(f"{_where(source, 'model', 'activation_checkpointing')} = "
                          f"{model.activation_checkpointing!r} must be one of "
                          f"{', '.join(repr(m) for m in CHECKPOINTING_MODES)} ('full': keep each stage's input and "
                          "recompute the stage in the backward; 'per_layer': the same per transformer block)")
    if model.n_embd % model.n_head != 0:
        raise ConfigError(f"{_where(source, 'model', 'n_embd')} = {model.n_embd} must be divisible by n_head = "
                          f"{model.n_head}")
    return model


def _training(t: dict[str, Any], source: str) -> Training:
    training = Training(**t)
    if training.dtype not in ("float32", "float64", "bfloat16"):
        raise ConfigError(f"{_where(source, 'training', 'dtype')} = {training.dtype!r} must be 'float32', "
                          "'float64' or 'bfloat16' (bf16 autocast with float32 weights)")
    if training.lr_schedule not in LR_SCHEDULES:
        raise ConfigError(f"{_where(source, 'training', 'lr_schedule')} = {training.lr_schedule!r} must be one of "
                          f"{', '.join(repr(x) for x in LR_SCHEDULES)} (each after the optional warmup_steps)")
    if training.token_dtype not in ("", "uint16", "uint32"):
        raise ConfigError(f"{_where(source, 'training', 'token_dtype')} = {training.token_dtype!r} must be 'uint16' "
                          "or 'uint32' (the width of the token file's ids; nanoGPT writes uint16)")
    if training.data_order not in ("random", "epochs"):
        raise ConfigError(f"{_where(source, 'training', 'data_order')} = {training.data_order!r} must be 'random' "
                          "(windows at hashed offsets) or 'epochs' (disjoint windows, shuffled from the seed)")
    if not 0 <= training.eval_fraction < 1:
        raise ConfigError(f"{_where(source, 'training', 'eval_fraction')} = {training.eval_fraction} must be in "
                          "[0, 1) (the share of the corpus held out from training), e.g. 0.05")
    if training.data_source and training.dataset != "builtin":
        raise ConfigError(f"{_where(source, 'training', 'data_source')} = {training.data_source!r} and [training] "
                          f"dataset = {training.dataset!r} both say where the data comes from; keep one")
    if training.warmup_steps < 0 or training.lr_decay_steps < 0:
        raise ConfigError(f"{_where(source, 'training', 'warmup_steps/lr_decay_steps')}: need >= 0 (got "
                          f"{training.warmup_steps}, {training.lr_decay_steps}); 0 = no warm-up / decay over "
                          "[training] steps")
    if not 0 <= training.min_lr <= training.lr:
        raise ConfigError(f"{_where(source, 'training', 'min_lr')} = {training.min_lr} must be between 0 and lr = "
                          f"{training.lr} (where the cosine, linear or wsd decay ends)")
    _wsd_range(training, source)
    _eval_keys(training, source)
    if training.steps < 0 or training.lr <= 0 or training.grad_clip < 0:
        raise ConfigError(f"{_where(source, 'training', 'steps/lr/grad_clip')}: need steps >= 0, lr > 0, "
                          f"grad_clip >= 0 (got {training.steps}, {training.lr}, {training.grad_clip})")
    _at_most(training, "training", source)
    _optimizer_ranges(training, source)
    return training


def _eval_keys(training: Training, source: str) -> None:
    """An evaluation needs the held-out split that eval_fraction makes (a --data-source has none)."""
    if training.eval_every < 0 or training.eval_batches < 1:
        raise ConfigError(f"{_where(source, 'training', 'eval_every/eval_batches')}: need eval_every >= 0 (0 = no "
                          f"evaluation) and eval_batches >= 1 (got {training.eval_every}, {training.eval_batches})")
    if training.eval_every and training.eval_fraction == 0:
        raise ConfigError(f"{_where(source, 'training', 'eval_every')} = {training.eval_every} evaluates on the "
                          "held-out split, but [training] eval_fraction = 0 holds nothing out; set eval_fraction "
                          "(e.g. 0.05) or eval_every = 0")
    if training.eval_every and training.data_source:
        raise ConfigError(f"{_where(source, 'training', 'eval_every')} = {training.eval_every}: the data source "
                          f"{training.data_source!r} has no held-out split; evaluate with the built-in sources' "
                          "[training] eval_fraction, or set eval_every = 0")


def _wsd_range(training: Training, source: str) -> None:
    """wsd_decay_steps is the "wsd" schedule's own key, and its decay must fit after the warm-up."""
    where = _where(source, 'training', 'wsd_decay_steps')
    decay, schedule = training.wsd_decay_steps, training.lr_schedule
    if decay < 0:
        raise ConfigError(f"{where} = {decay} must be >= 0 (the length of the \"wsd\" schedule's final decay)")
    if schedule != "wsd":
        if decay:
            raise ConfigError(f"{where} = {decay} applies only to lr_schedule = \"wsd\", not {schedule!r}; drop it "
                              "or set lr_schedule = \"wsd\"")
        return
    end = training.lr_decay_steps or training.steps
    if decay == 0:
        raise ConfigError(f"{where} must be set for lr_schedule = \"wsd\": the number of final steps over which the "
                          f"rate decays to min_lr, e.g. {max(1, end // 5)} (a fifth of the {end} steps)")
    if training.warmup_steps + decay > end:
        raise ConfigError(f"{where} = {decay} plus warmup_steps = {training.warmup_steps} exceed the {end} steps "
                          f"the schedule spans (lr_decay_steps, else steps): the decay must start after the warm-up; "
                          f"use wsd_decay_steps <= {max(0, end - training.warmup_steps)}")


def _optimizer_ranges(training: Training, source: str) -> None:
    """The ranges torch.optim's constructors check (AdamW, Adam, SGD, ...), checked here so that a bad value fails
    once, up front, and for the fast AdamW too (which does not go through torch's constructor)."""
    def bad(key: str, value: Any, rule: str, fix: str) -> ConfigError:
        return ConfigError(f"{_where(source, 'training', key)} = {value} {rule} (torch.optim refuses it); {fix}")

    if training.weight_decay < 0:
        raise bad("weight_decay", training.weight_decay, "must be >= 0", "use 0 for none, e.g. 0.1")
    if training.eps is not None and training.eps < 0:
        raise bad("eps", training.eps, "must be >= 0", "e.g. 1e-8 (leave it out for the optimizer's default)")
    if training.betas is not None and not all(0 <= b < 1 for b in training.betas):
        raise bad("betas", list(training.betas), "must both be in [0, 1)", "e.g. [0.9, 0.95]")
    if training.momentum is not None and training.momentum < 0:
        raise bad("momentum", training.momentum, "must be >= 0", "e.g. 0.9")


def uniform_config(num_replicas: int, num_stages: int, num_microbatches: int, forward: float = 1.0,
                   backward_input: float = 1.0, backward_weight: float = 1.0, optimizer: float = 0.0,
                   name: str = "uniform") -> Config:
    """A slot-unit config with equal stages and free communication, for sweeps and tests."""
    raw = {
        "topology": {"num_replicas": num_replicas, "num_stages": num_stages},
        "workload": {"num_microbatches": num_microbatches},
        "costs": {"forward": forward, "backward_input": backward_input, "backward_weight": backward_weight,
                  "optimizer": optimizer},
    }
    return parse_config(raw, name=name)


