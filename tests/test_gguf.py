"""``gguf:`` model names without converting anything: what they resolve to and what is refused."""

from __future__ import annotations

import pytest

from grpolab.models.gguf import gguf_file
from grpolab.models.loading import absolute_model_spec, check_model_spec


def test_refusals_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        check_model_spec(f"gguf:{tmp_path / 'missing.gguf'}")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf file"):
        gguf_file(str(tmp_path / "weights.bin"))
    with pytest.raises(FileNotFoundError, match="not found"):
        check_model_spec(str(tmp_path / "no-model"))
    check_model_spec(None)
    check_model_spec("like:qwen3-0.6b")


def test_a_suite_keeps_naming_the_same_model_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_model_spec("gguf:smollm2") == "gguf:smollm2"  # a packaged short name
    assert absolute_model_spec("gguf:models/a.gguf") == f"gguf:{tmp_path / 'models' / 'a.gguf'}"
    assert absolute_model_spec("like:olmo2-1b") == "like:olmo2-1b"
    assert absolute_model_spec("ckpt") == str(tmp_path / "ckpt")
