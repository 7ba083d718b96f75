"""Runs that used to hang or dead-end: empty data refused before the run directory exists, a run killed before
its first checkpoint (or before its config or manifest) resumed in place from step 0, and one-line refusals for
a checkpoint folder given to --resume, a seed out of range, bad device lists and markup in a suite's reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpolab.commands.cli import main


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]


def write_rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(n)))
    return path


@pytest.mark.parametrize("empty", ["train", "validation"])
def test_an_empty_data_file_is_refused_before_the_run_directory_exists(empty, tiny_model_dirs, tmp_path, capsys):
    """An empty train file used to hang forever in the prompt stream; an empty validation file failed after the
    run directory was made."""
    files = {"train": write_rows(tmp_path / "train.jsonl", 8), "validation": write_rows(tmp_path / "val.jsonl", 4)}
    files[empty].write_text("\n")
    out = tmp_path / "run"
    assert main(["train", "--model.path", str(tiny_model_dirs["qwen2"]), "--output_dir", str(out), "--threads", "1",
                 "--task.name", "dataset", "--task.train", str(files["train"]),
                 "--task.validation", str(files["validation"]), "--steps", "1"]) == 2
    assert error_lines(capsys) == [f"error: {files[empty]}: no rows; a task needs at least one {empty} example"]
    assert not out.exists()


def test_a_prompt_stream_without_examples_refuses_instead_of_looping():
    from grpolab.tasks.stream import PromptStream

    with pytest.raises(ValueError, match="no training examples"):
        PromptStream([], seed=0)
