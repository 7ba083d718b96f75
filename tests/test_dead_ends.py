"""Runs that used to hang or dead-end: empty data refused before the run directory exists, a run killed before
its first checkpoint (or before its config or manifest) resumed in place from step 0, and one-line refusals for
a checkpoint folder given to --resume, a seed out of range, bad device lists and markup in a suite's reasons."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import cli_pairs, quick_run, untimed

from grpolab.commands.cli import main


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]


def write_rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(n)))
    return path


def tiny_qwen2_run(tiny_model_dirs, out: Path) -> list[str]:
    """The command-line settings of a run of the tiny Qwen2 model into ``out``, on one thread."""
    return cli_pairs({"model.path": tiny_model_dirs["qwen2"], "output_dir": out, "threads": 1})


@pytest.mark.parametrize("empty", ["train", "validation"])
def test_an_empty_data_file_is_refused_before_the_run_directory_exists(empty, tiny_model_dirs, tmp_path, capsys):
    """An empty train file used to hang forever in the prompt stream; an empty validation file failed after the
    run directory was made."""
    files = {"train": write_rows(tmp_path / "train.jsonl", 8), "validation": write_rows(tmp_path / "val.jsonl", 4)}
    files[empty].write_text("\n")
    out = tmp_path / "run"
    task = {"task.name": "dataset", "task.train": files["train"], "task.validation": files["validation"]}
    prompt = {
        "task.prompt.format": "template",
        "task.prompt.template": "{question}=",
        "task.prompt.answer": "last_number",
    }
    settings = {**task, "steps": 1, "rollout.max_new_tokens": 40, **prompt}
    assert main(["train", *tiny_qwen2_run(tiny_model_dirs, out), *cli_pairs(settings)]) == 2
    assert error_lines(capsys) == [f"error: {files[empty]}: no rows; a task needs at least one {empty} example"]
    assert not out.exists()


def test_any_task_without_training_examples_is_refused_at_task_load(tiny_model_dirs, tmp_path, capsys):
    out = tmp_path / "run"
    settings = {"task.name": "custom_task:CountdownTask", "task.n": 1, "rollout.max_new_tokens": 40}
    assert main(["train", *tiny_qwen2_run(tiny_model_dirs, out), *cli_pairs(settings)]) == 2
    assert error_lines(capsys) == ["error: task 'countdown' has no training examples"]
    assert not out.exists()


def test_a_prompt_stream_without_examples_refuses_instead_of_looping():
    from grpolab.tasks.stream import PromptStream

    with pytest.raises(ValueError, match="no training examples"):
        PromptStream([], seed=0)


# ---- a run stopped before its first checkpoint resumes from step 0 in place -------------------------------
STEPS = {"steps": 3, "checkpoint.every": 3, "eval.every": 2}


def final_weights(run: Path) -> dict:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000003").state_dict()


@pytest.fixture(scope="module")
def uninterrupted(warm_model_dir, tmp_path_factory):
    return quick_run(tmp_path_factory, warm_model_dir, "full", **STEPS)


def assert_same_run(run: Path, reference: Path) -> None:
    import torch

    from grpolab.run.lock import lock_holder
    from grpolab.run.rundir import read_metrics

    got = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in got if "reward_mean" in r] == [1, 2, 3]
    assert untimed(got) == untimed(read_metrics(reference / "metrics.jsonl"))
    mine, want = final_weights(run), final_weights(reference)
    assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in want)
    assert sorted(p.name for p in (run / "eval").glob("*.jsonl")) == [
        "step_000000.jsonl",
        "step_000002.jsonl",
        "step_000003.jsonl",
    ]
    assert not [p for p in run.rglob(".*") if p.name != ".grpolab.lock"], "a temp file or folder was left"
    assert lock_holder(run) is None


def interrupt(monkeypatch, cls, method: str, when) -> None:
    """``cls.method`` raises KeyboardInterrupt (a kill, in process) when ``when(*args)`` holds."""
    original = getattr(cls, method)

    def die(self, *args, **kwargs):
        if when(self, *args):
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, method, die)


def test_a_run_stopped_before_its_first_checkpoint_resumes_from_step_0_in_place(
    warm_model_dir, uninterrupted, tmp_path, monkeypatch, capsys
):
    """It was a dead end: --resume said 'no complete checkpoint', a new run 'not empty'."""
    from conftest import quick_config

    from grpolab.run.trainer import Trainer, train

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        interrupt(patch, Trainer, "train_step", lambda self, step, *_: step == 2)
        with pytest.raises(KeyboardInterrupt):
            train(quick_config(warm_model_dir, run, **STEPS))
    (run / "checkpoints" / ".step_000002-interrupted").mkdir(parents=True)  # a checkpoint write a kill cut short
    written = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in written] == [0, 1]  # step 0's evaluation, step 1
    assert main(["train", "--resume", str(run)]) == 0
    assert "stopped before its first checkpoint: starting it again from step 0" in capsys.readouterr().out
    assert_same_run(run, uninterrupted)
    # what the first session wrote is set aside, as a resume does with the records after its checkpoint
    assert (run / "metrics.discarded.jsonl").read_text().splitlines() == written
    assert (run / "eval" / "discarded" / "session_002" / "step_000000.jsonl").is_file()
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["resumes"][0]["from_checkpoint"] is None and manifest["resumes"][0]["step"] == 0
    assert manifest["resumes"][0]["removed_temp_folders"] == [".step_000002-interrupted"]
    assert [(s["from_step"], s["to_step"]) for s in manifest["sessions"]] == [(0, 1), (0, 3)]


def test_a_run_stopped_between_its_config_and_its_manifest_resumes_from_step_0(
    warm_model_dir, uninterrupted, tmp_path, monkeypatch
):
    from conftest import quick_config

    from grpolab.run.journal import RunJournal
    from grpolab.run.trainer import train

    run = tmp_path / "run"
    with monkeypatch.context() as patch:
        interrupt(patch, RunJournal, "save", lambda self: True)  # killed before manifest.json was first written
        with pytest.raises(KeyboardInterrupt):
            train(quick_config(warm_model_dir, run, **STEPS))
    assert sorted(p.name for p in run.iterdir()) == [".grpolab.lock", "config.json"]
    (run / ".manifest.json-interrupted").write_text("{")  # its write cut short
    assert main(["train", "--resume", str(run)]) == 0
    assert_same_run(run, uninterrupted)


def test_a_run_stopped_before_its_config_says_to_start_again_and_a_new_run_takes_the_folder(
    warm_model_dir, uninterrupted, tmp_path, capsys
):
    run = tmp_path / "run"
    run.mkdir()
    (run / ".grpolab.lock").write_text("12345\n")
    (run / ".config.json-interrupted").write_text("{")
    assert main(["train", "--resume", str(run)]) == 2
    assert error_lines(capsys) == [
        f"error: nothing to resume in {run}: no config.json (a run stopped before writing "
        "it trained nothing); start it again with its own command: a new run takes this folder"
    ]
    from conftest import quick_config

    args = quick_config(warm_model_dir, run, **STEPS).model_dump(mode="json")  # the same run, as a config file
    (tmp_path / "run.json").write_text(json.dumps(args))
    assert main(["train", "--config", str(tmp_path / "run.json")]) == 0
    assert_same_run(run, uninterrupted)


def test_a_used_folder_says_how_to_continue_its_run_and_a_checkpoint_is_not_a_run(uninterrupted, tmp_path, capsys):
    checkpoint = uninterrupted / "checkpoints" / "step_000003"
    assert main(["train", "--resume", str(checkpoint)]) == 2
    assert error_lines(capsys) == [
        f"error: --resume {checkpoint} is a checkpoint; give its run directory: grpolab "
        f"train --resume {uninterrupted} (a run continues from its newest complete checkpoint)"
    ]
    assert main(["train", "--task", "arithmetic", "--output_dir", str(uninterrupted)]) == 2
    assert error_lines(capsys) == [
        f"error: output directory {uninterrupted} holds a run (its config.json): continue "
        f"it with grpolab train --resume {uninterrupted}, or choose another --output-dir"
    ]


def test_a_sigterm_well_after_the_stop_request_ends_a_step_that_cannot_end(monkeypatch):
    """A SIGTERM only asked for a stop after the current step, and every later one was ignored: a step that
    never ended made the run deaf to kill, timeout and a suite's stop. Repeats within 5 s stay one request
    (torchrun's agent and Slurm may both pass it on)."""
    import signal
    from types import SimpleNamespace

    from grpolab.commands import interrupts
    from grpolab.commands.interrupts import Interrupts
    from grpolab.run.stop import StopRequest

    clock = SimpleNamespace(now=100.0)
    monkeypatch.setattr(interrupts, "time", SimpleNamespace(monotonic=lambda: clock.now))
    monkeypatch.setattr(Interrupts, "stop", StopRequest(armed=True))
    Interrupts.handler(signal.SIGTERM, None)
    assert Interrupts.stop.requested  # the first asks for a stop after the step
    clock.now += 1.0
    Interrupts.handler(signal.SIGTERM, None)  # the same request, passed on twice
    clock.now += 10.0
    with pytest.raises(KeyboardInterrupt):
        Interrupts.handler(signal.SIGTERM, None)


# ---- one-line refusals ------------------------------------------------------------------------------------
def test_a_seed_out_of_range_is_one_line(tmp_path, capsys):
    """A huge seed ended in 'Overflow when unpacking long long' from torch."""
    for seed in ("99999999999999999999", "-1", str(2**32)):
        assert main(["train", "--task", "arithmetic", "--seed", seed, "--output_dir", str(tmp_path / "run")]) == 2
        (line,) = error_lines(capsys)
        assert line.startswith("error: seed: Input should be"), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("devices", ["a,b", "-1", "0,-1"])
def test_devices_that_are_not_device_ids_are_refused_in_one_line(devices, tmp_path, capsys):
    suite = tmp_path / "suite.toml"
    suite.write_text('[suite]\nname = "s"\n\n[base]\nsteps = 1\n\n[[runs]]\nname = "a"\nalgo = "grpo"\n')
    assert main(["suite", "run", str(suite), "--output-root", str(tmp_path / "out"), "--devices", devices]) == 2
    (line,) = error_lines(capsys)
    assert "is not a device id" in line and not (tmp_path / "out").exists()


def test_suite_status_shows_reasons_as_written(tmp_path):
    """Reasons were rendered as rich markup: [brackets] vanished and '[/x]' crashed the table."""
    from io import StringIO

    from rich.console import Console

    from grpolab.studies.manifest import RunRecord, SuiteManifest
    from grpolab.studies.suite.status import status_table

    (tmp_path / "a.json").write_text(json.dumps({"steps": 3}))
    reason = "ValueError: x[0] [bold]not bold[/bold] and [/x] closes nothing"
    SuiteManifest(
        suite="s[1]",
        source_file="s.toml",
        runs=[
            RunRecord(
                name="a[b]",
                state="failed",
                run_dir=str(tmp_path / "a"),
                config_file=str(tmp_path / "a.json"),
                config_sha256="0",
                reason=reason,
            )
        ],
    ).save(tmp_path)
    out = StringIO()
    Console(file=out, width=400).print(status_table(tmp_path))
    assert reason in out.getvalue() and "a[b]" in out.getvalue() and "suite s[1]" in out.getvalue()
