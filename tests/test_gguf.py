"""``gguf:`` model names without converting anything: what they resolve to and what is refused."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from grpolab.common.progress import Reporter
from grpolab.models.gguf import gguf_file, tensors_counted_into
from grpolab.models.sources import (
    FolderSource,
    GgufSource,
    HubSource,
    LikeSource,
    WarmStartSource,
    absolute_model_spec,
    check_model_spec,
    folder_record,
    is_local_folder,
    source_of,
)


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


def test_each_spec_has_one_source_and_a_local_path_wins_over_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kinds = {
        "like:qwen3-0.6b": LikeSource,
        "gguf:smollm2": GgufSource,
        None: WarmStartSource,
        "Qwen/Qwen3-0.6B": HubSource,
        "runs/demo/step_4": FolderSource,
    }
    for spec, kind in kinds.items():
        assert type(source_of(spec)) is kind, spec
    (tmp_path / "Qwen" / "Qwen3-0.6B").mkdir(parents=True)
    assert type(source_of("Qwen/Qwen3-0.6B")) is FolderSource and is_local_folder("Qwen/Qwen3-0.6B")
    assert not is_local_folder("like:qwen3-0.6b") and not is_local_folder(None) and not is_local_folder("absent")
    with pytest.raises(ValueError, match="model.revision v1 applies to a Hugging Face hub id"):
        check_model_spec("like:qwen3-0.6b", "v1")
    # a folder no source made records nothing more; a converted GGUF folder records its file
    assert folder_record(tmp_path) == {}
    (tmp_path / "gguf_source.json").write_text('{"sha256": "ab"}')
    assert folder_record(tmp_path) == {"gguf_source": {"sha256": "ab"}}


def test_a_suite_keeps_naming_the_same_model_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_model_spec("gguf:smollm2") == "gguf:smollm2"  # a packaged short name
    assert absolute_model_spec("gguf:models/a.gguf") == f"gguf:{tmp_path / 'models' / 'a.gguf'}"
    assert absolute_model_spec("like:olmo2-1b") == "like:olmo2-1b"
    assert absolute_model_spec("ckpt") == str(tmp_path / "ckpt")


def test_the_gguf_loaders_own_bar_counts_into_the_phase_and_prints_nothing(capfd):
    """transformers' GGUF loader walks the tensors under its own tqdm (tqdm.auto, out of reach of
    ``disable_progress_bar``): its bar leaked into piped logs. While converting, that loop counts into the
    conversion's phase and prints nothing; afterwards the loader is as it was (the slow
    test_a_piped_gguf_conversion_prints_no_bar converts a real file in a subprocess)."""
    import transformers.modeling_gguf_pytorch_utils as loader
    from transformers.utils import logging as hf_logging

    bar, bars_on = loader.tqdm, hf_logging.is_progress_bar_enabled()
    out = io.StringIO()
    reporter = Reporter(Console(file=out, force_terminal=False, width=100), interval=30)
    with reporter.phase("convert tiny.gguf") as phase, tensors_counted_into(phase):
        assert list(loader.tqdm(range(5), desc="Converting and de-quantizing GGUF tensors...")) == list(range(5))
        assert not hf_logging.is_progress_bar_enabled()
    assert (phase.done, phase.total, phase.unit) == (5, 5, "tensors")
    assert capfd.readouterr().err == ""
    assert loader.tqdm is bar and hf_logging.is_progress_bar_enabled() == bars_on
    assert "convert tiny.gguf: done in" in out.getvalue()
    list(loader.tqdm(range(2), desc="Converting and de-quantizing GGUF tensors..."))  # outside: the leak it closes
    assert "Converting and de-quantizing" in capfd.readouterr().err
