"""A run survives real interruptions: one trainer per run directory, resume only as a continuation,
configs and data verified, checkpoints that prove themselves, nothing lost or overwritten."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import quick_config, quick_run, run_numbers, train_until
from transformers import AutoModelForCausalLM

from grpolab.commands.cli import main
from grpolab.config import load_run_config
from grpolab.run.checkpoints import MANIFEST, newest_verified, problem, prune, save_checkpoint
from grpolab.run.rundir import rewind_metrics
from grpolab.run.state import STATE_FILE
from grpolab.run.trainer import train

OVERRIDES = {"steps": 4, "checkpoint.every": 1, "eval.every": 2}


def tree(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (lock file aside) with its SHA-256: what 'nothing moved' compares."""
    return {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".grpolab.lock"
    }


def weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(checkpoint).state_dict()


@pytest.fixture(scope="module")
def uninterrupted(warm_model_dir, tmp_path_factory):
    return quick_run(tmp_path_factory, warm_model_dir, "full", **OVERRIDES)


@pytest.fixture(scope="module")
def interrupted(warm_model_dir, tmp_path_factory):
    """The same run, killed before step 4: checkpoints of steps 1, 2 and 3."""
    run = tmp_path_factory.mktemp("cut") / "run"
    train_until(quick_config(warm_model_dir, run, **OVERRIDES), stop_at=4)
    return run


@pytest.fixture
def copy_of(interrupted, tmp_path):
    """A fresh copy of the interrupted run (its config still names the original directory)."""

    def make() -> Path:
        target = tmp_path / "run"
        shutil.copytree(interrupted, target)
        return target

    return make


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]


def test_a_second_trainer_on_a_locked_run_is_refused_naming_the_holder(copy_of, capsys):
    run = copy_of()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from grpolab.run.lock import RunLock; "
            f"RunLock({str(run)!r}).acquire(); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        before = tree(run)
        assert main(["train", "--resume", str(run)]) == 2
        assert error_lines(capsys) == [
            f"error: run directory {run} is in use by process {holder.pid} (a trainer holds "
            "its lock); wait for it to end or stop it, then retry"
        ]
        assert tree(run) == before
    finally:
        holder.kill()
        holder.wait()


def test_a_finished_run_is_refused_and_keeps_its_summary(uninterrupted, capsys):
    before = tree(uninterrupted)
    assert main(["train", "--resume", str(uninterrupted)]) == 2
    assert error_lines(capsys) == [
        f"error: run {uninterrupted} is already complete at step 4; nothing to resume (extend it with --steps N, N > 4)"
    ]
    assert main(["train", "--resume", str(uninterrupted), "--steps", "3"]) == 2
    assert error_lines(capsys) == ["error: --steps 3: the run is set to 4 steps, and --steps may only grow"]
    assert tree(uninterrupted) == before


def test_grown_steps_are_recorded_and_wall_time_counts_every_session(copy_of, capsys):
    run = copy_of()
    assert main(["train", "--resume", str(run), "--steps", "5"]) == 0
    config, manifest = (json.loads((run / name).read_text()) for name in ("config.json", "manifest.json"))
    summary = json.loads((run / "summary.json").read_text())
    assert config["steps"] == manifest["config"]["steps"] == summary["steps"] == 5
    assert manifest["resumes"][-1]["changed"] == {"steps": {"from": 4, "to": 5}}
    sessions = manifest["sessions"]
    assert [(s["from_step"], s["to_step"]) for s in sessions] == [(0, 3), (3, 5)]
    assert sessions[0]["seconds"] > 0 and sessions[1]["seconds"] > 0
    assert summary["wall_seconds"] == pytest.approx(sum(s["seconds"] for s in sessions))
    assert summary["sessions"] == 2 and summary["final_checkpoint"].endswith("step_000005")
    assert main(["train", "--resume", str(run)]) == 2  # a plain resume now knows the run is complete at 5
    assert "already complete at step 5" in error_lines(capsys)[0]


def test_an_edited_config_is_refused_naming_the_field(copy_of, capsys):
    run = copy_of()
    config = json.loads((run / "config.json").read_text())
    config["optim"]["lr"] = 0.05
    (run / "config.json").write_text(json.dumps(config))
    before = tree(run)
    assert main(["train", "--resume", str(run)]) == 2
    assert error_lines(capsys) == [
        f"error: {run / 'config.json'} differs from the config the run started with "
        "(manifest.json): optim.lr is 0.05, was 0.001; a resumed run keeps its config "
        "(only --steps, --log_every, --threads, --model.revision may change)"
    ]
    assert tree(run) == before


def test_threads_may_change_on_resume_and_the_run_stays_the_same(copy_of, uninterrupted, capsys):
    """A resume refused --threads although the CPU threads change no result; the change is recorded as a grown
    --steps is, and the run still ends exactly where the uninterrupted one did."""
    run = copy_of()
    assert main(["train", "--resume", str(run), "--threads", "1"]) == 0
    config, manifest = (json.loads((run / name).read_text()) for name in ("config.json", "manifest.json"))
    assert config["threads"] == manifest["config"]["threads"] == 1
    assert manifest["resumes"][-1]["changed"] == {"threads": {"from": None, "to": 1}}
    assert run_numbers(run) == run_numbers(uninterrupted)
    assert main(["train", "--resume", str(run), "--optim.lr", "0.5"]) == 2  # a result-changing field: still refused
    assert error_lines(capsys) == [
        "error: a resumed run keeps its config; only steps, log_every, threads, model.revision may change (got --optim.lr)"
    ]


@pytest.mark.parametrize("damage", ["config is a list", "manifest missing", "manifest torn"])
def test_a_bad_run_directory_is_one_line_and_nothing_moves(damage, copy_of, capsys):
    run = copy_of()
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "rew')  # what a resume would move aside
    (run / "eval" / "step_000004.jsonl").write_text("stale\n")
    if damage == "config is a list":
        (run / "config.json").write_text("[]")
    elif damage == "manifest missing":
        (run / "manifest.json").unlink()
    else:
        (run / "manifest.json").write_text((run / "manifest.json").read_text()[:100])
    before = tree(run)
    assert main(["train", "--resume", str(run)]) == 2
    assert len(error_lines(capsys)) == 1
    assert tree(run) == before and not (run / "metrics.discarded.jsonl").exists()


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip_a_bit(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0x10  # inside a weight tensor: loads fine, computes wrong
    path.write_bytes(bytes(data))


def bad_entry(path: Path) -> None:
    """checkpoint.json still parses, but an entry is not a size and a SHA-256 (a TypeError in resume before)."""
    listing = json.loads(path.read_text())
    listing["files"]["model.safetensors"] = 3
    path.write_text(json.dumps(listing))


DAMAGES = {
    "truncated weights": ("model.safetensors", truncate),
    "bit-flipped weights": ("model.safetensors", flip_a_bit),
    "empty state": ("trainer_state.pt", lambda p: p.write_bytes(b"")),
    "truncated state": ("trainer_state.pt", truncate),
    "no checkpoint manifest": (MANIFEST, Path.unlink),
    "a bad manifest entry": (MANIFEST, bad_entry),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_each_damage_of_the_newest_checkpoint_is_found_and_the_previous_one_chosen(damage, copy_of):
    """What a resume continues from, for every kind of damage (the resume itself: the next test)."""
    run = copy_of()
    name, hurt = DAMAGES[damage]
    hurt(run / "checkpoints" / "step_000003" / name)
    found = newest_verified(run, (STATE_FILE,))
    assert found.checkpoint == run / "checkpoints" / "step_000002"
    assert [folder.name for folder, _ in found.damaged] == ["step_000003"]
    assert problem(run / "checkpoints" / "step_000003", (STATE_FILE,)) == found.damaged[0][1]


# each resume trains two steps: one kind in the default tier (a bit flip, which loads fine and computes
# wrong), the others slow (their detection: the test above)
@pytest.mark.parametrize(
    "damage", [pytest.param(d, marks=[] if d == "bit-flipped weights" else pytest.mark.slow) for d in DAMAGES]
)
def test_a_damaged_newest_checkpoint_is_named_and_the_previous_one_continues_exactly(
    damage, copy_of, uninterrupted, capsys
):
    run = copy_of()
    name, hurt = DAMAGES[damage]
    hurt(run / "checkpoints" / "step_000003" / name)
    assert main(["train", "--resume", str(run)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "is damaged" in line]
    assert len(lines) == 1 and "checkpoint step_000003 is damaged" in lines[0]
    assert "continuing from step_000002" in lines[0]
    assert run_numbers(run) == run_numbers(uninterrupted)
    for (key, a), (_, b) in zip(
        weights(run / "checkpoints" / "step_000004").items(),
        weights(uninterrupted / "checkpoints" / "step_000004").items(),
    ):
        assert torch.equal(a, b), key
    assert (run / "checkpoints" / "damaged" / "step_000003").is_dir()  # kept, never deleted
    assert problem(run / "checkpoints" / "step_000003") is None  # redone
    resume = json.loads((run / "manifest.json").read_text())["resumes"][-1]
    assert resume["step"] == 2 and resume["damaged_checkpoints"][0]["checkpoint"].endswith("step_000003")


def test_no_verified_checkpoint_at_all_is_refused_with_each_problem(copy_of, capsys):
    run = copy_of()
    for step in (1, 2, 3):
        (run / "checkpoints" / f"step_{step:06d}" / "trainer_state.pt").write_bytes(b"")
    before = tree(run)
    assert main(["train", "--resume", str(run)]) == 2
    (line,) = error_lines(capsys)
    assert "no complete checkpoint" in line and line.count("has 0 bytes") == 3
    assert tree(run) == before


def test_a_checkpoint_fsyncs_every_file_its_folder_and_the_parent(warm_model_dir, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(warm_model_dir),
        AutoTokenizer.from_pretrained(warm_model_dir),
    )
    synced: list[str] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    folder = save_checkpoint(model, tokenizer, tmp_path, 7, lambda tmp: (tmp / "trainer_state.pt").write_bytes(b"x"))
    files = {p.name for p in folder.iterdir()}
    assert MANIFEST in files and "trainer_state.pt" in files and "model.safetensors" in files
    temp = Path(synced[0]).parent
    assert temp.name.startswith(".step_000007-")
    assert {Path(s).name for s in synced if Path(s).parent == temp} == files  # every file, the manifest last
    assert Path(synced[-3]).name == MANIFEST and synced[-2] == str(temp) and synced[-1] == str(tmp_path / "checkpoints")
    assert problem(folder, ("trainer_state.pt",)) is None


def test_keep_last_removes_the_oldest_only_after_a_newer_one_verifies(warm_model_dir, tmp_path):
    run = tmp_path / "run"
    train(quick_config(warm_model_dir, run, **OVERRIDES, **{"checkpoint.keep_last": 2}))
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003", "step_000004"]
    (run / "checkpoints" / "step_000004" / "trainer_state.pt").write_bytes(b"")  # the newest is damaged
    assert prune(run, 1, ("trainer_state.pt",)) == []
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003", "step_000004"]


def test_a_step_discarded_twice_keeps_both_records(tmp_path):
    (tmp_path / "eval").mkdir()
    for session, text in ((2, "first\n"), (3, "second\n")):
        (tmp_path / "eval" / "step_000004.jsonl").write_text(text)
        (tmp_path / "metrics.jsonl").write_text('{"step": 2}\n{"step": 4}\n')
        assert rewind_metrics(tmp_path / "metrics.jsonl", 2, session=session) == [{"step": 2}]
    assert (tmp_path / "eval" / "discarded" / "session_002" / "step_000004.jsonl").read_text() == "first\n"
    assert (tmp_path / "eval" / "discarded" / "session_003" / "step_000004.jsonl").read_text() == "second\n"
    assert (tmp_path / "metrics.discarded.jsonl").read_text() == '{"step": 4}\n{"step": 4}\n'


def test_changed_data_is_refused_naming_the_hash(warm_model_dir, tmp_path, capsys):
    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(json.dumps({"question": f"{a} + {b}", "answer": str(a + b)}) + "\n" for a in range(6) for b in range(6))
    )
    run = tmp_path / "run"
    cfg = quick_config(warm_model_dir, run, **OVERRIDES).model_dump(mode="json")
    cfg["task"] = {"name": "dataset", "train": str(rows), "validation_size": 8, "rewards": [{"function": "numeric"}]}
    from grpolab.config import validate_config

    train_until(validate_config(cfg), stop_at=2)
    rows.write_text(rows.read_text().replace('"answer": "10"', '"answer": "11"'))
    before = tree(run)
    assert main(["train", "--resume", str(run)]) == 2
    (line,) = error_lines(capsys)
    assert "the task's data or environment changed since the run started" in line and "_sha256 is" in line
    assert tree(run) == before
    assert load_run_config(run).steps == 4
