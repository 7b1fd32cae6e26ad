"""The micro-batch backward on autograd's engine directly (runtime.worker.backward): the same .grad bit for bit as
torch.autograd.backward(out, grad_out, inputs=...), without torch's per-input checks, and torch's own where they
could matter."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from recycle.runtime.worker.backward import backward_into_grad


def _torch(out: torch.Tensor, grad_out: torch.Tensor | None, inputs: Any) -> None:
    torch.autograd.backward(out, grad_out, inputs=inputs)


def _run(backward: Callable[..., None]) -> list[torch.Tensor | None]:
    """Three micro-batches through a stage-like graph, accumulated into a leaf input and two of three parameters
    (the first is left out of `inputs`: its .grad must stay None), then a scalar loss with no gradient given."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 5, dtype=torch.float64)) for _ in range(3)]
    inp = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    for mb in range(3):
        hidden = torch.tanh(inp @ params[0]) @ params[1] @ params[2]
        backward(hidden, torch.randn(4, 5, dtype=torch.float64), [inp, *params[1:]])
    loss = (torch.tanh(inp @ params[1]) ** 2).sum()
    backward(loss, None, params[1:])
    return [inp.grad, *(p.grad for p in params)]


def test_the_same_gradients_as_torch_bit_for_bit(monkeypatch: pytest.MonkeyPatch) -> None:
    want = _run(_torch)
    monkeypatch.setattr(torch.autograd, "backward", lambda *args, **kwargs: pytest.fail("torch's backward was used"))
    got = _run(backward_into_grad)
    assert got[1] is None and want[1] is None  # not among the inputs: not accumulated into
    for mine, theirs in zip(got, want):
        assert (mine is None) == (theirs is None)
        if mine is not None:
            assert theirs is not None and torch.equal(mine, theirs)


def test_a_gradient_of_another_shape_gets_torchs_own_error() -> None:
    param = torch.nn.Parameter(torch.randn(3, 3))
    out = torch.randn(2, 3) @ param
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        backward_into_grad(out, torch.ones(3, 2), [param])
    with pytest.raises(RuntimeError, match="grad can be implicitly created only for scalar outputs"):
        backward_into_grad(out, None, [param])
