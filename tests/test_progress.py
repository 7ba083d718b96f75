"""Never silent: progress lines of long phases, per-step vital signs in log files, the demo's plan,
thread choice, and a Python version that the metadata, the README and the code agree on."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch
from conftest import TASK, quick_config
from rich.console import Console

from grpolab.commands.cli import main
from grpolab.commands.demo import print_demo_plan
from grpolab.commands.probe import run_probe
from grpolab.common.progress import Reporter, format_seconds
from grpolab.common.provenance import native_bf16
from grpolab.common.threads import busy_cores, choose_threads
from grpolab.config import load_config
from grpolab.models.loading import load_policy
from grpolab.models.tinymodel import WarmStartSettings, warm_start_model
from grpolab.rollout.base import SamplingParams
from grpolab.rollout.evaluation import evaluate
from grpolab.rollout.hf.engine import HFEngine
from grpolab.run.stop import RunStopped, StopRequest
from grpolab.run.trainer import train
from grpolab.tasks import ArithmeticTask

ROOT = Path(__file__).resolve().parents[1]
STAMP = r"^\d\d:\d\d:\d\d "


def plain_console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=80), out


def test_plain_phase_prints_every_n_units_heartbeats_and_an_end_line():
    console, out = plain_console()
    reporter = Reporter(console, interval=0.2)
    with reporter.phase("work", total=4, unit="steps", every=2) as phase:
        for i in range(4):
            phase.advance(info=f"loss {1 / (i + 1):.2f}")
        time.sleep(0.5)  # nothing reported: heartbeats keep the log alive
    lines = out.getvalue().splitlines()
    assert all(re.match(STAMP, line) for line in lines), lines
    assert any("work: 2/4 steps, loss 0.50" in line for line in lines)
    assert any("work: 4/4 steps, loss 0.25" in line for line in lines)
    assert any("still running" in line for line in lines)
    assert "work: done in" in lines[-1] and "(loss 0.25)" in lines[-1]
    reporter.line("x" * 200)
    assert out.getvalue().splitlines()[-1].endswith("x" * 200)  # never wrapped at the console width


def test_a_phase_that_fails_ends_without_a_done_line():
    """Its error is the last word (an export refused inside its phase printed 'done in 3 s' before)."""
    console, out = plain_console()
    with pytest.raises(ValueError), Reporter(console, interval=30).phase("export x"):
        raise ValueError("refused")
    assert "done in" not in out.getvalue()


def test_an_instant_phase_prints_only_its_end_line_and_a_slow_one_announces_itself():
    console, out = plain_console()
    reporter = Reporter(console, interval=30)
    with reporter.phase("load model"):
        pass
    assert len(out.getvalue().splitlines()) == 1 and "load model: done in 0 s" in out.getvalue()
    with reporter.phase("start engine", done_note=False):
        time.sleep(2.5)
    assert "start engine: running" in out.getvalue().splitlines()[-1]


def test_terminal_phases_nest_and_keep_their_end_lines():
    out = io.StringIO()
    reporter = Reporter(Console(file=out, force_terminal=True, width=120), interval=30)
    with reporter.phase("train", total=2, unit="steps", done_note=False) as bar:
        bar.advance(info="reward 0.5")
        with reporter.phase("eval step 1", total=3, unit="items") as inner:
            inner.advance(3)
        reporter.line("step 2/2  reward 0.6")
        bar.advance()
    text = out.getvalue()
    assert "eval step 1: done in" in text and "step 2/2  reward 0.6" in text
    assert reporter._live is None  # the display stops with the last phase


def test_format_seconds():
    assert [format_seconds(s) for s in (0.4, 59, 61, 3725)] == ["0 s", "59 s", "1m01s", "1h02m"]


def test_warm_start_prints_steps_loss_and_time_left(tmp_path):
    console, out = plain_console()
    task = ArithmeticTask(n_train=64, n_val=8)
    settings = WarmStartSettings(
        steps=10, batch_size=8, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, vocab_size=300
    )
    warm_start_model(task, settings, cache_dir=tmp_path, reporter=Reporter(console))
    text = out.getvalue()
    assert "warm start: 10 supervised steps on 64 worked solutions, cached afterwards in" in text
    for step in (1, 2, 10):
        assert re.search(rf"warm start: {step}/10 steps, loss \d+\.\d{{3}}, \d+ s elapsed", text), text
    assert re.search(r"warm start: 1/10 steps, .*~\d+ s left", text)
    assert "warm start: done in" in text


def test_a_run_logged_to_a_file_has_a_line_of_vital_signs_per_step(warm_model_dir, tmp_path):
    console, out = plain_console()
    train(quick_config(warm_model_dir, tmp_path / "run", steps=3, reference="frozen", **{"eval.every": 3}), console)
    text = out.getvalue()
    steps = [line for line in text.splitlines() if re.match(STAMP + r"step \d/3 ", line)]
    assert len(steps) == 3, text
    for field in (
        r"reward \d",
        r"acc \d",
        r"adv_std \d",
        r"kl -?\d",
        r"clip \d",
        r"ratio \d",
        r"len \d",
        r"trunc \d",
        r"gnorm [\d-]",
        r"[\d.]+ s/step",
        r"~\d+ s left",
    ):
        assert all(re.search(rf"  {field}", line) for line in steps), (field, steps)
    assert re.search(r"eval step 0: done in .*accuracy \d\.\d{3}", text)
    assert "cpu threads:" in text and "load model" in text
    assert re.search(r"checkpoint step 3: done in .*step_000003", text)
    assert "final checkpoint" in text and "summary.json" in text


def test_log_every_thins_the_lines_and_kl_shows_only_with_a_reference(warm_model_dir, tmp_path):
    console, out = plain_console()
    train(quick_config(warm_model_dir, tmp_path / "run", steps=3, log_every=2, **{"eval.every": 3}), console)
    steps = [line for line in out.getvalue().splitlines() if re.match(STAMP + r"step \d/3 ", line)]
    assert [line.split()[2] for line in steps] == ["2/3", "3/3"]  # every 2nd and the last
    assert not any(" kl " in line for line in steps)


def test_greedy_evaluation_in_chunks_reports_items_and_gives_the_same_results(warm_model_dir):
    model, tokenizer = load_policy(warm_model_dir)
    task = ArithmeticTask(n_train=64, n_val=40)
    examples = task.validation_examples()
    prompts = [tokenizer(task.prompt(e), add_special_tokens=False)["input_ids"] for e in examples]
    engine = HFEngine(model, tokenizer, max_batch_size=16)
    sampling = SamplingParams(max_new_tokens=40, temperature=1.0)
    done: list[int] = []
    chunked = evaluate(engine, task, examples, prompts, sampling, [], 8, seed=0, chunk=16, on_items=done.append)
    whole = evaluate(engine, task, examples, prompts, sampling, [], 8, seed=0)
    assert done == [16, 16, 8] and chunked == whole


def test_demo_plan_says_what_runs_and_how_long(monkeypatch, tmp_path):
    monkeypatch.setenv("GRPOLAB_CACHE", str(tmp_path))
    console, out = plain_console()
    print_demo_plan(load_config(None, {"threads": 1}), Reporter(console))
    text = out.getvalue()
    assert "grpolab demo: grpo on arithmetic with a 1.2M-parameter llama model, 1 cpu thread(s)" in text
    assert re.search(r"1\. warm start: 200 supervised steps on worked solutions, ~\d+", text)
    assert re.search(r"2\. RL: 100 steps of 32 prompts x 8 samples \(<= 48 new tokens\), ~\S+-\S+", text)
    assert re.search(r"3\. evaluation: greedy accuracy on 500 problems, 6 times", text)
    assert "runs/<time>-grpo" in text


def test_the_demo_refuses_a_used_output_dir_in_one_line_before_its_plan(tmp_path, capsys):
    from grpolab.commands.cli import main

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("keep")
    assert main(["demo", "--output-dir", str(tmp_path / "run")]) == 2
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: output directory already exists"), lines
    assert (tmp_path / "run" / "notes.txt").read_text() == "keep"


def test_threads_stay_within_the_free_cores(monkeypatch):
    monkeypatch.setattr("grpolab.common.threads.usable_cores", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert choose_threads(None, busy=0.2).threads == 4
    assert choose_threads(None, busy=2.6).threads == 1
    assert choose_threads(None, busy=9.0).threads == 1
    over = choose_threads(3, busy=2.0)
    assert over.threads == 3 and over.note.startswith("warning: --threads 3 but only 2 of 4 cores are free")
    assert not choose_threads(2, busy=2.0).note.startswith("warning")
    assert 0.0 <= busy_cores(0.1) <= os.cpu_count()


def test_python_version_agrees_in_metadata_readme_and_code():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    assert declared == ">=3.11"  # config.py reads TOML with the standard library's tomllib (3.11+)
    assert "Python 3.11+" in (ROOT / "README.md").read_text()
    assert sys.version_info >= (3, 11)
    # the oldest declared version is the interpreter CI runs: the loader works there
    assert load_config(None, {"optim.lr": 3e-4}).optim.lr == 3e-4


@pytest.mark.slow
def test_demo_output_piped_to_a_file_tells_the_story(tmp_path):
    """The README's demo with its output going to a file (2 steps, the cached warm start)."""
    out = subprocess.run(
        [sys.executable, "-m", "grpolab.commands.cli", "demo", "--steps", "2", "--output-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "Estimated on this machine" in out and "step 2/2" in out and "final checkpoint" in out


def test_a_terminal_bar_shows_time_left_beside_elapsed():
    """The docs promise time left on a terminal as in piped logs: the bar's row says "~N s left" beside the
    elapsed time once a unit is done (Phase.left), and nothing about time left before."""
    out = io.StringIO()
    reporter = Reporter(Console(file=out, force_terminal=True, width=160), interval=30)
    with reporter.phase("train", total=4, unit="steps", done_note=False) as bar:
        reporter._live.refresh()
        before = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
        bar.started -= 10.0  # as if the first step took 10 s: 3 steps left at that rate
        bar.advance()
        reporter._live.refresh()
        after = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.getvalue())
    assert "0/4 steps 0:00:00" in before and "left" not in before
    assert re.search(r"1/4 steps \d:\d\d:\d\d ~3\d s left", after), after[-300:]


def test_a_piped_probe_names_its_phases_beats_and_a_killed_one_leaves_a_partial_report(warm_model_dir, tmp_path):
    """``grpolab probe | tee log``: each phase by name, an estimate once the first micro-batch is timed, heartbeats
    (the interval shortened by GRPOLAB_HEARTBEAT_SECONDS), and the report written after each phase: killed
    mid-update it parses, says ``complete: false`` and which phases finished; a second probe refuses it."""
    report = tmp_path / "probe.json"
    args = ["probe", "--report", str(report), "--model", str(warm_model_dir), "--threads", "1"]
    args += [f"--task.{k}={v}" for k, v in TASK.items()]
    args += ["--optim.micro_batch_size=1", "--rollout.prompts_per_step=8", "--rollout.max_new_tokens=48"]
    env = {**os.environ, "GRPOLAB_HEARTBEAT_SECONDS": "0.05", "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-m", "grpolab", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines = []
    try:
        for line in child.stdout:
            lines.append(line.rstrip("\n"))
            if re.match(STAMP + r"probe: update 1: \d+/64 micro-batches, still running", line):
                break
    finally:
        child.kill()
        child.wait()
    text = "\n".join(lines)
    assert re.search(STAMP + r"probe: load: done in \d+ s \(\d[\d,]* parameters\)", text, re.M), text
    assert re.search(
        STAMP
        + r"probe: the first micro-batch took \d+\.\d\d s; 64 per update x 2 updates: about (\d+ s|\d+m\d\ds|\d+h\d\dm) for the updates",
        text,
        re.M,
    ), text
    assert re.search(r"probe: update 1: \d+/64 micro-batches, still running, \d+ s elapsed, ~\d+ s left", text), text
    partial = json.loads(report.read_text())
    assert partial["complete"] is False and partial["phases_done"] == ["load"]
    assert partial["batch"]["sequences"] == 64 and partial["config"]["optim"]["micro_batch_size"] == 1
    assert "updates" not in partial
    assert main(args) == 2  # not overwritten: one line that says whose report it may be
    assert json.loads(report.read_text()) == partial


def test_a_finished_probe_report_is_complete_with_every_phase(warm_model_dir, tmp_path):
    console, out = plain_console()
    cfg = quick_config(warm_model_dir, tmp_path / "unused", **{"rollout.max_new_tokens": 8})
    report = run_probe(cfg, tmp_path / "probe.json", Reporter(console, interval=30))
    assert json.loads((tmp_path / "probe.json").read_text()) == json.loads(json.dumps(report))
    assert report["complete"] and report["phases_done"] == ["load", "update_1", "generation", "update_2"]
    assert set(report["phase_seconds"]) == set(report["phases_done"]) and len(report["updates"]) == 2
    assert report["cpu"]["native_bf16"] is native_bf16()  # whether bf16 compute pays here
    text = out.getvalue()
    for phase in ("probe: load", "probe: update 1", "probe: generation of 32 completions", "probe: update 2"):
        assert re.search(STAMP + re.escape(phase) + r".*: done in", text, re.M), (phase, text)


def test_the_start_line_says_what_the_checkpoints_take_close_to_what_is_written(warm_model_dir, tmp_path):
    """checkpoint.every 1 over 3 steps, keep_last 1: 3 checkpoints, at most 2 on disk at once (the newest and the
    one it replaces, until the newest verifies); one checkpoint's size as stated is within 20% of the folder the run
    wrote (weights in float32 and AdamW's two moments: about three times the weights)."""
    console, out = plain_console()
    cfg = quick_config(warm_model_dir, tmp_path / "run", steps=3, **{"checkpoint.every": 1, "checkpoint.keep_last": 1})
    train(cfg, console)
    text = out.getvalue()
    found = re.search(
        STAMP + r"checkpoints: 3 x ~([\d.]+) (kB|MB) \(weights ([\d.]+) (kB|MB), optimizer and trainer state "
        r"[\d.]+ (kB|MB)\), at most 2 on disk at once \(keep_last 1\): [\d.]+ (kB|MB); [\d.]+ [kMGT]B free on the "
        r"run directory's disk$",
        text,
        re.M,
    )
    assert found, text
    scale = {"kB": 1e3, "MB": 1e6}
    stated = float(found[1]) * scale[found[2]]
    (folder,) = (tmp_path / "run" / "checkpoints").glob("step_*")
    written = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    assert 0.8 < stated / written < 1.2, (stated, written)
    assert 2.5 < stated / (float(found[3]) * scale[found[4]]) < 3.5  # weights + 2 moments (+ a little state)
    assert "warning: the checkpoints need" not in text


def test_a_run_whose_checkpoints_cannot_fit_the_disk_is_warned_at_its_start(warm_model_dir, tmp_path):
    """A billion steps with a checkpoint each and none removed need petabytes: the real free space of the run
    directory's disk (measured by the trainer) cannot hold them. Stopped after its first step."""
    console, out = plain_console()
    cfg = quick_config(warm_model_dir, tmp_path / "run", steps=10**9, **{"checkpoint.every": 1})
    with pytest.raises(RunStopped):
        train(cfg, console, stop=StopRequest(requested=True))
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if "checkpoints: 1000000000 x" in line)
    assert "all kept: " in lines[start] and " PB" not in lines[start]  # terabytes is the largest unit
    assert re.match(
        STAMP + rf"warning: the checkpoints need ~[\d.]+ TB but {re.escape(str(tmp_path / 'run'))}'s disk has "
        r"[\d.]+ [kMGT]?B free: set checkpoint.keep_last, raise checkpoint.every, or free space",
        lines[start + 1],
    ), lines[start + 1]
    assert not any(line.startswith(STAMP) and "eval step 0" in line for line in lines[: start + 1])  # said first
