"""Step metrics out of the launcher: the grad norm from the workers' records, TensorBoard event files, CLI logging."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from recycle.cli import main
from recycle.errors import ConfigError
from recycle.log_setup import configure_logging
from recycle.progress import progress_lines
from recycle.runtime.control.reporter import (ChaosEvent, EvalMetrics, Recovery, StepMetrics, grad_norm, learning_rate,
                                              step_line)
from recycle.runtime.control.tensorboard_sink import TensorBoardSink
from recycle.runtime.protocol.records import StepRecord

TOY = str(Path(__file__).resolve().parents[2] / "configs" / "toy.toml")


def _record(replica: int, stage: int, grad_sq: float | None, norm: float | None = None,
            lr: float | None = None) -> StepRecord:
    return StepRecord(replica, stage, 0, 0.0, 1.0, 0.5, None, None, norm, grad_sq, lr=lr)


def test_the_learning_rate_is_one_number_unless_the_stages_differ() -> None:
    agree = [_record(p, s, 1.0, lr=3e-4) for p in (0, 1) for s in (0, 1)]
    assert learning_rate(agree, 2) == (3e-4, ())
    differ = [_record(0, 0, 1.0, lr=3e-4), _record(0, 1, 1.0, lr=1e-4), _record(1, 1, 1.0, lr=1e-4)]
    assert learning_rate(differ, 2) == (3e-4, (3e-4, 1e-4))
    assert learning_rate([_record(0, 0, 1.0)], 1) == (None, ())  # an optimizer without parameter groups


def test_the_step_line_shows_the_learning_rate() -> None:
    m = StepMetrics(step=3, loss=5.25151, tokens_per_s=6180.4, period_s=0.0829, step_time_s=0.08, elapsed_s=1.0,
                    lr=1e-3, tokens_per_s_per_gpu=1545.1)
    assert step_line(m, 20) == "step 3/20 loss 5.2515 lr 1.00e-03 tokens/s 6,180 (1,545/GPU) period 82.9 ms"
    differ = StepMetrics(step=3, loss=5.0, tokens_per_s=1.0, period_s=1.0, step_time_s=1.0, elapsed_s=1.0, lr=1e-3,
                         lr_by_stage=(1e-3, 5e-4))
    assert " lr 1.00e-03/5.00e-04 (per stage: they differ) " in step_line(differ, 20)
    assert " lr " not in step_line(StepMetrics(step=1, loss=1.0, tokens_per_s=1.0, period_s=1.0, step_time_s=1.0,
                                               elapsed_s=1.0), 2)


def test_grad_norm_sums_one_replica_per_stage() -> None:
    records = [_record(0, 0, 9.0), _record(1, 0, 9.0), _record(0, 1, 16.0), _record(1, 1, 16.0)]
    assert grad_norm(records, 2) == pytest.approx(5.0, rel=1e-15)
    assert grad_norm(records[:2], 2) is None  # stage 1 missing: no partial norm
    # With clipping the workers already computed the global norm; it is taken as is.
    assert grad_norm([_record(0, 0, None, 7.5), _record(0, 1, None, 7.5)], 2) == 7.5


def _recovery() -> Recovery:
    return Recovery(generation=1, step=3, workers=("1:1",), causes=("worker 1:1 died",), failed=((1, 1),),
                    failure_time=0.0, detected_s=0.02, plan_source="store", plan_lookup_s=0.001, formed_s=0.05,
                    resumed_s=0.15, redone_actions=12, redone_s=0.3, rolled_back=0)


def test_tensorboard_event_file_holds_the_scalars(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    sink = TensorBoardSink(str(tmp_path))
    workers = {"0:0": 1.0, "0:1": 1.0, "1:0": 1.0, "1:1": 1.0}
    for step in (1, 2):
        sink.on_step(StepMetrics(step=step, loss=5.0 - step, tokens_per_s=100.0 * step, period_s=0.5,
                                 step_time_s=0.4, elapsed_s=step, grad_norm=2.0 * step, worker_time_s=workers,
                                 lr=0.5 / step, tokens_per_s_per_gpu=25.0 * step))
    sink.on_recovery(_recovery())
    sink.on_step(StepMetrics(step=3, loss=1.5, tokens_per_s=90.0, period_s=0.6, step_time_s=0.5, elapsed_s=3.0,
                             grad_norm=None, worker_time_s={k: v for k, v in workers.items() if k != "1:1"}))
    sink.on_chaos(ChaosEvent(time=0.0, kind="kill", step=3, workers=("1:1",)))
    sink.on_eval(EvalMetrics(step=2, loss=3.25, microbatches=8, tokens=128, seconds=0.1, generation=0))
    sink.on_eval(EvalMetrics(step=3, loss=None, microbatches=0, tokens=0, seconds=0.0, generation=1, skipped="cut"))
    sink.close()
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    scalars = {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    assert scalars["train/loss"] == [(1, 4.0), (2, 3.0), (3, 1.5)]
    assert scalars["train/tokens_per_s"] == [(1, 100.0), (2, 200.0), (3, 90.0)]
    assert [s for s, _ in scalars["train/period_s"]] == [1, 2, 3]
    assert scalars["train/grad_norm"] == [(1, 2.0), (2, 4.0)]  # step 3 had none
    assert scalars["train/lr"] == [(1, 0.5), (2, 0.25)]  # so had lr
    assert scalars["train/tokens_per_s_per_gpu"] == [(1, 25.0), (2, 50.0), (3, 0.0)]
    assert scalars["eval/loss"] == [(2, 3.25)]  # the skipped one is text (events/eval), not a number
    assert scalars["workers/live"] == [(1, 4.0), (2, 4.0), (3, 3.0)]
    assert scalars["recovery/count"] == [(3, 1.0)]
    assert scalars["recovery/workers_down"] == [(3, 1.0)]
    assert scalars["recovery/resumed_s"][0][1] == pytest.approx(0.15)


def test_the_eval_line_says_what_was_measured_or_why_not() -> None:
    done = EvalMetrics(step=4, loss=4.30412, microbatches=8, tokens=1024, seconds=0.0213, generation=0)
    assert done.line() == "eval after step 4: loss 4.3041 (8 micro-batches, 1,024 tokens, 0.02 s)"
    again = EvalMetrics(step=2, loss=4.8695, microbatches=8, tokens=128, seconds=0.02, generation=1, redone=True)
    assert again.line().endswith("0.02 s; run again in generation 1 after a failure)")
    skipped = EvalMetrics(step=4, loss=None, microbatches=0, tokens=0, seconds=0.0, generation=1, skipped="why")
    assert skipped.line() == "eval after step 4: skipped (why)"
    assert done.record() == {"event": "eval", "step": 4, "loss": 4.30412, "microbatches": 8, "tokens": 1024,
                             "seconds": 0.0213, "generation": 0, "redone": False, "skipped": "", "end_time": 0.0}


def test_a_missing_tensorboard_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match=r"recycle\[tensorboard\]"):
        TensorBoardSink(str(tmp_path))


def test_cli_routes_info_to_stdout_and_warnings_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    log = logging.getLogger("recycle.runtime.control.launcher")
    try:
        assert configure_logging() == logging.INFO
        log.info("step 1/2 loss 4.0")
        log.warning("the checkpoint is old")
        out, err = capsys.readouterr()
        assert out == "step 1/2 loss 4.0\n" and err == "warning: the checkpoint is old\n"
        assert configure_logging(quiet=1) == logging.WARNING
        log.info("hidden")
        assert capsys.readouterr().out == ""
        assert configure_logging(verbose=1) == logging.DEBUG
        log.debug("detail")
        assert capsys.readouterr().out == "recycle.runtime.control.launcher: detail\n"
        assert configure_logging(verbose=1, level="error") == logging.ERROR  # --log-level wins
        ours = [h for h in logging.getLogger("recycle").handlers if type(h).__name__ == "_StdStream"]
        assert len(ours) == 2  # configured again, not stacked (pytest may add its own capture handlers)
    finally:
        configure_logging()


def test_quiet_flag_before_or_after_the_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    try:
        for argv in (["-q", "plan"], ["plan", "-q"]):
            out = tmp_path / f"store{len(argv[0])}"
            assert main([*argv, "--config", TOY, "--max-failures", "1", "--out", str(out)]) == 0
            captured = capsys.readouterr()
            assert "key=" not in captured.err and "wrote plan store" in captured.out  # progress off, result kept
        assert main(["plan", "--config", TOY, "--max-failures", "1", "--out", str(tmp_path / "s")]) == 0
        assert "[5/5] key=" in capsys.readouterr().err  # not a terminal: the plain lines, as before
    finally:
        configure_logging()


def test_progress_is_a_bar_on_a_terminal_and_plain_lines_otherwise(capsys: pytest.CaptureFixture[str]) -> None:
    import io

    configure_logging()
    plain = io.StringIO()
    with progress_lines("work", stream=plain) as report:  # a StringIO is not a terminal
        report("[1/2] first")
        report("[2/2] second")
    assert plain.getvalue() == "[1/2] first\n[2/2] second\n"
    bar = io.StringIO()
    with progress_lines("work", stream=bar, bar=True) as report:
        report("[1/2] first")
        print("a table line")  # goes above the bar, to stdout
        report("[2/2] second")
    assert "work" in bar.getvalue() and "2/2" in bar.getvalue() and "second" in bar.getvalue()
    assert "a table line" in capsys.readouterr().out
