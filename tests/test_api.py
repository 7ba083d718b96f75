"""The Python API as users call it: ``grpolab.train`` with reward functions from a script's ``__main__`` and a
lambda, rows as a list of dicts or a ``datasets.Dataset``, a loaded transformers model; ``grpolab.resume``;
the same run through the CLI; what is refused before anything is written."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from conftest import quick_settings

import grpolab
from grpolab.commands.cli import main

ROOT = Path(__file__).resolve().parents[1]

_rng = random.Random(0)
ROWS = [{"question": f"{a}+{b}", "answer": str(a + b)} for a in range(1, 10) for b in range(1, 10)]
_rng.shuffle(ROWS)
TRAIN, VAL = ROWS[:60], ROWS[60:76]
SETTINGS = {  # conftest's quick run (its batch shape, steps, evaluation and checkpoints) on rows of the same sums
    **{
        k: v
        for k, v in quick_settings("", "").items()
        if k.split(".")[0] in ("steps", "rollout", "optim", "eval", "checkpoint")
    },
    "threads": 1,
    "task": {"prompt": {"format": "r1_zero"}},
}

SCRIPT = """
import sys
import grpolab

def closeness(completion: str, answer: str, extracted=None, **info) -> float:
    if not extracted:
        return 0.0
    return 1.0 if extracted.strip() == answer else 0.5

rows = {rows!r}
result = grpolab.train(
    model={model!r},
    dataset=rows[:60],
    eval_dataset=rows[60:76],
    rewards=[closeness, lambda completion, answer: -len(completion) / 100],
    output_dir={out!r},
    **{settings!r},
)
print("RUN_DIR", result.run_dir, result.final["val/accuracy"])
"""


def untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"} for r in records]


def test_a_scripts_own_functions_are_the_rewards_and_a_cli_resume_keeps_them(warm_model_dir, tmp_path):
    """A function of the script's ``__main__`` and a lambda (pickled by value into the config) are the run's
    rewards: every evaluated item's reward is the function's value on it (not a 0 for a failed import); then
    ``grpolab train --resume`` from the CLI extends the run with the same functions."""
    out = tmp_path / "run"
    script = tmp_path / "notebook.py"
    script.write_text(SCRIPT.format(rows=ROWS, model=str(warm_model_dir), out=str(out), settings=SETTINGS))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"RUN_DIR {out}" in done.stdout
    config = json.loads((out / "config.json").read_text())
    functions = [r["function"] for r in config["task"]["rewards"]]
    assert functions[0].startswith("pickle:__main__.closeness:") and functions[1].startswith(
        "pickle:__main__.<lambda>:"
    )
    assert [r["name"] for r in config["task"]["rewards"]] == ["closeness", "reward1"]
    records = [json.loads(line) for line in (out / "eval" / "step_000002.jsonl").read_text().splitlines()]
    assert len(records) == 16
    for r in records:
        expected = 0.0 if not r["extracted"] else (1.0 if r["extracted"].strip() == r["gold"] else 0.5)
        assert r["rewards"]["closeness"] == expected, r
        assert r["rewards"]["reward1"] == pytest.approx(-len(r["completion"]) / 100), r
    steps = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "reward_mean" in r]
    assert all(r["reward/closeness_failed"] == 0 and r["reward/reward1_failed"] == 0 for r in steps)
    assert any(r["reward/closeness"] > 0 for r in steps) and all(r["reward/reward1"] < 0 for r in steps)

    # the CLI resumes a run started from Python: the pickled functions travel in config.json
    resumed = subprocess.run(
        [sys.executable, "-m", "grpolab", "train", "--resume", str(out), "--steps", "3"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    step3 = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("step") == 3]
    assert step3 and step3[0]["reward/closeness_failed"] == 0 and step3[0]["reward/reward1"] < 0


def test_what_cannot_run_is_refused_in_one_line_before_anything_is_written(warm_model_dir, tmp_path):
    out = tmp_path / "run"
    lock = threading.Lock()
    cases = [
        (["__main__:closeness"], "__main__"),  # the string form: a worker process has another __main__
        ([lambda completion, answer: float(lock.locked())], "cannot be sent to the worker processes"),
        ([42], r"rewards\[0\]: a function, a verifier name or a table"),
    ]
    for rewards, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            grpolab.train(model=warm_model_dir, dataset=TRAIN, rewards=rewards, output_dir=str(out), **SETTINGS)
        assert len(str(err.value).strip().splitlines()) == 1, str(err.value)
        assert not out.exists()
    # rows a run cannot use: refused when the task loads, and what the call wrote is gone again
    with pytest.raises(ValueError, match="answer") as err:
        grpolab.train(model=warm_model_dir, dataset=[{"question": "1+1"}] * 20, output_dir=str(out), **SETTINGS)
    assert not out.exists()
    with pytest.raises(grpolab.ConfigError, match="did you mean optim.lr"):
        grpolab.train(model=warm_model_dir, dataset=TRAIN, output_dir=str(out), **{"optim.lrr": 1e-3})
    assert not out.exists()
    (out / "inputs").mkdir(parents=True)  # a used directory is never written into
    with pytest.raises(FileExistsError, match="inputs of an earlier start"):
        grpolab.train(model=warm_model_dir, dataset=TRAIN, output_dir=str(out), **SETTINGS)
    assert [p.name for p in out.iterdir()] == ["inputs"] and not any((out / "inputs").iterdir())


def test_a_loaded_model_and_a_datasets_dataset_train_as_the_same_run_from_the_cli(warm_model_dir, tmp_path):
    """A transformers model and tokenizer already in memory, rows as a ``datasets.Dataset``: saved once into
    RUN_DIR/inputs/ as the run's base and data; the run is the one the CLI makes from the folder and a JSONL
    file of the same rows (identical metrics)."""
    datasets = pytest.importorskip("datasets")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(warm_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(warm_model_dir)
    result = grpolab.train(
        model=model,
        tokenizer=tokenizer,
        dataset=datasets.Dataset.from_list(TRAIN),
        eval_dataset=VAL,
        rewards=["numeric"],
        output_dir=str(tmp_path / "python"),
        **SETTINGS,
    )
    inputs = result.run_dir / "inputs"
    assert (inputs / "model" / "config.json").is_file() and (inputs / "model" / "tokenizer.json").is_file()
    assert [json.loads(line) for line in (inputs / "train.jsonl").read_text().splitlines()] == TRAIN
    manifest = json.loads((result.run_dir / "manifest.json").read_text())
    assert str(inputs / "model") in json.dumps(manifest["model"])
    assert set(result.evaluations) == {0, 2} and result.final == result.evaluations[2]
    assert len(result.records()) == 16 and result.summary["steps"] == 2
    (run,) = result.report()["runs"]  # report.json's numbers, as grpolab report writes them
    assert run["final_accuracy"] == result.final["val/accuracy"] and run["steps_done"] == 2
    assert (result.run_dir / "report" / "report.md").is_file()

    data = tmp_path / "data"
    data.mkdir()
    for name, rows in (("train", TRAIN), ("val", VAL)):
        (data / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cli_run = tmp_path / "cli"
    args = ["train", "--model", str(warm_model_dir), "--task", "dataset", "--output-dir", str(cli_run)]
    args += ["--task.train", str(data / "train.jsonl"), "--task.validation", str(data / "val.jsonl")]
    args += ["--task.rewards", '[{"function": "numeric"}]', "--task.prompt.format", "r1_zero"]
    args += [f"--{k}={v}" for k, v in SETTINGS.items() if k != "task"]
    assert main(args) == 0
    python_metrics = untimed(result.metrics)
    cli_metrics = untimed([json.loads(line) for line in (cli_run / "metrics.jsonl").read_text().splitlines()])
    assert python_metrics == cli_metrics


def test_resume_from_python_continues_exactly(warm_model_dir, tmp_path):
    """Two steps, then ``grpolab.resume(run_dir, steps=4)``: the numbers of a run of four steps uninterrupted."""
    common = {**SETTINGS, "dataset": TRAIN, "eval_dataset": VAL, "rewards": ["numeric"], "model": warm_model_dir}
    whole = grpolab.train(output_dir=str(tmp_path / "whole"), **{**common, "steps": 4})
    first = grpolab.train(output_dir=str(tmp_path / "parts"), **common)
    assert first.summary["steps"] == 2
    rest = grpolab.resume(first.run_dir, steps=4)
    assert rest.summary["sessions"] == 2 and rest.summary["steps"] == 4
    assert untimed(rest.metrics) == untimed(whole.metrics)
    with pytest.raises(grpolab.ConfigError, match="keeps its config"):
        grpolab.resume(first.run_dir, **{"optim.lr": 1.0})


def test_import_grpolab_is_light_and_exports_typed_names():
    """``import grpolab`` loads neither torch nor transformers; its public names carry docstrings and hints."""
    code = "import sys, grpolab; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"
    for name in ("train", "resume", "Result", "RunConfig", "load_config", "ConfigError"):
        assert getattr(grpolab, name).__doc__, name
    assert grpolab.train.__annotations__["return"] == "Result"


def test_a_chat_prompt_run_resumes(warm_model_dir, tmp_path):
    """A chat-template prompt's fingerprint holds the tokenizer's template: a resume compares it once the
    tokenizer is loaded (it refused every such resume as 'the task's data changed' before)."""
    import shutil

    from transformers import AutoTokenizer

    model_dir = tmp_path / "chat_model"
    shutil.copytree(warm_model_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
    tokenizer.save_pretrained(model_dir)
    chat = {**SETTINGS, "task": {"prompt": {"format": "chat", "answer": "answer_tags"}}}
    first = grpolab.train(
        model=model_dir, dataset=TRAIN, eval_dataset=VAL, output_dir=str(tmp_path / "run"), rewards=["numeric"], **chat
    )
    assert grpolab.resume(first.run_dir, steps=3).summary["sessions"] == 2
