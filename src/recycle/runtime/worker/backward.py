"""A micro-batch's backward into its inputs' .grad, on autograd's engine directly where torch.autograd.backward's
checks per input cannot change anything: what torch.autograd.backward(out, grad_out, inputs=inputs) does."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

_engine_run_backward: Callable[..., Any] | None
try:  # private to torch (there since 2.3, in the pinned 2.13): without it every backward takes torch's own path
    from torch.autograd.graph import _engine_run_backward
except ImportError:
    _engine_run_backward = None

__all__ = ["backward_into_grad"]

_PLAIN = frozenset({torch.Tensor, nn.Parameter})


def backward_into_grad(out: torch.Tensor, grad_out: torch.Tensor | None, inputs: Sequence[torch.Tensor]) -> None:
    """Accumulate d(out)/d(inputs) into the inputs' .grad and free the graph: torch.autograd.backward(out, grad_out,
    inputs=inputs). Where every tensor is a plain one and grad_out has out's shape and dtype (None: out is a scalar,
    its gradient one), torch's checks (a __torch_function__ test per input, the gradient's shape and type) cannot
    change the call it makes, so it is made directly: ~330 Python calls less per worker and step of a 4-stage small
    GPT, ~100 us per backward of 28 leaves (docs/runtime-performance.md). Anything else goes through torch's."""
    inputs = tuple(inputs)
    if _engine_run_backward is not None and type(out) is torch.Tensor and set(map(type, inputs)) <= _PLAIN \
            and inputs and not torch._C._are_functorch_transforms_active():
        if grad_out is None and out.numel() == 1:
            grad = torch.ones_like(out, memory_format=torch.preserve_format)  # what torch's _make_grads makes
        elif type(grad_out) is torch.Tensor and grad_out.shape == out.shape and grad_out.dtype == out.dtype \
                and grad_out.device == out.device:
            grad = grad_out
        else:
            torch.autograd.backward(out, grad_out, inputs=inputs)
            return
        _engine_run_backward((out,), (grad,), False, False, inputs, allow_unreachable=True, accumulate_grad=True)
        return
    torch.autograd.backward(out, grad_out, inputs=inputs)
