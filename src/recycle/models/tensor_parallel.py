"""Tensor parallelism inside one worker: a stage's linear layers sharded with torch's own ColwiseParallel /
RowwiseParallel over a DeviceMesh of the worker's T ranks (the built-in GPT, and the Hugging Face rotary families
llama / mistral / qwen2), and the whole-model tensors gathered back from the shards.

Megatron's layout: per block, attention's c_attn is column-parallel by heads and c_proj row-parallel, the MLP's first
linear column-parallel and its second row-parallel; each row-parallel output is summed over the T ranks (one
all-reduce in the forward, one in the backward per pair), so every block's output, and the stage's, is replicated
on the T ranks. Embeddings, LayerNorms and the head stay replicated (a byte vocabulary is small). The rotary
families are laid out alike: q_proj, k_proj, v_proj and gate_proj, up_proj column-parallel, o_proj and down_proj
row-parallel (their attention reshapes by head_dim, so it runs on the rank's own heads as it is).

c_attn holds q, k and v stacked ([3C, C]); a plain column split would give rank 0 all of q and part of k. Its rows
are put in rank order [q_0 k_0 v_0 | q_1 k_1 v_1 | ...] (q_t: the heads of rank t) before the split, so each rank's
shard is its heads' q, k and v; `whole_state_dict` puts them back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from recycle.errors import ConfigError
from recycle.models.gpt import GPTShape, GPTStage

__all__ = ["check_tensor_parallel", "check_hf_tensor_parallel", "parallelize_gpt_stage", "parallelize_hf_stage",
           "parallelize_stage", "whole_state_dict", "whole_state", "local_tensor", "local_state", "sharded_like", "qkv_order",
           "is_sharded", "shard_of_whole"]

_ATTN_QKV = "attn.c_attn"


def check_tensor_parallel(shape: GPTShape, degree: int) -> None:
    """Refuse a tensor-parallel degree the built-in GPT cannot be split by (the message names value, rule, fix)."""
    if degree == 1:
        return
    if shape.n_head % degree:
        divisors = [t for t in range(1, shape.n_head + 1) if shape.n_head % t == 0]
        raise ConfigError(f"[topology] gpus_per_worker = {degree} does not divide the model's n_head = "
                          f"{shape.n_head}: tensor parallelism gives each of a worker's {degree} ranks whole "
                          f"attention heads; use gpus_per_worker in {divisors} or a model whose n_head is a multiple "
                          f"of {degree}")
    # (n_embd = n_head x head size, so the MLP width 4 x n_embd divides too.)
    if shape.dropout > 0:
        raise ConfigError(f"[model] dropout = {shape.dropout} with [topology] gpus_per_worker = {degree}: dropout inside "
                          "tensor-parallel attention would draw other masks than the unsharded model; set dropout = "
                          "0 or gpus_per_worker = 1")


def check_hf_tensor_parallel(hf_config: Any, degree: int) -> None:
    """The Hugging Face model's rule: a rotary family (llama, mistral, qwen2) whose query heads, key/value heads and
    MLP width T divides, without attention dropout."""
    if degree == 1:
        return
    from recycle.models.hf import ROTARY_FAMILIES

    rule = f"[topology] gpus_per_worker = {degree}"
    family = hf_config.model_type
    if family not in ROTARY_FAMILIES:
        raise ConfigError(f"{rule} shards the Hugging Face families {', '.join(ROTARY_FAMILIES)} (and the built-in "
                          f"GPT), not {family!r} (its fused Conv1D attention); use gpus_per_worker = 1 for it")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    for name, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                        ("intermediate_size", hf_config.intermediate_size)):
        if value % degree:
            divisors = [t for t in range(1, value + 1) if value % t == 0]
            raise ConfigError(f"{rule} does not divide the Hugging Face config's {name} = {value}: each of a "
                              f"worker's {degree} ranks holds an equal share of it; use gpus_per_worker in "
                              f"{divisors} (dividing num_attention_heads, num_key_value_heads and intermediate_size)")
    if getattr(hf_config, "attention_dropout", 0.0):
        raise ConfigError(f"{rule} with attention_dropout = {hf_config.attention_dropout}: masks inside sharded "
                          "attention would differ from the unsharded model's; set it to 0 or gpus_per_worker = 1")


def qkv_order(n_embd: int, degree: int) -> torch.Tensor:
    """The row order of c_attn under tensor parallelism: rank t's contiguous chunk is its heads' q, k, v rows."""
    width = n_embd // degree
    rows = [torch.arange(part * n_embd + t * width, part * n_embd + (t + 1) * width)
            for t in range(degree) for part in range(3)]
    return torch.cat(rows)


def _mesh_degree(mesh: Any) -> int:
    return int(mesh.size())


def _styles(stage: GPTStage) -> dict[str, Any]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan: dict[str, Any] = {}
    for index in stage.blocks:
        prefix = f"blocks.{index}"
        for name, style in ((f"{prefix}.{_ATTN_QKV}", ColwiseParallel), (f"{prefix}.attn.c_proj", RowwiseParallel),
                            (f"{prefix}.mlp.0", ColwiseParallel), (f"{prefix}.mlp.2", RowwiseParallel)):
            plan[name] = style()
    return plan


@torch.no_grad()
def parallelize_gpt_stage(stage: GPTStage, mesh: Any) -> None:
    """Shard `stage` in place over `mesh` (1-D, the worker's T ranks); its parameters become DTensors."""
    from torch.distributed.tensor.parallel import parallelize_module

    degree = _mesh_degree(mesh)
    check_tensor_parallel(stage.shape, degree)
    order = qkv_order(stage.shape.n_embd, degree)
    for block in stage.blocks.values():
        qkv = block.attn.c_attn
        qkv.weight.copy_(qkv.weight[order])
        qkv.bias.copy_(qkv.bias[order])
    # Every rank built the same whole weights from the seed: each takes its own slice (src_data_rank=None), no
    # scatter, which would also need the mesh's process group before the worker has one.
    parallelize_module(stage, mesh, _styles(stage), src_data_rank=None)


@torch.no_grad()
def parallelize_hf_stage(stage: nn.Module, mesh: Any) -> None:
    """Shard a Hugging Face rotary-family stage (models.hf) in place over `mesh`."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_hf_tensor_parallel(stage.hf_config, _mesh_degree(mesh))
    plan: dict[str, Any] = {}
    for name, module in stage.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.Linear) and leaf in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"):
            plan[name] = ColwiseParallel()
        elif isinstance(module, nn.Linear) and leaf in ("o_proj", "down_proj"):
            plan[name] = RowwiseParallel()
    parallelize_module(stage, mesh, plan, src_data_rank=None)


def parallelize_stage(stage: nn.Module, mesh: Any) -> None:
    """Shard a stage in place over `mesh`: the built-in GPT's, or a Hugging Face rotary family's."""
    if isinstance(stage, GPTStage):
        parallelize_gpt_stage(stage, mesh)
    elif getattr(stage, "hf_config", None) is not None:
        parallelize_hf_stage(stage, mesh)
    else:
        raise ConfigError(f"tensor parallelism shards the built-in GPT and Hugging Face rotary models, not a "
                          f"{type(stage).__name__}; use [topology] gpus_per_worker = 1 for it")


def is_sharded(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a DTensor sharded over the worker's ranks (a replicated one is whole on every rank)."""
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor) and any(p.is_shard() for p in tensor.placements)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of `tensor` (a DTensor's local shard, sharing its storage; any other tensor itself)."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor  # to_local() would go through autograd


def sharded_like(value: Any, param: torch.Tensor) -> Any:
    """`value` (an optimizer entry received as this rank's plain shard) as a DTensor laid out like `param`, when
    `param` is one and `value` is its shard; anything else as it is (a step counter, an unsharded stage's tensor)."""
    from torch.distributed.tensor import DTensor

    if isinstance(param, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor) \
            and value.shape == param._local_tensor.shape:
        return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
    return value


def _is_qkv(key: str) -> bool:
    """Whether `key` (a state-dict name, or an optimizer entry's, which holds its parameter's name) is c_attn's."""
    return f"{_ATTN_QKV}.weight" in key or f"{_ATTN_QKV}.bias" in key


def shard_of_whole(key: str, value: Any, like: torch.Tensor) -> Any:
    """This rank's shard of `value` when it is a whole tensor in the unsharded model's layout (what checkpoints and
    whole_state hold) and `like`, the live tensor stored under `key` or the parameter an optimizer entry `key`
    belongs to, is a sharded DTensor: the inverse of whole_state, c_attn's rows put in rank order first. Each rank
    slices its own part (as parallelize_module did from the seed's weights), so it needs no process group. Anything
    else (a shard already, a step counter, a replicated or unsharded tensor) comes back as it is."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not is_sharded(like) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor) \
            or value.shape != like.shape:
        return value
    mesh = like.device_mesh  # type: ignore[attr-defined]
    if _is_qkv(key):
        value = value[qkv_order(value.shape[0] // 3, _mesh_degree(mesh))]
    shard = distribute_tensor(value.to(like.device), mesh, like.placements,  # type: ignore[attr-defined]
                              src_data_rank=None)
    return shard._local_tensor


def local_state(state: dict[str, Any]) -> dict[str, Any]:
    """A flat stage state with each DTensor replaced by this rank's shard (what goes over the wire to the same TP
    rank of another replica)."""
    return {key: local_tensor(value) if isinstance(value, torch.Tensor) else value for key, value in state.items()}


def whole_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's state dict with every sharded tensor gathered whole, in the unsharded model's layout (c_attn's
    rows back in q, k, v order): a collective over the worker's ranks, every rank gets the same."""
    return whole_state(module.state_dict())


def whole_state(state: Any) -> dict[str, Any]:
    """A flat state (a state dict, or a StageState's: parameters and their optimizer entries, whose keys hold the
    parameter's name) with every DTensor gathered whole in the unsharded layout; a collective over the worker's
    ranks, in key order, which every rank runs alike."""
    from torch.distributed.tensor import DTensor

    whole: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            degree = _mesh_degree(value.device_mesh)
            value = value.full_tensor()
            if _is_qkv(key):
                restored = torch.empty_like(value)
                restored[qkv_order(value.shape[0] // 3, degree)] = value
                value = restored
        whole[key] = value.detach() if isinstance(value, torch.Tensor) else value
    return whole
