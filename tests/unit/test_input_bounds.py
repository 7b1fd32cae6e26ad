"""Sizes taken from input are bounded, and the last tracebacks and silent acceptances are gone (issue 21, items 3
and 6): every case exits 2 with one `error:` line naming the value, the limit or rule and the fix, before anything
is allocated or looped over. In-process (the CLI's main), each case well under a second."""

from __future__ import annotations

from pathlib import Path

import pytest

from recycle.cli import main

ROOT = Path(__file__).resolve().parents[2]
TOY = str(ROOT / "configs" / "toy.toml")
TINY = str(ROOT / "configs" / "tiny-gpt.toml")


def fails_cleanly(capsys: pytest.CaptureFixture[str], argv: list[str], *needles: str) -> str:
    """Exit 2, exactly one line on stderr, starting with `error:` and containing every needle; no traceback."""
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2, (code, err)
    assert err.count("\n") == 1 and err.startswith("error: "), err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


# -- item 3: sizes in the config ----------------------------------------------------------------------------------
@pytest.mark.parametrize("override,needles", [
    ("model.n_layer=100000", ("[model] n_layer = 100000", "limit of 1,024")),
    ("workload.microbatch_size=1000000000", ("[workload] microbatch_size = 1000000000", "limit of 1,048,576")),
    ("workload.microbatch_size=1048576", ("microbatch_size x seq_len = 1048576 x 32", "limit of 16,777,216")),
    ("topology.num_replicas=100000", ("[topology] num_replicas = 100000", "limit of 65,536")),
    ("workload.num_microbatches=100000000", ("[workload] num_microbatches = 100000000", "limit of 65,536")),
    ("workload.num_microbatches=65536,topology.num_replicas=64", ("D x S x M = 64 x 2 x 65536", "limit of 1,048,576")),
    ("training.steps=10000000000", ("[training] steps = 10000000000", "limit of 1,000,000,000")),
    ("training.seed=99999999999999999999999", ("[training] seed", "does not fit in 64 bits")),
])
@pytest.mark.parametrize("command", [["schedule"], ["plan", "--fail", "0:0"]])
def test_config_sizes_are_bounded(capsys, override: str, needles: tuple[str, ...], command: list[str]) -> None:
    sets = [a for item in override.split(",") for a in ("--set", item)]
    fails_cleanly(capsys, [command[0], "--config", TINY, *sets, *command[1:]], *needles)


# -- item 6: config values every worker would fail on -------------------------------------------------------------
@pytest.mark.parametrize("override,needles", [
    ("model.n_head=0", ("[model] n_head = 0 must be >= 1",)),  # was a ZeroDivisionError
    ("model.n_head=-2", ("[model] n_head = -2 must be >= 1",)),
    ("model.n_embd=0", ("[model] n_embd = 0 must be >= 1",)),
    ("model.vocab_size=0", ("[model] vocab_size = 0 must be >= 1",)),
    ("model.dropout=1.5", ("[model] dropout = 1.5 must be in [0, 1]",)),
    ("model.dropout=-0.1", ("[model] dropout = -0.1 must be in [0, 1]",)),
    ("training.betas=[2, 3]", ("[training] betas = [2.0, 3.0] must both be in [0, 1)", "e.g. [0.9, 0.95]")),
    ("training.betas=[0.9, 1.0]", ("must both be in [0, 1)",)),
    ("training.eps=-1", ("[training] eps = -1.0 must be >= 0", "torch.optim refuses it")),
    ("training.weight_decay=-1", ("[training] weight_decay = -1.0 must be >= 0",)),
    ("training.momentum=-0.5", ("[training] momentum = -0.5 must be >= 0",)),
])
def test_config_values_torch_would_refuse_fail_up_front(capsys, override: str, needles: tuple[str, ...]) -> None:
    fails_cleanly(capsys, ["schedule", "--config", TINY, "--set", override], *needles)
