"""Writes that appear whole or not at all, and the edges of the disk: a full disk (a file-size limit in a
child process: the same EFBIG a write past the limit gets, root or not), over-long names, a killed writer's
temporaries, concurrent writers. Each ends in one line naming the path and a non-zero exit, leaves no
temporary behind, and a retry gets exactly what an undisturbed write gets."""

from __future__ import annotations

import json
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
from conftest import TASK
from test_report_safety import write_run
from test_suite import suite_file

from grpolab.common.atomic import atomic_file, atomic_folder, temp_path, write_file
from grpolab.models.cached_folder import cached_folder
from grpolab.run.rundir import read_metrics, rewind_metrics

ROOT = Path(__file__).resolve().parents[1]


def limited(max_bytes: int):
    """preexec_fn: no file of the child may grow past ``max_bytes`` (writes get EFBIG, as on a full disk)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer instead of failing it
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))

    return apply


def grpolab(*args: str, max_bytes: int | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """``grpolab ARGS`` as a process of its own (exit code, output): a fork of this one, whose imports are done,
    so that it starts at once; with ``max_bytes`` no file it writes may grow past that (its output goes to a
    pipe, which the limit does not reach)."""
    from grpolab.commands.cli import main

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 1
        try:
            os.close(read)
            os.dup2(write, 1)
            os.dup2(write, 2)
            sys.stdout = sys.stderr = open(1, "w", buffering=1, closefd=False)
            os.chdir(ROOT)
            if max_bytes:
                limited(max_bytes)()
            code = main(list(args))
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            os._exit(code)
    os.close(write)
    chunks, deadline = [], time.monotonic() + timeout
    with os.fdopen(read, "rb") as pipe:
        while select.select([pipe], [], [], max(0.0, deadline - time.monotonic()))[0]:
            chunk = pipe.read1(65536)
            if not chunk:
                break
            chunks.append(chunk)
        else:
            os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return subprocess.CompletedProcess(args, os.waitstatus_to_exitcode(status), b"".join(chunks).decode(), "")


def python(code: str, max_bytes: int | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        preexec_fn=limited(max_bytes) if max_bytes else None,
    )


def one_error_line(result: subprocess.CompletedProcess, *words: str) -> str:
    """The run's one error line (exit 2, no traceback), holding each of ``words``."""
    out = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in out, out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and all(w in errors[0] for w in words), out[-3000:]
    return errors[0]


def temporaries(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*") if p.name.endswith(".tmp") or p.name.startswith(".metrics.jsonl-")]


def dead_pid() -> int:
    return int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
        ).stdout
    )


def as_dead(path: Path) -> Path:
    """``path`` (a temporary name of this process) as a writer that is gone would have named it."""
    return path.with_name(path.name.replace(f"-{os.getpid()}-", f"-{dead_pid()}-"))


def test_a_file_write_is_whole_or_absent_and_names_its_path(tmp_path):
    target = write_file(tmp_path / "a.json", "old")
    with pytest.raises(OSError) as err, atomic_file(target) as f:
        f.write("new, half")
        raise OSError(28, "No space left on device")
    assert err.value.filename == str(target) and target.read_text() == "old"
    assert os.listdir(tmp_path) == ["a.json"]
    code = f"from grpolab.common.atomic import write_file; write_file({str(target)!r}, 'x' * 100_000)"
    result = python(code, max_bytes=10_000)
    assert "File too large" in result.stderr and str(target) in result.stderr
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["a.json"]


def test_a_folder_replaces_only_when_asked_and_a_name_too_long_is_one_error(tmp_path):
    with atomic_folder(tmp_path / "out") as tmp:
        (tmp / "w").write_text("1")
    with pytest.raises(OSError) as err, atomic_folder(tmp_path / "out") as tmp:  # not replaced unasked
        (tmp / "w").write_text("2")
    assert err.value.filename == str(tmp_path / "out") and (tmp_path / "out" / "w").read_text() == "1"
    with atomic_folder(tmp_path / "out", replace=lambda target: None) as tmp:
        (tmp / "w").write_text("3")
    assert (tmp_path / "out" / "w").read_text() == "3" and sorted(os.listdir(tmp_path)) == ["out"]
    with pytest.raises(OSError, match="too long"), atomic_folder(tmp_path / ("x" * 300)) as tmp:
        (tmp / "w").write_text("4")
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_only_the_temporaries_of_a_writer_that_is_gone_are_removed(tmp_path):
    target = tmp_path / "abc123"
    live, dead, other = temp_path(target), as_dead(temp_path(target)), temp_path(tmp_path / "abc1234")
    foreign, other_dead = tmp_path / ".abc123-x7", as_dead(other)  # not a writer's name; another target's
    for path in (live, dead, other, foreign, other_dead):
        path.mkdir()
        (path / "part").write_text("x")

    def write(folder: Path) -> None:
        assert live.is_dir() and not dead.exists()  # the live writer's is kept while we write
        (folder / "done").write_text("yes")

    assert cached_folder(target, "done", write) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["abc123", live.name, other.name, foreign.name, other_dead.name]
    )  # another target's are its own


def test_a_rewind_that_runs_out_of_space_changes_nothing_and_a_retry_is_exact(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [json.dumps({"step": s, "reward_mean": 0.1 * s, "pad": "p" * 300}) for s in range(1, 6)]
    (run / "metrics.jsonl").write_text("".join(line + "\n" for line in lines))
    (run / "metrics.discarded.jsonl").write_text(json.dumps({"step": 9, "earlier": True}) + "\n")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    code = f"from grpolab.run.rundir import rewind_metrics; rewind_metrics(__import__('pathlib').Path({str(run / 'metrics.jsonl')!r}), 3, 2)"
    for _ in range(2):  # the disk stays full: each try fails the same way
        result = python(code, max_bytes=800)  # the discarded records fit, the rewritten metrics do not
        assert "File too large" in result.stderr and str(run / "metrics.jsonl") in result.stderr, result.stderr
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # no temp, nothing appended
    kept = rewind_metrics(run / "metrics.jsonl", 3, 2)
    assert [r["step"] for r in kept] == [1, 2, 3] == [r["step"] for r in read_metrics(run / "metrics.jsonl")]
    assert [r["step"] for r in read_metrics(run / "metrics.discarded.jsonl")] == [9, 4, 5]


@pytest.fixture
def two_step_run(warm_model_dir, tmp_path) -> tuple[Path, list[str]]:
    args = [
        f"--model.path={warm_model_dir}",
        "--steps=2",
        "--threads=1",
        "--checkpoint.every=1",
        "--eval.every=2",
        "--rollout.prompts_per_step=4",
        "--rollout.max_new_tokens=40",
        "--optim.micro_batch_size=16",
        *[f"--task.{k}={v}" for k, v in TASK.items()],
    ]
    return tmp_path / "run", args


def test_a_new_run_on_a_full_disk_and_a_name_too_long_end_in_one_line(two_step_run, tmp_path):
    run, args = two_step_run
    result = grpolab("train", *args, f"--output_dir={run}", max_bytes=200_000)  # the checkpoint does not fit
    one_error_line(result, str(run / "checkpoints" / "step_000001"), "File too large")
    assert not temporaries(run) and not list((run / "checkpoints").iterdir())
    run = tmp_path / "run2"  # the weights fit, the optimizer state (torch.save words it "unexpected pos") does not
    result = grpolab("train", *args, f"--output_dir={run}", max_bytes=600_000)
    one_error_line(result, str(run / "checkpoints" / "step_000001" / "trainer_state.pt"), "File too large")
    assert not temporaries(run) and not list((run / "checkpoints").iterdir())
    long = tmp_path / ("x" * 300)
    one_error_line(grpolab("train", *args, f"--output_dir={long}"), str(long), "File name too long")


def test_a_resume_on_a_full_disk_ends_in_one_line_and_a_retry_is_exact(two_step_run):
    run, args = two_step_run
    assert grpolab("train", *args, f"--output_dir={run}").returncode == 0
    reference = read_metrics(run / "metrics.jsonl")
    discarded = [r for r in reference if r["step"] == 2]
    shutil.rmtree(run / "checkpoints" / "step_000002")  # as if killed before its last checkpoint
    for _ in range(2):
        one_error_line(grpolab("train", "--resume", str(run), max_bytes=200_000), "File too large")
        assert not temporaries(run)
    assert grpolab("train", "--resume", str(run)).returncode == 0
    got = read_metrics(run / "metrics.discarded.jsonl")  # the first session's step 2, then each failed try's redo
    assert len(got) == 3 * len(discarded) and all(r["step"] == 2 for r in got) and got[: len(discarded)] == discarded
    assert len({json.dumps(r, sort_keys=True) for r in got}) == len(got)  # none appended twice
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [r["step"] for r in reference]


def test_concurrent_reports_on_one_folder_all_succeed(tmp_path):
    for name, seed in (("a", 0), ("b", 1)):
        write_run(tmp_path / name, seed, steps=4, every=2, items=10)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "grpolab.commands.cli", "report", str(tmp_path), "--resamples", "10000"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, "\n".join(o[-1500:] for o in outs)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "report"]
    assert json.loads((tmp_path / "report" / "report.json").read_text())["runs"]


def test_a_report_on_a_full_disk_ends_in_one_line(tmp_path):
    for name, seed in (("a", 0), ("b", 1)):
        write_run(tmp_path / name, seed, steps=4, every=2, items=10)
    one_error_line(grpolab("report", str(tmp_path), max_bytes=2_000), str(tmp_path / "report"), "File too large")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_a_failed_suite_preparation_leaves_a_root_a_retry_accepts(warm_model_dir, tmp_path):
    from rich.console import Console

    from grpolab.studies.suite.prepare import prepare_suite

    suite, root = suite_file(tmp_path, warm_model_dir), tmp_path / "out"
    long = tmp_path / "long.toml"
    long.write_text(suite.read_text().replace('"a"', '"' + "a" * 252 + '"'))
    one_error_line(grpolab("suite", "run", str(long), "--output-root", str(root)), "at most 200 characters")
    assert not root.exists()
    one_error_line(
        grpolab("suite", "run", str(suite), "--output-root", str(root), max_bytes=20_000),
        str(root / "snapshot"),
        "File too large",
    )
    assert list(root.iterdir()) == []
    (root / ".preparing").write_text("")  # a preparation killed midway: its marker and part of a snapshot
    (root / "snapshot").mkdir()
    one_error_line(grpolab("suite", "resume", str(root)), "preparation was stopped", "suite run")
    assert prepare_suite(suite, root, Console()) is not None
    assert sorted(p.name for p in root.iterdir()) == ["configs", "snapshot", "suite_manifest.json"]
