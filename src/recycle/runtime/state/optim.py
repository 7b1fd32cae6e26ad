"""The training optimizer: any torch.optim class named in [training], its torch.optim.lr_scheduler schedule (warm-up,
then constant, cosine, linear or warmup-stable-decay), and a fast path for the default AdamW that is torch's
algorithm op for op without the start-up cost of constructing a torch.optim optimizer (its first construction
imports torch._dynamo: docs/runtime.md)."""

from __future__ import annotations

import inspect
import math
from collections import OrderedDict, defaultdict
from typing import Any, Callable, Iterable, Protocol

import torch
from torch.optim.lr_scheduler import LambdaLR

from recycle.config import LR_SCHEDULES, Training
from recycle.errors import ConfigError
from recycle.models.tensor_parallel import local_tensor

__all__ = ["AdamW", "StageOptimizer", "TrainingOptimizer", "allreduce_grads", "fill_missing_grads", "make_optimizer",
           "optimizer_class", "optimizer_kwargs", "lr_factor", "learning_rate", "OPTIMIZER_KEYS", "LR_SCHEDULES"]

# [training] keys passed to the optimizer's constructor when set (lr and weight_decay always are).
OPTIMIZER_KEYS = ("betas", "eps", "momentum", "dampening", "nesterov", "amsgrad")
# Optimizers that cannot run one plain step() per training step.
_UNSUPPORTED = {"LBFGS": "it needs a closure that re-evaluates the loss",
                "SparseAdam": "it needs sparse gradients"}


def allreduce_grads(params: list[torch.nn.Parameter], allreduce: Callable[[torch.Tensor], None],
                    extra: torch.Tensor | None = None) -> None:
    """The data-parallel half of an OPT: flatten the stage's gradients (zeros for unused parameters) into one buffer,
    SUM-all-reduce it with `allreduce`, and copy the result back into every .grad. `extra` (a small 1-D tensor of
    the gradients' dtype) is summed in the same all-reduce and updated in place. A tensor-parallel stage's DTensor
    gradients are reduced shard by shard: each rank of a worker with the same rank of the stage's other replicas."""
    grads = [local_tensor(g) for g in fill_missing_grads(params)]
    pieces = [g.reshape(-1) for g in grads]
    flat = torch.cat(pieces if extra is None else [*pieces, extra.reshape(-1)])
    allreduce(flat)
    if extra is not None:
        extra.copy_(flat[flat.numel() - extra.numel():].view_as(extra))
    offset = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[offset:offset + n].view_as(g))
        offset += n


def fill_missing_grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Every parameter's .grad, zeros for a parameter no micro-batch reached (so the optimizer steps it as it steps
    the others, whether or not an all-reduce ran)."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return [p.grad for p in params if p.grad is not None]


class StageOptimizer(Protocol):
    """What the executor, roll-back, state transfer and checkpoints need from an optimizer."""

    def step(self) -> Any: ...
    def zero_grad(self, set_to_none: bool = True) -> None: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def learning_rate(optimizer: StageOptimizer) -> float | None:
    """The learning rate the optimizer's next step() applies (its first parameter group's; a TrainingOptimizer's
    schedule sets every group alike), or None for an optimizer without parameter groups."""
    inner = getattr(optimizer, "optimizer", optimizer)  # a TrainingOptimizer wraps the torch.optim one
    groups = getattr(inner, "param_groups", None)
    return float(groups[0]["lr"]) if groups else None


def optimizer_kwargs(training: Training) -> dict[str, Any]:
    """The constructor arguments [training] gives: lr, weight_decay, and every OPTIMIZER_KEYS entry that is set."""
    kwargs: dict[str, Any] = {"lr": training.lr, "weight_decay": training.weight_decay}
    for key in OPTIMIZER_KEYS:
        value = getattr(training, key)
        if value is not None:
            kwargs[key] = tuple(value) if key == "betas" else value
    return kwargs


def optimizer_class(training: Training) -> type:
    """The torch.optim class [training] optimizer names, with its keyword arguments checked against its
    constructor; a clear ConfigError otherwise."""
    name = training.optimizer
    cls = getattr(torch.optim, name, None)
    if name.startswith("_") or not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) \
            or cls is torch.optim.Optimizer:
        known = sorted(n for n in dir(torch.optim) if isinstance(getattr(torch.optim, n), type)
                       and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
                       and n not in ("Optimizer", *_UNSUPPORTED))
        raise ConfigError(f"[training] optimizer = {name!r} is not a torch.optim optimizer; use one of "
                          f"{', '.join(known)} (case matters)")
    if name in _UNSUPPORTED:
        raise ConfigError(f"[training] optimizer = {name!r} is not supported: {_UNSUPPORTED[name]}; use e.g. AdamW, "
                          "Adam or SGD")
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "params")]
    for key in optimizer_kwargs(training):
        if key not in accepted:
            raise ConfigError(f"[training] {key} is set but torch.optim.{name} takes no {key!r} argument; remove it "
                              f"or choose an optimizer that has it ({name} takes {', '.join(accepted)})")
    return cls


def lr_factor(step: int, training: Training) -> float:
    """The multiple of [training] lr used by training step `step` (0-based): linear warm-up over warmup_steps
    (step k uses (k+1)/warmup_steps), then one of
    - "constant": 1;
    - "cosine" / "linear": from 1 at the warm-up's end down to min_lr at lr_decay_steps (default: steps), then min_lr;
    - "wsd" (warmup-stable-decay): 1 until wsd_decay_steps before lr_decay_steps, then linear down to min_lr there.
    A decay's step d of n uses floor + (1 - floor) * g(d / n), floor = min_lr / lr: g(x) = (1 + cos(pi x)) / 2 for
    the cosine, 1 - x for the linear ones."""
    warmup = training.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    schedule = training.lr_schedule
    if schedule == "constant":
        return 1.0
    end = training.lr_decay_steps or training.steps
    start = end - training.wsd_decay_steps if schedule == "wsd" else warmup
    if step < start:
        return 1.0  # wsd's stable phase
    horizon = end - start
    progress = min(1.0, (step - start) / horizon) if horizon > 0 else 1.0
    floor = training.min_lr / training.lr
    if schedule == "cosine":
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule in ("linear", "wsd"):
        return floor + (1.0 - floor) * (1.0 - progress)
    raise ConfigError(f"[training] lr_schedule = {schedule!r} must be one of {', '.join(LR_SCHEDULES)}")


def _fast_path(cls: type, kwargs: dict[str, Any]) -> bool:
    """Our AdamW stands in for torch.optim.AdamW only where it runs the same code path as torch's default on this
    device (single-tensor, not fused, no amsgrad)."""
    return cls is torch.optim.AdamW and not kwargs.get("amsgrad", False) \
        and set(kwargs) <= {"lr", "betas", "eps", "weight_decay", "amsgrad"}


def make_optimizer(module: torch.nn.Module, training: Training) -> "TrainingOptimizer":
    """The optimizer and LR schedule for `module`'s trainable parameters (the stages and the reference alike)."""
    return TrainingOptimizer([p for p in module.parameters() if p.requires_grad], training)


class TrainingOptimizer:
    """A torch.optim optimizer and its LambdaLR schedule, stepped together: one step() per training step.

    The schedule is a pure function of the number of steps taken (`steps`), which is all that its state holds here:
    a roll-back, a re-joiner's state transfer or a checkpoint restores `steps` and the learning rate follows. The
    hyper-parameters always come from the config, also after loading a state (a deliberate change of lr between
    legs of a run takes effect).
    """

    def __init__(self, params: list[torch.nn.Parameter], training: Training) -> None:
        cls = optimizer_class(training)
        self.training = training
        self.kwargs = optimizer_kwargs(training)
        self.fast = _fast_path(cls, self.kwargs)
        self.optimizer: torch.optim.Optimizer = AdamW(params, **self.kwargs) if self.fast else cls(params, **self.kwargs)
        self.scheduler = LambdaLR(self.optimizer, self._factor)

    def _factor(self, step: int) -> float:
        return lr_factor(step, self.training)

    @property
    def steps(self) -> int:
        return self.scheduler.last_epoch

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self) -> None:
        self.optimizer.step()
        self.scheduler.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.set_steps(int(state["steps"]))

    def set_steps(self, steps: int) -> None:
        """Continue as after `steps` training steps: the schedule's position and the learning rate it gives."""
        self.scheduler.last_epoch = steps
        self.scheduler._step_count = steps + 1
        lr = self.training.lr * self._factor(steps)
        for group in self.optimizer.param_groups:
            group.update({k: v for k, v in self.kwargs.items() if k != "lr"})
            group["initial_lr"] = self.training.lr
            group["lr"] = lr
        self.scheduler.base_lrs = [self.training.lr] * len(self.optimizer.param_groups)
        self.scheduler._last_lr = [lr] * len(self.optimizer.param_groups)


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's default CPU path (`_single_tensor_adam`, decoupled weight decay), op for op, with the
    same state_dict layout, so either can load the other's state (checked bit for bit in
    tests/unit/test_optim.py). It skips torch.optim.Optimizer.__init__, whose dynamo-disabling wrappers
    import torch._dynamo on first use (seconds per process; measured in docs/runtime.md, "torch.optim")."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2,
                 amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("the fast AdamW has no amsgrad; use torch.optim.AdamW")
        params = [p for p in params]
        if not params:
            raise ValueError("optimizer got an empty parameter list")
        self.defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "amsgrad": False,
                         "maximize": False, "foreach": None, "capturable": False, "differentiable": False,
                         "fused": None, "decoupled_weight_decay": True}
        self.state: defaultdict[torch.Tensor, Any] = defaultdict(dict)
        self.param_groups = [{**self.defaults, "params": params}]
        # What torch.optim.Optimizer.__init__ would set, for code that inspects it (e.g. LR schedulers).
        for hooks in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks", "_optimizer_state_dict_pre_hooks",
                      "_optimizer_state_dict_post_hooks", "_optimizer_load_state_dict_pre_hooks",
                      "_optimizer_load_state_dict_post_hooks"):
            setattr(self, hooks, OrderedDict())

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        for group in self.param_groups:
            lr, (beta1, beta2), eps, weight_decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if not state:  # lazily, as torch does: a parameter that never had a gradient has no state
                    state["step"] = torch.tensor(0.0, dtype=step_dtype)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                step_t, exp_avg, exp_avg_sq = state["step"], state["exp_avg"], state["exp_avg_sq"]
                step_t += 1
                if weight_decay != 0:
                    p.mul_(1 - lr * weight_decay)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step = step_t.item()
                bias_correction1 = 1 - beta1 ** step
                bias_correction2 = 1 - beta2 ** step
                step_size = lr / bias_correction1
                bias_correction2_sqrt = bias_correction2 ** 0.5
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """torch.optim.Optimizer.state_dict's layout: state keyed by parameter index, groups listing indices."""
        index: dict[int, int] = {}
        groups = []
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: dict(s) for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(
                len(g["params"]) != len(own["params"]) for g, own in zip(groups, self.param_groups)):
            raise ValueError("loaded optimizer state has parameter groups that do not match this optimizer's")
        by_index: dict[int, Any] = {}
        for saved, own in zip(groups, self.param_groups):
            by_index.update(zip(saved["params"], own["params"]))
            own.update({k: v for k, v in saved.items() if k != "params"})
        self.state = defaultdict(dict)
        for i, values in state_dict["state"].items():
            p = by_index[int(i)]
            self.state[p] = {k: (v if k == "step" else v.to(dtype=p.dtype, device=p.device))
                             for k, v in values.items()}
