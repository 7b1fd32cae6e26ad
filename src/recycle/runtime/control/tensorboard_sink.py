"""`--tensorboard DIR`: the launcher's steps, recoveries and chaos events as TensorBoard scalars and text."""

from __future__ import annotations

from recycle.errors import ConfigError
from recycle.runtime.control.reporter import ChaosEvent, EvalMetrics, Recovery, StepMetrics

__all__ = ["TensorBoardSink", "EXTRA", "summary_writer"]

EXTRA = "tensorboard"  # the optional dependency: pip install 'recycle[tensorboard]'


def summary_writer(log_dir: str) -> type:
    """torch's SummaryWriter class, or a ConfigError naming the optional extra when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # lazy: the extra is optional, and slow to import
    except ImportError:
        raise ConfigError(f"--tensorboard {log_dir!r} needs the optional `{EXTRA}` package, which is not "
                          f"installed; run `pip install 'recycle[{EXTRA}]'` (or `pip install {EXTRA}`), or drop "
                          "--tensorboard") from None
    return SummaryWriter


class TensorBoardSink:
    """An event sink (runtime.reporter.EventSink) that writes each step, recovery and chaos event the launcher
    reports as event files into `log_dir` through torch.utils.tensorboard. Scalars are indexed by the 1-based step."""

    def __init__(self, log_dir: str, flush_secs: int = 5) -> None:
        self.writer = summary_writer(log_dir)(log_dir=log_dir, flush_secs=flush_secs)
        self.recoveries = 0
        self.last_step = 0

    def on_chaos(self, event: ChaosEvent) -> None:
        self.writer.add_text("events/chaos", f"{event.kind} {' '.join(event.workers)}", event.step)

    def on_step(self, m: StepMetrics) -> None:
        w, step = self.writer, m.step
        self.last_step = step
        w.add_scalar("train/loss", m.loss, step)
        w.add_scalar("train/tokens_per_s", m.tokens_per_s, step)
        w.add_scalar("train/tokens_per_s_per_gpu", m.tokens_per_s_per_gpu, step)
        w.add_scalar("train/period_s", m.period_s, step)
        w.add_scalar("train/step_time_s", m.step_time_s, step)
        if m.grad_norm is not None:
            w.add_scalar("train/grad_norm", m.grad_norm, step)
        if m.lr is not None:
            w.add_scalar("train/lr", m.lr, step)
        for stage, lr in enumerate(m.lr_by_stage):  # only when the stages' rates differed
            w.add_scalar(f"train/lr_stage{stage}", lr, step)
        # The workers live when the step was reported (whose records made it): a worker that died right after the
        # step may already be missing.
        w.add_scalar("workers/live", len(m.worker_time_s), step)
        w.add_scalar("workers/generation", m.generation, step)

    def on_eval(self, evaluation: EvalMetrics) -> None:
        if evaluation.loss is None:
            self.writer.add_text("events/eval", evaluation.line(), evaluation.step)
        else:
            self.writer.add_scalar("eval/loss", evaluation.loss, evaluation.step)

    def on_recovery(self, r: Recovery) -> None:
        w, step = self.writer, r.step
        if r.causes:
            self.recoveries += 1
        w.add_scalar("recovery/count", self.recoveries, step)
        w.add_scalar("recovery/resumed_s", r.resumed_s, step)
        if r.detected_s is not None:
            w.add_scalar("recovery/detected_s", r.detected_s, step)
        w.add_scalar("recovery/redone_actions", r.redone_actions, step)
        w.add_scalar("recovery/workers_down", len(r.failed), step)
        w.add_scalar("recovery/workers_joined", len(r.joined), step)
        if r.restored_step is not None:
            w.add_scalar("recovery/steps_lost", r.steps_lost, step)
        w.add_text("events/recovery", r.line(), step)
        w.flush()  # a recovery is the moment someone looks at the board

    def close(self) -> None:
        self.writer.close()
