"""AdamW with torch's single-tensor arithmetic, without torch.optim's import of torch._dynamo (1.6 s per worker
process, which on a 2-core machine would dominate the start-up of a small job)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Protocol

import torch

__all__ = ["AdamW", "StageOptimizer", "allreduce_grads"]


def allreduce_grads(params: list[torch.nn.Parameter], allreduce: Callable[[torch.Tensor], None],
                    extra: torch.Tensor | None = None) -> None:
    """The data-parallel half of an OPT: flatten the stage's gradients (zeros for unused parameters) into one buffer,
    SUM-all-reduce it with `allreduce`, and copy the result back into every .grad. `extra` (a small 1-D tensor of
    the gradients' dtype) is summed in the same all-reduce and updated in place."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    pieces = [p.grad.reshape(-1) for p in params]
    flat = torch.cat(pieces if extra is None else [*pieces, extra.reshape(-1)])
    allreduce(flat)
    if extra is not None:
        extra.copy_(flat[flat.numel() - extra.numel():].view_as(extra))
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))
        offset += n


class StageOptimizer(Protocol):
    """What the executor and checkpoints need from an optimizer (torch.optim optimizers fit too)."""

    def step(self) -> Any: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class AdamW:
    """Decoupled weight decay Adam (Loshchilov & Hutter), the same update, op for op, as
    `torch.optim.AdamW(..., foreach=False)` (checked equal in tests/unit/test_runtime_units.py)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.lr, self.betas, self.eps, self.weight_decay = lr, betas, eps, weight_decay
        self.step_count = 0
        self.exp_avg = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in self.params]

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        self.step_count += 1
        step = float(self.step_count)
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = self.lr / bias_correction1
        bias_correction2_sqrt = bias_correction2 ** 0.5
        for p, exp_avg, exp_avg_sq in zip(self.params, self.exp_avg, self.exp_avg_sq):
            if p.grad is None:
                continue
            grad = p.grad
            p.mul_(1 - self.lr * self.weight_decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(self.eps)
            p.addcdiv_(exp_avg, denom, value=-step_size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step_count, "exp_avg": [t.clone() for t in self.exp_avg],
                "exp_avg_sq": [t.clone() for t in self.exp_avg_sq],
                "hyper": {"lr": self.lr, "betas": self.betas, "eps": self.eps, "weight_decay": self.weight_decay}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["exp_avg"]) != len(self.params):
            raise ValueError(f"optimizer state has {len(state['exp_avg'])} tensors for {len(self.params)} parameters")
        self.step_count = int(state["step"])
        for dst, src in zip(self.exp_avg + self.exp_avg_sq, state["exp_avg"] + state["exp_avg_sq"]):
            dst.copy_(src)
