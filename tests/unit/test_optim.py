"""The stage optimizer: the fast AdamW against torch's bit for bit, choice by name, the warm-up/cosine schedule, and
no torch._dynamo import in a worker."""

from __future__ import annotations

import pytest
import torch

from recycle.errors import ConfigError
from recycle.runtime.state.optim import LR_SCHEDULES, AdamW, lr_factor, make_optimizer


@pytest.mark.parametrize("dtype,weight_decay,betas", [(torch.float64, 0.1, (0.9, 0.999)),
                                                    (torch.float32, 0.0, (0.8, 0.95))])
def test_fast_adamw_is_torchs_adamw_bit_for_bit(dtype: torch.dtype, weight_decay: float, betas: tuple) -> None:
    """The fast path against torch.optim.AdamW as a user constructs it (defaults: the single-tensor CPU path), with
    the learning rate changing every step (a schedule), and either one loading the other's state."""
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 3, dtype=dtype))
    b = torch.nn.Parameter(a.detach().clone())
    unused_a, unused_b = (torch.nn.Parameter(torch.zeros(2, dtype=dtype)) for _ in range(2))  # never gets a grad
    ours = AdamW([a, unused_a], lr=0.01, betas=betas, weight_decay=weight_decay)
    theirs = torch.optim.AdamW([b, unused_b], lr=0.01, betas=betas, weight_decay=weight_decay)
    for step in range(5):
        grad = torch.randn(5, 3, dtype=dtype)
        a.grad, b.grad = grad.clone(), grad.clone()
        for opt in (ours, theirs):
            opt.param_groups[0]["lr"] = 0.01 * (step + 1) / 5
            opt.step()
        assert torch.equal(a, b), step
    mine, torchs = ours.state_dict(), theirs.state_dict()
    assert mine["param_groups"] == torchs["param_groups"] and mine["state"].keys() == torchs["state"].keys() == {0}
    for key, value in torchs["state"][0].items():
        assert torch.equal(mine["state"][0][key], value) and mine["state"][0][key].dtype == value.dtype, key
    swapped_ours, swapped_theirs = AdamW([a, unused_a]), torch.optim.AdamW([b, unused_b])
    swapped_ours.load_state_dict(torchs)
    swapped_theirs.load_state_dict(mine)
    a.grad = b.grad = torch.ones(5, 3, dtype=dtype)
    swapped_ours.step()
    swapped_theirs.step()
    assert torch.equal(a, b)


def test_optimizer_is_chosen_by_name_with_its_arguments_and_the_fast_path_only_for_plain_adamw(tiny_config) -> None:
    model = torch.nn.Linear(3, 2)
    config = tiny_config()
    assert make_optimizer(model, config.training).fast  # the default: AdamW without amsgrad
    sgd = make_optimizer(model, tiny_config(optimizer="SGD", momentum=0.9, nesterov=True).training)
    assert isinstance(sgd.optimizer, torch.optim.SGD) and sgd.optimizer.param_groups[0]["nesterov"] and not sgd.fast
    amsgrad = make_optimizer(model, tiny_config(amsgrad=True).training)
    assert type(amsgrad.optimizer) is torch.optim.AdamW and not amsgrad.fast
    adam = make_optimizer(model, tiny_config(optimizer="Adam", betas=[0.8, 0.9]).training)
    assert type(adam.optimizer) is torch.optim.Adam and adam.optimizer.param_groups[0]["betas"] == (0.8, 0.9)
    with pytest.raises(ConfigError, match="'Adamw' is not a torch.optim optimizer.*AdamW"):
        make_optimizer(model, tiny_config(optimizer="Adamw").training)
    with pytest.raises(ConfigError, match="momentum is set but torch.optim.AdamW takes no 'momentum'"):
        make_optimizer(model, tiny_config(momentum=0.9).training)
    with pytest.raises(ConfigError, match="LBFGS.*closure"):
        make_optimizer(model, tiny_config(optimizer="LBFGS").training)
    for bad, message in [({"lr_schedule": "step"}, "'constant', 'cosine', 'linear', 'wsd'"),
                         ({"warmup_steps": -1}, ">= 0"),
                         ({"min_lr": 1.0}, "between 0 and lr"), ({"betas": [0.9]}, "two numbers"),
                         ({"nesterov": 1}, "true or false"), ({"dtype": "float16"}, "bfloat16")]:
        with pytest.raises(ConfigError, match=message):
            tiny_config(**bad)


def test_warmup_cosine_schedule_and_its_position_after_loading_a_state(tiny_config) -> None:
    training = tiny_config(steps=10, lr_schedule="cosine", warmup_steps=2, min_lr=0.001).training
    factors = [lr_factor(k, training) for k in range(12)]
    assert factors[:3] == [0.5, 1.0, 1.0] and factors[10] == factors[11] == pytest.approx(0.1)
    assert all(x > y for x, y in zip(factors[2:10], factors[3:11]))  # strictly decreasing after the warm-up
    model = torch.nn.Linear(3, 2)
    opt = make_optimizer(model, training)
    lrs = []
    for _ in range(4):
        lrs.append(opt.lr)
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    assert lrs == [0.01 * f for f in factors[:4]]
    other = make_optimizer(torch.nn.Linear(3, 2), training)
    other.load_state_dict(opt.state_dict())
    assert other.steps == 4 and other.lr == opt.lr == 0.01 * factors[4]


def test_linear_decay_by_hand(tiny_config) -> None:
    # lr 0.01 -> min_lr 0.001 (floor 0.1) over steps 2..10 after a 2-step warm-up: step k uses 1 - 0.9 (k - 2) / 8.
    training = tiny_config(steps=10, lr_schedule="linear", warmup_steps=2, min_lr=0.001).training
    hand = {0: 0.5, 1: 1.0, 2: 1.0, 4: 0.775, 6: 0.55, 9: 0.2125, 10: 0.1, 15: 0.1}
    assert {k: lr_factor(k, training) for k in hand} == pytest.approx(hand, rel=1e-14)
    # lr_decay_steps moves the end; no warm-up means the decay starts at step 0.
    short = tiny_config(steps=10, lr_schedule="linear", lr_decay_steps=4).training
    assert [lr_factor(k, short) for k in range(6)] == [1.0, 0.75, 0.5, 0.25, 0.0, 0.0]


def test_warmup_stable_decay_by_hand(tiny_config) -> None:
    # 2 warm-up steps, stable at lr, then the last 4 of 10 steps decay linearly to min_lr = 0.
    training = tiny_config(steps=10, lr_schedule="wsd", warmup_steps=2, wsd_decay_steps=4).training
    assert [lr_factor(k, training) for k in range(12)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25,
                                                          0.0, 0.0]
    # The decay ends at lr_decay_steps (here 8, so it spans steps 4..8) and stops at min_lr (floor 0.25).
    early = tiny_config(steps=10, lr_schedule="wsd", wsd_decay_steps=4, lr_decay_steps=8, min_lr=0.0025).training
    assert [lr_factor(k, early) for k in range(3, 10)] == pytest.approx(
        [1.0, 1.0, 0.8125, 0.625, 0.4375, 0.25, 0.25], rel=1e-14)
    opt = make_optimizer(torch.nn.Linear(3, 2), training)
    opt.set_steps(8)  # a roll-back or a checkpoint puts the schedule at its position
    assert opt.lr == 0.01 * 0.5


def test_bad_schedule_values_are_refused_with_the_fix(tiny_config) -> None:
    for bad, message in [
            ({"lr_schedule": "wsd"}, r"wsd_decay_steps must be set for lr_schedule = \"wsd\".*e\.g\. 1 "),
            ({"lr_schedule": "wsd", "wsd_decay_steps": -1}, ">= 0"),
            ({"lr_schedule": "cosine", "wsd_decay_steps": 2}, "applies only to lr_schedule = \"wsd\""),
            ({"lr_schedule": "wsd", "wsd_decay_steps": 2, "warmup_steps": 1, "steps": 2},
             r"exceed the 2 steps.*wsd_decay_steps <= 1"),
            ({"lr_schedule": "linear", "min_lr": 0.5}, "between 0 and lr = 0.01"),
            ({"lr_schedule": "wsd", "wsd_decay_steps": 2_000_000_000}, "wsd_decay_steps")]:
        with pytest.raises(ConfigError, match=message):
            tiny_config(**bad)
    for schedule in LR_SCHEDULES:  # every schedule the config accepts has a factor
        decay = {"wsd_decay_steps": 1} if schedule == "wsd" else {}
        assert lr_factor(1, tiny_config(lr_schedule=schedule, **decay).training) > 0


def test_the_fast_path_keeps_torch_dynamo_out_of_a_worker() -> None:
    """Why the fast path exists: constructing any torch.optim optimizer imports torch._dynamo (measured ~2 s per
    process here); the default AdamW with its schedule, steps and state dicts must not."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from recycle.config import Training\n"
            "from recycle.runtime.state.optim import make_optimizer\n"
            "m = torch.nn.Linear(3, 2)\n"
            "o = make_optimizer(m, Training(lr_schedule='cosine', warmup_steps=1, steps=3))\n"
            "m(torch.ones(1, 3)).sum().backward(); o.step(); o.load_state_dict(o.state_dict()); o.zero_grad()\n"
            "assert o.fast\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
