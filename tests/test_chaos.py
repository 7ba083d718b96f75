"""Chaos: ``grpolab train`` killed with SIGKILL at random moments (starting up, mid-step, evaluating, inside
checkpoint writes) and resumed each time ends with the metrics and weights of an uninterrupted run, no
duplicate step, no temp folder and no lock left."""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TASK, quick_config
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from grpolab.run.checkpoints import newest_verified
from grpolab.run.lock import lock_holder
from grpolab.run.rundir import read_metrics
from grpolab.run.state import STATE_FILE
from grpolab.run.trainer import train

# a process of the run kills itself inside its Nth fsync of a checkpoint write (a file, checkpoint.json,
# the folder, or the parent after the rename) when GRPOLAB_TEST_KILL_AT_FSYNC=N
HOOK = """
import os, signal
if os.environ.get("GRPOLAB_TEST_KILL_AT_FSYNC"):
    import grpolab.run.checkpoints as checkpoints
    _fsync, calls = checkpoints._fsync, [0]
    def fsync(path):
        calls[0] += 1
        if calls[0] == int(os.environ["GRPOLAB_TEST_KILL_AT_FSYNC"]):
            os.kill(os.getpid(), signal.SIGKILL)
        return _fsync(path)
    checkpoints._fsync = fsync
if os.environ.get("GRPOLAB_TEST_KILL_AFTER_WEIGHTS"):  # killed once a model's weights are written
    import safetensors.torch
    _save_file = safetensors.torch.save_file
    def save_file(*args, **kwargs):
        _save_file(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGKILL)
    safetensors.torch.save_file = save_file
"""


LORA = {"model.lora.rank": 4, "model.lora.alpha": 8}


def settings(model_dir: Path, run: Path, steps: int, extra: dict | None = None) -> dict:
    return {
        "model.path": str(model_dir),
        "output_dir": str(run),
        "threads": 1,
        "steps": steps,
        "checkpoint.every": 1,
        "eval.every": 3,
        **{f"task.{k}": v for k, v in TASK.items()},
        "rollout.prompts_per_step": 4,
        "rollout.max_new_tokens": 40,
        "optim.micro_batch_size": 16,
        "optim.lr": 1e-3,
        **(extra or {}),
    }


def untimed(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"} for r in records]


def session_step(run: Path, sessions: int) -> int | None:
    """The step the newest session reached, once there are more than ``sessions`` sessions."""
    try:
        recorded = json.loads((run / "manifest.json").read_text())["sessions"]
    except (OSError, ValueError, KeyError):
        return None
    return recorded[-1]["to_step"] if len(recorded) > sessions else None


def sessions_of(run: Path) -> int:
    return len(json.loads((run / "manifest.json").read_text())["sessions"]) if (run / "manifest.json").is_file() else 0


def kill_and_resume(
    model_dir: Path,
    run: Path,
    steps: int,
    kills: int,
    seed: int,
    hook: Path,
    extra: dict | None = None,
    plan: list[str] | None = None,
) -> list[str]:
    """Kill the run ``kills`` times at random moments (or as ``plan`` says), resuming after each; returns how
    each kill landed. A run killed before its first checkpoint resumes from step 0 in place; one killed before
    it wrote its config.json is started again, into the same folder, with its own command."""
    rng, landed = random.Random(seed), []
    args = [f"--{k}={v}" for k, v in settings(model_dir, run, steps, extra).items()]
    while True:
        checkpoint = newest_verified(run, (STATE_FILE,)).checkpoint if run.exists() else None
        start = int(checkpoint.name.removeprefix("step_")) if checkpoint else 0
        if start == steps:  # killed after its final checkpoint (while finishing): complete, nothing to resume
            return landed
        command = ["train", "--resume", str(run)] if (run / "config.json").is_file() else ["train", *args]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")])}
        how = (
            None
            if len(landed) == kills
            else plan[len(landed)]
            if plan
            else rng.choice(["startup", "mid-step", "mid-step", "checkpoint write"])
        )
        if how is not None and not plan and start >= steps - 4:
            how = "startup"  # the last steps (a fraction of a second each) could end before a later kill
        if how == "checkpoint write":  # in this session's first checkpoint write (about 10 fsyncs)
            env["GRPOLAB_TEST_KILL_AT_FSYNC"] = str(rng.randint(1, 10))
        before = sessions_of(run)
        log = run.parent / f"attempt-{len(landed)}.log"
        with log.open("w") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "grpolab.commands.cli", *command], env=env, stdout=out, stderr=subprocess.STDOUT
            )
        if how == "startup":  # importing, loading, verifying, rewinding
            time.sleep(rng.uniform(0.0, 2.0))
        elif how == "mid-step":  # a random moment of one of this session's next steps
            target, deadline = start + rng.randint(0, 1), time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                reached = session_step(run, before)
                if reached is not None and reached >= target:
                    break
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.3))
        if how is None or how == "checkpoint write":
            proc.wait(timeout=300)
        else:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if proc.returncode == 0:
            return landed
        assert proc.returncode == -signal.SIGKILL, f"{command}: exit code {proc.returncode}\n{log.read_text()[-3000:]}"
        landed.append(how)


@pytest.fixture(scope="module")
def hook(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("hook")
    (folder / "sitecustomize.py").write_text(HOOK)
    return folder


def final_weights(run: Path, steps: int) -> dict[str, torch.Tensor]:
    """The last checkpoint's weights: the model's, or a LoRA run's adapter."""
    folder = run / f"checkpoints/step_{steps:06d}"
    if (folder / "adapter_model.safetensors").is_file():
        return load_file(folder / "adapter_model.safetensors")
    return AutoModelForCausalLM.from_pretrained(folder).state_dict()


def check_against_uninterrupted(
    model_dir: Path, run: Path, reference: Path, steps: int, extra: dict | None = None
) -> None:
    train(
        quick_config(
            model_dir,
            reference,
            **{
                k: v
                for k, v in settings(model_dir, reference, steps, extra).items()
                if k not in ("model.path", "output_dir")
            },
        )
    )
    got = read_metrics(run / "metrics.jsonl")
    train_steps = [r["step"] for r in got if "reward_mean" in r]
    assert train_steps == list(range(1, steps + 1))  # no duplicate, none missing
    assert untimed(got) == untimed(read_metrics(reference / "metrics.jsonl"))
    got_weights, want_weights = final_weights(run, steps), final_weights(reference, steps)
    assert got_weights.keys() == want_weights.keys()
    for name, a in got_weights.items():
        assert torch.equal(a, want_weights[name]), name
    assert not list((run / "checkpoints").glob(".*")), "a temp folder was left"
    assert lock_holder(run) is None


# Every test here starts several `grpolab train` processes: the slow tier. Their claims in the default tier:
# SIGKILL mid-step then an exact resume (test_resume.py), a torn metrics line and an interrupted checkpoint
# write cleaned up at resume (test_resume.py), atomic folders (test_atomic.py), a LoRA run's exact resume
# (test_lora.py), a run stopped before its first checkpoint resumed from step 0 in place (test_dead_ends.py),
# an export (test_lora.py).
@pytest.mark.slow
def test_a_few_random_kills_then_resumes_match_the_uninterrupted_run(warm_model_dir, hook, tmp_path):
    run = tmp_path / "run"
    landed = kill_and_resume(warm_model_dir, run, steps=5, kills=3, seed=0, hook=hook)
    assert len(landed) == 3 and "checkpoint write" in landed, landed
    check_against_uninterrupted(warm_model_dir, run, tmp_path / "reference", steps=5)


@pytest.mark.slow
def test_a_lora_run_killed_and_resumed_matches_the_uninterrupted_run(warm_model_dir, hook, tmp_path):
    """The adapter, its optimizer state and every RNG in the checkpoint: kill -9 changes no number."""
    run = tmp_path / "run"
    landed = kill_and_resume(warm_model_dir, run, steps=4, kills=2, seed=2, hook=hook, extra=LORA)
    assert len(landed) == 2, landed
    check_against_uninterrupted(warm_model_dir, run, tmp_path / "reference", steps=4, extra=LORA)


@pytest.mark.slow
def test_kills_before_the_first_checkpoint_resume_from_step_0_in_place_to_the_uninterrupted_run(
    warm_model_dir, hook, tmp_path
):
    """Killed in its first steps, inside its first checkpoint write and while starting again, a run with no
    complete checkpoint yet resumes from step 0 in place (it was a dead end: 'no complete checkpoint' to
    --resume, 'not empty' to a new run)."""
    run, extra = tmp_path / "run", {"checkpoint.every": 4}
    landed = kill_and_resume(
        warm_model_dir,
        run,
        steps=6,
        kills=4,
        seed=3,
        hook=hook,
        extra=extra,
        plan=["mid-step", "checkpoint write", "startup", "mid-step"],
    )
    assert len(landed) == 4, landed
    resumes = json.loads((run / "manifest.json").read_text()).get("resumes", [])
    assert sum(r["from_checkpoint"] is None for r in resumes) >= 2, resumes  # from step 0, twice at least
    assert (run / "metrics.discarded.jsonl").is_file()  # what the killed sessions wrote, set aside
    check_against_uninterrupted(warm_model_dir, run, tmp_path / "reference", steps=6, extra=extra)


@pytest.mark.slow
def test_an_async_run_killed_at_random_moments_resumes_to_the_uninterrupted_async_run(warm_model_dir, hook, tmp_path):
    """Async rollouts (staleness 2): each checkpoint holds the batches generated ahead, so kill -9 anywhere,
    the engine process with it, changes no number (default tier: test_async_rollouts.py's in-process stop and
    engine kill, each resumed exactly)."""
    run, extra = tmp_path / "run", {"rollout.mode": "async", "rollout.max_staleness": 2, "rollout.engine_threads": 1}
    landed = kill_and_resume(warm_model_dir, run, steps=8, kills=4, seed=4, hook=hook, extra=extra)
    assert len(landed) == 4, landed
    check_against_uninterrupted(warm_model_dir, run, tmp_path / "reference", steps=8, extra=extra)


@pytest.mark.slow
def test_fifty_random_kills_then_resumes_match_the_uninterrupted_run(warm_model_dir, hook, tmp_path):
    run = tmp_path / "run"
    landed = kill_and_resume(warm_model_dir, run, steps=20, kills=50, seed=1, hook=hook)
    assert len(landed) == 50 and "checkpoint write" in landed and "mid-step" in landed, landed
    check_against_uninterrupted(warm_model_dir, run, tmp_path / "reference", steps=20)


@pytest.mark.slow
def test_an_export_killed_midway_leaves_nothing_and_the_next_export_matches(warm_model_dir, hook, tmp_path):
    """``grpolab export`` killed after it wrote the merged weights (config.json already beside them) leaves no
    part of the export in its folder; the next export into it succeeds and equals an uninterrupted one."""
    train(quick_config(warm_model_dir, tmp_path / "run", steps=1, **{"checkpoint.every": 1, **LORA}))
    checkpoint, out, reference = tmp_path / "run/checkpoints/step_000001", tmp_path / "out", tmp_path / "reference"

    def export(folder: Path, **env: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]), **env}
        return subprocess.run(
            [sys.executable, "-m", "grpolab.commands.cli", "export", str(checkpoint), str(folder)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    assert export(out, GRPOLAB_TEST_KILL_AFTER_WEIGHTS="1").returncode == -signal.SIGKILL
    assert not out.exists() or not any(out.iterdir())
    done = export(out)
    assert done.returncode == 0, done.stdout + done.stderr
    assert export(reference).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "reference", "run"]  # no temp folder left
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())
    got, want = load_file(out / "model.safetensors"), load_file(reference / "model.safetensors")
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


# ---- an environment server and the policy endpoint killed mid-run (default tier) --------------------------------
DIES_ONCE = '''
import os
from pathlib import Path

from openenv_envs import GuessEnvironment


class DiesOnceEnvironment(GuessEnvironment):
    """The guessing game, whose server process exits (code 3) at its first episode step after the run's step-1
    checkpoint exists, while the flag file is there (removed first: it dies once)."""

    def step(self, action, timeout_s=None, **kwargs):
        flag = Path(os.environ["CHAOS_FLAG"])
        if flag.exists() and Path(os.environ["CHAOS_AFTER"]).exists():
            flag.unlink(missing_ok=True)
            os._exit(3)
        return super().step(action, timeout_s, **kwargs)
'''


def environment_run_args(model_dir: Path, run: Path, app: str) -> list[str]:
    """Two steps of the OpenEnv guessing game on a tiny chat model, a checkpoint after each."""
    from test_openenv import _train_args

    return _train_args(model_dir, run, app) + ["--steps=2", "--checkpoint.every=1", "--eval.every=2"]


def step_records(run: Path) -> list[dict]:
    return untimed([r for r in read_metrics(run / "metrics.jsonl") if "reward_mean" in r])


def step_differences(got: list[dict], want: list[dict]) -> list[str]:
    """Where two runs' step records differ: counts and rewards must be equal, other floats agree to 1e-4
    relative, except the measures of the engine's rounding against the trainer's (``sync/...``, the engine's
    log-prob difference and KL), which are not compared. The endpoint batches an environment's concurrent calls
    as they arrive, so the engine's batches, and the last bits of their log-probs, depend on timing; the sampled
    tokens, rewards and advantages do not."""
    if [sorted(r) for r in got] != [sorted(r) for r in want]:
        return [f"steps or keys differ: {[sorted(r) for r in got]} vs {[sorted(r) for r in want]}"]
    rounding = ("sync/", "engine_logprob_absdiff", "rollout_kl_k3")
    return [
        f"step {a['step']} {k}: {a[k]!r} vs {b[k]!r}"
        for a, b in zip(got, want)
        for k in a
        if not k.startswith(rounding)
        and not (math.isclose(a[k], b[k], rel_tol=1e-4, abs_tol=1e-6) if isinstance(a[k], float) else a[k] == b[k])
    ]


def error_line(out: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith("error:")]
    return line


@pytest.fixture(scope="module")
def uninterrupted_environment_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    from chat_envs import chatml_model_dir

    from grpolab.commands.cli import main

    root = tmp_path_factory.mktemp("uninterrupted")
    model = chatml_model_dir(root)
    assert main(environment_run_args(model, root / "run", "openenv_envs:GuessEnvironment")) == 0
    return model, step_records(root / "run")


def test_an_environment_server_killed_mid_run_stops_in_one_line_and_resumes_exactly(
    uninterrupted_environment_run, tmp_path, monkeypatch, capsys
):
    """The OpenEnv server exits in the middle of step 2's rollouts: the run stops in one line naming it, with the
    resume command (it used to score every later rollout 0 and end 'done', exit 0); no server is left; the resume
    ends with the uninterrupted run's numbers (``step_differences``)."""
    from test_openenv import _servers_of

    from grpolab.commands.cli import main

    model, want = uninterrupted_environment_run
    (tmp_path / "dies_once.py").write_text(DIES_ONCE)
    monkeypatch.syspath_prepend(tmp_path)
    run, flag = tmp_path / "run", tmp_path / "flag"
    flag.touch()
    monkeypatch.setenv("CHAOS_FLAG", str(flag))
    monkeypatch.setenv("CHAOS_AFTER", str(run / "checkpoints" / "step_000001"))
    before = _servers_of(os.getpid())
    assert main(environment_run_args(model, run, "dies_once:DiesOnceEnvironment")) == 2
    line = error_line(capsys.readouterr().out)
    assert "the OpenEnv server of dies_once:DiesOnceEnvironment" in line and "exited with code 3 mid-run" in line
    assert line.endswith(
        f"the run stopped after step 1: continue from its last checkpoint with: grpolab train --resume {run}"
    )
    assert not flag.exists() and _servers_of(os.getpid()) == before
    assert step_differences(step_records(run), want[:1]) == []  # step 1 kept, nothing of step 2 written
    assert main(["train", "--resume", str(run)]) == 0
    assert step_differences(step_records(run), want) == []
    assert _servers_of(os.getpid()) == before


def test_the_policy_endpoint_stopped_mid_run_stops_in_one_line_and_resumes_exactly(
    uninterrupted_environment_run, tmp_path, monkeypatch, capsys
):
    """The policy endpoint the environment's client calls stops serving after step 1's checkpoint: step 2's
    rollouts cannot reach the policy; the run stops in one line naming the endpoint, with the resume command (not
    zeros, not a step trained on failures); the resume ends with the uninterrupted run's numbers."""
    from grpolab.commands.cli import main
    from grpolab.run.trainer import Trainer

    model, want = uninterrupted_environment_run
    save = Trainer.save_checkpoint

    def save_then_stop_the_endpoint(self, step):
        done = save(self, step)
        if step == 1:
            self.parts.engine.endpoint.close()
        return done

    monkeypatch.setattr(Trainer, "save_checkpoint", save_then_stop_the_endpoint)
    run = tmp_path / "run"
    assert main(environment_run_args(model, run, "openenv_envs:GuessEnvironment")) == 2
    line = error_line(capsys.readouterr().out)
    assert "the policy endpoint on port" in line and "stopped serving (endpoint-http, endpoint-batcher ended)" in line
    assert line.endswith(f"continue from its last checkpoint with: grpolab train --resume {run}")
    assert step_differences(step_records(run), want[:1]) == []
    monkeypatch.setattr(Trainer, "save_checkpoint", save)
    assert main(["train", "--resume", str(run)]) == 0
    assert step_differences(step_records(run), want) == []
