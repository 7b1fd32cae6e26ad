"""recycle.models.hf without the heavy part: clear errors for a missing extra, a missing file, an unsupported model."""

from __future__ import annotations

import json
import sys

import pytest

from recycle.errors import ConfigError
from recycle.models.hf import load_hf_config, resolve_hf_path


def test_without_transformers_the_error_names_the_extra(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(ConfigError, match=r"optional extra 'hf': pip install 'recycle\[hf\]'"):
        load_hf_config(path, 16)


def test_an_unsupported_model_or_a_missing_file_is_named(tmp_path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(ConfigError, match=r"model_type 'bert' is not supported; supported: gpt2, llama, mistral, "
                                          r"qwen2"):
        load_hf_config(path, 16)
    with pytest.raises(ConfigError, match=r"hf_config = 'nope.json' is not a file"):
        resolve_hf_path("nope.json", str(tmp_path))


def _cli_train_errors(hf: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    from pathlib import Path

    from recycle.cli import main

    tiny = str(Path(__file__).resolve().parents[2] / "configs" / "tiny-gpt.toml")
    assert main(["train", "--config", tiny, "--hf", hf, "--max-failures", "0"]) == 2
    return capsys.readouterr().err.strip().splitlines()


def test_cli_hf_with_a_missing_file_is_one_error_line(capsys) -> None:
    err = _cli_train_errors("no-such-config.json", capsys)
    assert len(err) == 1 and "no-such-config.json" in err[0] and "is not a file" in err[0], err


def test_cli_hf_with_an_unsupported_family_is_one_error_line_naming_the_supported(tmp_path, capsys) -> None:
    path = tmp_path / "falcon.json"
    path.write_text(json.dumps({"model_type": "falcon", "vocab_size": 256}))
    err = _cli_train_errors(str(path), capsys)
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert "model_type 'falcon' is not supported; supported: gpt2, llama, mistral, qwen2" in err[0], err
