"""A suite on a real one-node Slurm cluster (slurmctld + slurmd started by the test set-up, no GPUs): each
run a batch job from a script the suite keeps, a job cancelled with scancel is a stopped run, and resume
submits it again and finishes it with the numbers of the uninterrupted suite. With fake runs
(tests/fake_trainer.py) in the default tier, with real ``grpolab train`` runs in the slow tier."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from suite_runs import assert_same_metrics, cli_process, forked_runner, suite_file, wait_for_steps, write_hook
from test_suite import ROOT

from grpolab.commands.cli import main
from grpolab.studies.manifest import SuiteManifest

# the session's one-node Slurm cluster; the uninterrupted suites (real and fake) and the fake trainer
pytest_plugins = ["slurm_cluster", "suite_fixtures"]

SLOW_A = """
import time
import grpolab.run.checkpoints as checkpoints
_save = checkpoints.save_checkpoint
def save_checkpoint(model, tokenizer, run_dir, step, *args, **kwargs):
    if str(run_dir).endswith("/a"):
        time.sleep(2)  # run a is surely still training when the test cancels its job
    return _save(model, tokenizer, run_dir, step, *args, **kwargs)
checkpoints.save_checkpoint = save_checkpoint
"""


def slurm_suite(tmp_path: Path, model_dir: Path, partition: str | None = None) -> Path:
    """The tiny suite with a [slurm] table: no GPUs, 30 minutes a job, on ``partition`` (default: Slurm's)."""
    spec = suite_file(tmp_path, model_dir)
    where = f'partition = "{partition}"\n' if partition else ""
    spec.write_text(
        spec.read_text().replace("[base]", f'[slurm]\n{where}gpus_per_device = 0\ntime = "00:30:00"\n[base]', 1)
    )
    return spec


def assert_the_cancelled_job_stopped_run_a(root: Path, job: str, out: str, slurm_cluster) -> None:
    """The suite in ``root`` after run a's Slurm job ``job`` was cancelled (the runner's output ``out``): a stopped
    and resumable, b queued, the job recorded as cancelled by the suite and by Slurm."""
    a, b = SuiteManifest.load(root).runs
    assert (a.state, b.state) == ("stopped", "queued"), (a, out)
    assert (
        a.reason.startswith(
            f"Slurm job {job} was CANCELLED: stopped by a signal (exit code 130); resumable "
            "from its newest checkpoint step_00000"
        )
        and a.job_id == job
    )
    assert f"run a: submitted as Slurm job {job}" in out and a.job_state == "CANCELLED"
    assert slurm_cluster.run("scontrol", "show", "job", job).count("JobState=CANCELLED") == 1


def resume_submits_run_a_again_and_finishes_exactly(
    root: Path, job: str, reference: Path, slurm_cluster, capsys
) -> None:
    """``suite resume`` of ``root`` (run a's job ``job`` cancelled): a submitted again and resumed, b after it,
    every number and final checkpoint ``reference``'s; each attempt's job recorded, its batch script kept."""
    assert main(["suite", "resume", str(root)]) == 0
    a, b = SuiteManifest.load(root).runs
    assert (a.state, b.state) == ("completed", "completed") and a.job_id != job
    assert [attempt["job_id"] for attempt in a.attempts] == [job] and a.command[-2] == "--resume"
    assert (a.job_state, b.job_state) == ("COMPLETED", "COMPLETED")
    assert_same_metrics(root, reference)
    assert [r.final_checkpoint_sha256 for r in (a, b)] == [
        r.final_checkpoint_sha256 for r in SuiteManifest.load(reference).runs
    ]
    # where each attempt ran, as the suite and the run itself recorded it; the scripts are kept
    sessions = json.loads((root / "runs" / "a" / "manifest.json").read_text())["sessions"]
    assert [s["where"]["slurm_job_id"] for s in sessions] == [job, a.job_id]
    assert a.host == sessions[-1]["where"]["host"] and b.world_size == 1
    scripts = sorted(p.name for p in (root / "slurm").glob("*.sbatch"))
    assert scripts == ["a.attempt-1.sbatch", "a.attempt-2.sbatch", "b.attempt-1.sbatch"]
    script = (root / "slurm" / "a.attempt-2.sbatch").read_text()
    assert f"#SBATCH --partition={slurm_cluster.partition}" in script and "#SBATCH --gpus" not in script
    assert "#SBATCH --job-name=tiny.a" in script
    assert "--resume" in script and (root / "slurm" / f"b.{b.job_id}.exit").read_text().strip() == "0"
    assert main(["suite", "status", str(root)]) == 0
    assert f"job {b.job_id} COMPLETED" in capsys.readouterr().out


def resume_follows_the_job_of_run_a_then_submits_b(root: Path, reference: Path, slurm_cluster) -> None:
    """``suite resume`` of ``root``, whose killed runner left run a's job running: it follows that job to its
    end (no second submission), then submits b; every number ``reference``'s."""
    job = SuiteManifest.load(root).runs[0].job_id
    assert "RUNNING" in slurm_cluster.run("squeue", "-h", "-j", job, "-o", "%T")
    assert main(["suite", "resume", str(root)]) == 0
    a, b = SuiteManifest.load(root).runs
    assert (a.state, b.state) == ("completed", "completed") and a.job_id == job and not a.attempts
    assert sorted(p.name for p in (root / "slurm").glob("*.sbatch")) == ["a.attempt-1.sbatch", "b.attempt-1.sbatch"]
    assert_same_metrics(root, reference)


@pytest.mark.slow  # default tier: the same with fake runs below; real runs on Slurm: the refused job
def test_a_suite_on_slurm_a_cancelled_job_is_a_stopped_run_and_resume_finishes_it_exactly(
    slurm_cluster, finished, warm_model_dir, tmp_path, monkeypatch, capsys
):
    spec = slurm_suite(tmp_path, warm_model_dir, slurm_cluster.partition)
    root = tmp_path / "out"
    env = {**slurm_cluster.env, "PYTHONPATH": os.pathsep.join([str(ROOT), str(write_hook(tmp_path, SLOW_A))])}
    command = ["suite", "run", str(spec), "--output-root", str(root), "--launcher", "slurm"]
    runner = cli_process(*command, env=env, stdout=subprocess.PIPE, text=True)
    wait_for_steps([root / "runs" / "a"], 1, lambda: runner.poll() is None, seconds=300, interval=0.1)
    job = SuiteManifest.load(root).runs[0].job_id
    slurm_cluster.run("scancel", job)
    out = runner.communicate(timeout=300)[0]
    assert runner.returncode == 130, out
    assert_the_cancelled_job_stopped_run_a(root, job, out, slurm_cluster)

    for key, value in {**slurm_cluster.env, "COLUMNS": "250"}.items():
        monkeypatch.setenv(key, value)
    resume_submits_run_a_again_and_finishes_exactly(root, job, finished, slurm_cluster, capsys)


def test_the_slurm_launcher_without_slurm_is_one_error_line(warm_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    spec = suite_file(tmp_path, warm_model_dir)
    assert main(["suite", "run", str(spec), "--output-root", str(tmp_path / "out"), "--launcher", "slurm"]) == 2
    assert capsys.readouterr().out.splitlines() == [
        "error: the slurm launcher needs Slurm's client commands (sbatch, squeue, scancel) on PATH"
    ]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # default tier: the same with fake runs below
def test_a_runner_killed_while_its_jobs_run_is_resumed_by_following_the_jobs_never_submitting_twice(
    slurm_cluster, finished, warm_model_dir, tmp_path, monkeypatch
):
    """SIGKILL to the runner (a closed SSH session on a login node): run a's job trains on; resume follows
    that job to its end instead of submitting a second one, then submits b."""
    spec = suite_file(tmp_path, warm_model_dir)
    spec.write_text(spec.read_text().replace("[base]", "[slurm]\ngpus_per_device = 0\n[base]", 1))
    root = tmp_path / "out"
    env = {**slurm_cluster.env, "PYTHONPATH": os.pathsep.join([str(ROOT), str(write_hook(tmp_path, SLOW_A))])}
    runner = cli_process("suite", "run", str(spec), "--output-root", str(root), "--launcher", "slurm", env=env)
    wait_for_steps([root / "runs" / "a"], 1, lambda: runner.poll() is None, seconds=300, interval=0.1)
    runner.kill()
    runner.wait()
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    resume_follows_the_job_of_run_a_then_submits_b(root, finished, slurm_cluster)


def test_a_job_slurm_refuses_is_a_failed_run_with_sbatchs_reason(slurm_cluster, warm_model_dir, tmp_path, monkeypatch):
    spec = suite_file(tmp_path, warm_model_dir)
    spec.write_text(spec.read_text().replace("[base]", '[slurm]\npartition = "nope"\ngpus_per_device = 0\n[base]', 1))
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    assert main(["suite", "run", str(spec), "--output-root", str(tmp_path / "out"), "--launcher", "slurm"]) == 1
    a, b = SuiteManifest.load(tmp_path / "out").runs
    assert (a.state, b.state) == ("failed", "queued") and a.job_id is None
    assert a.reason.startswith("sbatch --parsable failed: ") and "invalid partition" in a.reason.lower(), a.reason


# ---- the same claims with fake runs on the real cluster: submission, cancel, resume, following a job ------
def test_a_suite_on_slurm_a_cancelled_job_is_a_stopped_run_and_resume_finishes_it_exactly_with_fake_runs(
    slurm_cluster, fake_finished, fake_runs, warm_model_dir, tmp_path, monkeypatch, capsys
):
    for key, value in {**slurm_cluster.env, "COLUMNS": "250"}.items():
        monkeypatch.setenv(key, value)
    fake_runs.use(slow={"a": 0.6})  # run a is surely still training when the test cancels its job
    root, log = tmp_path / "out", tmp_path / "runner.log"
    runner = forked_runner(
        "run",
        str(slurm_suite(tmp_path, warm_model_dir, slurm_cluster.partition)),
        "--output-root",
        str(root),
        "--launcher",
        "slurm",
        log=log,
    )
    wait_for_steps([root / "runs" / "a"], 1, runner.is_alive, interval=0.05)
    job = SuiteManifest.load(root).runs[0].job_id
    slurm_cluster.run("scancel", job)
    runner.join(120)
    out = log.read_text()
    assert runner.exitcode == 130, out
    assert_the_cancelled_job_stopped_run_a(root, job, out, slurm_cluster)

    fake_runs.use()
    resume_submits_run_a_again_and_finishes_exactly(root, job, fake_finished, slurm_cluster, capsys)


def test_a_runner_killed_while_its_jobs_run_is_resumed_by_following_the_jobs_never_submitting_twice_with_fake_runs(
    slurm_cluster, fake_finished, fake_runs, warm_model_dir, tmp_path, monkeypatch
):
    """SIGKILL to the runner (a closed SSH session on a login node): run a's job trains on; resume follows
    that job to its end instead of submitting a second one, then submits b."""
    for key, value in slurm_cluster.env.items():
        monkeypatch.setenv(key, value)
    fake_runs.use(slow={"a": 0.6})
    root = tmp_path / "out"
    runner = forked_runner(
        "run", str(slurm_suite(tmp_path, warm_model_dir)), "--output-root", str(root), "--launcher", "slurm"
    )
    wait_for_steps([root / "runs" / "a"], 1, runner.is_alive, interval=0.05)
    runner.kill()
    runner.join()
    resume_follows_the_job_of_run_a_then_submits_b(root, fake_finished, slurm_cluster)
