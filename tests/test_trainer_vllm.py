"""The RL loop on the vLLM engine: several real steps with the sync checked every step, a skipped
sync caught, the engine under another interpreter, and a clean shutdown on Ctrl-C / SIGTERM.

Skipped without vLLM (the README's test set-up installs the CPU build). Each test starts an engine
(~20 s on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import (
    TASK_SETTINGS,
    bench_args,
    cli_pairs,
    descendants,
    params_of,
    quick_config,
    same,
    session_members,
    wait_until_gone,
)

from grpolab.commands.cli import main
from grpolab.rollout.sync_check import WeightSyncError
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import Trainer

pytest.importorskip("vllm")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TOL = 1e-4  # float32 engine vs trainer


def wait_gone(pids_before: set[int], timeout: float = 15.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while (extra := descendants() - pids_before) and time.monotonic() < deadline:
        time.sleep(0.2)
    return extra


def test_rl_steps_sync_checked_every_step_and_a_skipped_sync_is_caught(warm_model_dir, tmp_path):
    """On the engine under another interpreter (``rollout.vllm.python``: its server process, weights synced
    through files every step); the in-process engine's syncs are test_rollout_vllm.py's."""
    before = descendants()
    trainer = Trainer(quick_config(warm_model_dir, tmp_path / "run", vllm_python=sys.executable, algo="grpo"))
    try:
        assert descendants() - before, "the vLLM engine-core process runs"
        for step in (1, 2, 3):
            start = params_of(trainer.parts.model)
            record = trainer.train_step(step)
            assert record["sync/logprob_diff_max"] < TOL and record["sync/logprob_diff_mean"] < TOL / 10
            assert record["first_update/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
            if record["actual_updates"]:
                assert not same(start, params_of(trainer.parts.model))
        assert record["time/sync"] > 0
        # skip one sync: the update moves the trainer, the engine keeps the old weights
        trainer.parts.engine.sync_weights, sync = (lambda model: None), trainer.parts.engine.sync_weights
        step = 4
        while trainer.train_step(step)["actual_updates"] == 0:  # no signal in the batch: nothing moved yet
            step += 1
            assert step < 10, "no step with an update"
        with pytest.raises(WeightSyncError, match="not sampling from the trainer's current weights"):
            trainer.train_step(step + 1)
        sync(trainer.parts.sync_source())  # a real sync repairs it
        assert trainer.train_step(step + 2)["sync/logprob_diff_max"] < TOL
    finally:
        trainer.close()
    assert wait_gone(before) == set(), "no engine process outlives the run"


@pytest.mark.slow  # ~40 s; default tier: the child interpreter's engine in the interrupted run below
def test_multi_epoch_preset_and_vllm_under_another_interpreter_via_cli(warm_model_dir, tmp_path):
    """--vllm-python: the engine runs in its own process; off-policy preset (old log-probs frozen
    once and reused by the sync check) with the engine/trainer correction on."""
    before = descendants()
    out = tmp_path / "run"
    cfg = quick_config(warm_model_dir, out, algo="offpolicy_clip")
    args = ["train", "--model", cfg.model.path, "--output-dir", str(out), "--vllm-python", sys.executable]
    # --algorithm.engine_correction token: the old spelling of --algorithm.rollout_correction token_truncate
    args += ["--algo", "offpolicy_clip", "--algorithm.engine_correction", "token"]
    rollout = {"rollout.prompts_per_step": 4, "rollout.max_new_tokens": 40}
    args += cli_pairs({"steps": 2, **TASK_SETTINGS, **rollout, "optim.micro_batch_size": 16, "optim.lr": "1e-3"})
    assert main(args) == 0
    steps = [m for m in read_metrics(out / "metrics.jsonl") if "reward_mean" in m]
    assert len(steps) == 2 and all(m["sync/logprob_diff_max"] < TOL for m in steps)
    weights = [v for m in steps for k, v in m.items() if k.endswith("rollout_is_weight_mean")]
    assert weights and all(v == pytest.approx(1.0, abs=1e-3) for v in weights)  # TIS ~ 1 when in sync
    manifest = (out / "manifest.json").read_text()
    assert '"engine": "vllm"' in manifest and sys.executable in manifest
    assert wait_gone(before) == set()


# every case is slow (a minute each): the in-process Ctrl-C case and the child-interpreter one (the same signal
# with more processes: its engine server and the server's own engine processes); SIGTERM: test_dead_ends.py and
# test_edges.py test its handler, the trainer's stop in-process
@pytest.mark.parametrize(
    "how",
    [
        pytest.param("ctrl-c", marks=pytest.mark.slow),
        pytest.param("sigterm", marks=pytest.mark.slow),
        # ~40 s; default tier: the engine under another interpreter in the sync-checked run above, its processes
        # gone at close (there and test_rollout_vllm.py's test_close_leaves_no_child_processes), and Ctrl-C's
        # stop and resume on the hf engine (test_resume.py)
        pytest.param("ctrl-c, vllm in a child interpreter", marks=pytest.mark.slow),
    ],
)
def test_interrupted_run_leaves_no_processes(warm_model_dir, tmp_path, how):
    """Ctrl-C in a terminal signals the whole process group (engine processes included); SIGTERM
    (``kill PID``) reaches the trainer alone. Either way: exit code 130 and no process left."""
    out = tmp_path / "run"
    engine = ["--vllm-python", sys.executable] if "child" in how else ["--engine", "vllm"]
    command = [sys.executable, "-m", "grpolab.commands.cli", "train", "--model", str(warm_model_dir)]
    command += ["--output-dir", str(out), *engine]
    command += cli_pairs({"steps": 1000, **TASK_SETTINGS, "rollout.prompts_per_step": 4, "threads": 1})
    proc = subprocess.Popen(command, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not (out / "metrics.jsonl").exists() or "reward_mean" not in (out / "metrics.jsonl").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read().decode()[-3000:]
            time.sleep(0.5)
        assert len(session_members(proc.pid)) > 1, "trainer plus the vLLM engine processes"
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        output = proc.communicate(timeout=60)[0].decode()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, output[-3000:]
    assert "interrupted" in output
    assert wait_until_gone(lambda: session_members(proc.pid)) == set(), "orphaned processes after the interrupt"


@pytest.mark.slow  # ~30 s; default tier: test_vllm_sleep.py's bench rollout timing on vLLM, test_engine_config.py's bench
def test_bench_step_times_both_engines(warm_model_dir, tmp_path):
    report = tmp_path / "bench.json"
    args = bench_args("step", "hf,vllm", report, warm_model_dir)
    assert main(args) == 0
    results = json.loads(report.read_text())["results"]
    assert list(results) == ["hf", "vllm"]
    assert results["vllm"]["logprob_diff_max"] < TOL and 0 < results["vllm"]["sync"] < results["vllm"]["step"]
    assert all(results[e]["tokens_per_s"] > 0 for e in results)


def test_an_moe_policy_on_vllms_cpu_build_is_refused_in_one_line(warm_moe_dir, tmp_path, capsys):
    """vLLM 0.32's CPU MoE kernels repack the experts at load and its in-place reload does not: refused before
    the engine starts (the run directory is not created)."""
    args = ["train", "--model", str(warm_moe_dir), "--output-dir", str(tmp_path / "run"), "--engine", "vllm"]
    assert main(args) != 0
    out = capsys.readouterr()
    said = out.out + out.err
    assert "vLLM's CPU build cannot reload an MoE's expert weights in place" in said and "Traceback" not in said
    assert not (tmp_path / "run").exists()
