"""Async rollouts (``grpolab.rollout.pipeline``, ``grpolab.rollout.engine_process``): an engine process generates
the next batches while the learner trains. k = 0 is the sync run bit for bit; k >= 1 trains each batch exactly
min(k, t - 1) versions behind; a resumed async run is its uninterrupted self; an engine process that dies ends
the run in one line, resumable."""

from __future__ import annotations

import json
import os
import signal

import pytest
import torch
from conftest import quick_config, quick_run, quick_settings, run_numbers, train_until, untimed
from transformers import AutoModelForCausalLM

from grpolab.commands.cli import main
from grpolab.common.provenance import native_bf16
from grpolab.config import load_run_config
from grpolab.rollout.pipeline import AsyncRollouts
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import train

OVERRIDES = {"steps": 4, "checkpoint.every": 2, "eval.every": 2, "threads": 1, "rollout.engine_threads": 1}


def final_weights(run_dir, step: int = 4) -> dict[str, torch.Tensor]:
    return AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / f"step_{step:06d}").state_dict()


def same_weights(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(final_weights(a).values(), final_weights(b).values()))


@pytest.fixture(scope="module")
def sync_run(warm_model_dir, tmp_path_factory):
    return quick_run(tmp_path_factory, warm_model_dir, "sync", **OVERRIDES)


def test_async_at_staleness_0_is_the_sync_run_bit_for_bit(warm_model_dir, sync_run, tmp_path):
    run = tmp_path / "run"
    train(quick_config(warm_model_dir, run, **OVERRIDES, **{"rollout.mode": "async", "rollout.max_staleness": 0}))
    assert run_numbers(run) == run_numbers(sync_run)
    assert same_weights(run, sync_run)


@pytest.mark.skipif(not native_bf16(), reason="needs a CPU with native bf16 (AVX512-BF16 or AMX-BF16)")
def test_in_bf16_async_at_staleness_0_is_the_sync_run_bit_for_bit(warm_model_dir, tmp_path):
    """The engine process generates as the in-process engine does: under the trainer's autocast, on its own bf16
    copy of the linear layers, refreshed at each version from float32 master weights."""
    bf16 = {**OVERRIDES, "model.dtype": "bfloat16", "steps": 3, "checkpoint.every": 3, "eval.every": 3}
    train(quick_config(warm_model_dir, tmp_path / "sync", **bf16))
    train(
        quick_config(
            warm_model_dir, tmp_path / "async", **bf16, **{"rollout.mode": "async", "rollout.max_staleness": 0}
        )
    )
    sync, run = (read_metrics(tmp_path / name / "metrics.jsonl") for name in ("sync", "async"))
    assert untimed(run) == untimed(sync) and all("sync/logprob_diff_max" in r for r in run if "reward_mean" in r)
    assert all(
        torch.equal(a, b)
        for a, b in zip(final_weights(tmp_path / "sync", 3).values(), final_weights(tmp_path / "async", 3).values())
    )


@pytest.fixture(scope="module")
def async_run(warm_model_dir, tmp_path_factory):
    return quick_run(tmp_path_factory, warm_model_dir, "async", **OVERRIDES, **ASYNC)


ASYNC = {"rollout.mode": "async", "rollout.max_staleness": 1}


def test_async_at_staleness_1_trains_each_batch_one_version_behind(async_run, sync_run):
    records = [r for r in read_metrics(async_run / "metrics.jsonl") if "reward_mean" in r]
    assert [r["staleness/max"] for r in records] == [0, 1, 1, 1]  # step 1's batch: the start policy, as in sync
    assert [r["staleness/at_1"] for r in records] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["time/wait_rollout"] >= 0 for r in records)
    synced = [r for r in read_metrics(sync_run / "metrics.jsonl") if "reward_mean" in r]
    for key in ("reward_mean", "accuracy", "completion_len_mean", "response_tokens"):  # step 1: the same batch
        assert records[0][key] == synced[0][key], key
    resolved = json.loads((async_run / "config.json").read_text())["algorithm"]["rollout_correction"]
    assert resolved == "token_truncate" and "rollout_is_weight_mean" in records[1]  # decoupled PPO's weight
    assert records[1]["reward_mean"] != synced[1]["reward_mean"] or records[1]["loss"] != synced[1]["loss"]
    assert (
        "sync/logprob_diff_max" in records[0] and "sync/logprob_diff_max" not in records[1]
    )  # a stale batch is not a sync


def test_async_run_stopped_after_step_3_resumes_with_identical_numbers(warm_model_dir, async_run, tmp_path):
    run = tmp_path / "run"
    train_until(quick_config(warm_model_dir, run, **OVERRIDES, **ASYNC), stop_at=4)
    state = torch.load(run / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    assert (
        sorted(state["rollouts"]["pending"]) == [3] and state["rollouts"]["next_step"] == 4
    )  # batch 3 made ahead; 4 by the saved weights
    train(load_run_config(run), resume=True)
    assert run_numbers(run) == run_numbers(async_run)
    assert same_weights(run, async_run)


def test_an_engine_process_killed_mid_run_is_one_line_and_the_run_resumes(
    warm_model_dir, async_run, tmp_path, monkeypatch, capsys
):
    run = tmp_path / "run"
    original = AsyncRollouts.publish

    def kill_engine_before_version_2(self, weights, step):
        if step == 2:  # once batch 3 (version 1) is made: batch 4, version 2's, is generated after the kill
            with self.changed:
                self.changed.wait_for(lambda: 3 in self.ready)
            os.kill(self.engine.pid, signal.SIGKILL)
        return original(self, weights, step)

    monkeypatch.setattr(AsyncRollouts, "publish", kill_engine_before_version_2)
    args = [f"--{k}={v}" for k, v in {**quick_settings(warm_model_dir, run), **OVERRIDES, **ASYNC}.items()]
    assert main(["train", *args]) == 2
    err = [line for line in capsys.readouterr().out.splitlines() if "error:" in line]
    assert len(err) == 1 and "engine process" in err[0] and f"grpolab train --resume {run}" in err[0], err
    monkeypatch.setattr(AsyncRollouts, "publish", original)
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl")) == 3
    train(load_run_config(run), resume=True)
    assert run_numbers(run) == run_numbers(async_run)
    assert same_weights(run, async_run)


def test_bench_step_times_async_steps_past_the_configs_last_step(warm_model_dir, tmp_path):
    report = tmp_path / "bench.json"
    args = ["bench", "step", "--engines", "hf", "--repeats", "3", "--json", str(report), "--steps", "1"]
    settings = {k: v for k, v in quick_settings(warm_model_dir, tmp_path / "unused").items() if k != "output_dir"}
    args += [f"--{k}={v}" for k, v in {**settings, "steps": 1, **OVERRIDES, **ASYNC}.items() if k != "steps"]
    assert main(args) == 0
    figures = json.loads(report.read_text())["results"]["hf"]
    assert figures["step"] > 0 and figures["tokens_per_s"] > 0


VLLM = {"rollout.engine": "vllm", "rollout.vllm.kv_cache_gib": 0.0625}


@pytest.fixture(scope="module")
def vllm_sync_run(warm_model_dir, tmp_path_factory):
    pytest.importorskip("vllm")
    return quick_run(tmp_path_factory, warm_model_dir, "vllm-sync", **OVERRIDES, **VLLM)


@pytest.mark.slow  # ~95 s: three vLLM engines; default tier: test_trainer_vllm.py's run with vLLM started apart
def test_vllm_async_at_staleness_0_is_its_sync_run_bit_for_bit(warm_model_dir, vllm_sync_run, tmp_path):
    """vLLM apart (started as a process of its own, its weights by version in checkpoint folders) samples as the
    run's own vLLM engine does."""
    run = tmp_path / "run"
    stale0 = {"rollout.mode": "async", "rollout.max_staleness": 0}
    train(quick_config(warm_model_dir, run, **OVERRIDES, **VLLM, **stale0))
    assert run_numbers(run) == run_numbers(vllm_sync_run)
    assert same_weights(run, vllm_sync_run)


@pytest.mark.slow  # ~2 min: three runs, each with two vLLM engines
def test_vllm_async_run_stopped_after_step_3_resumes_with_identical_numbers(warm_model_dir, tmp_path):
    pytest.importorskip("vllm")
    whole, run = tmp_path / "whole", tmp_path / "run"
    train(quick_config(warm_model_dir, whole, **OVERRIDES, **VLLM, **ASYNC))
    records = [r for r in read_metrics(whole / "metrics.jsonl") if "reward_mean" in r]
    assert [r["staleness/max"] for r in records] == [0, 1, 1, 1]
    train_until(quick_config(warm_model_dir, run, **OVERRIDES, **VLLM, **ASYNC), stop_at=4)
    train(load_run_config(run), resume=True)
    assert run_numbers(run) == run_numbers(whole)
    assert same_weights(run, whole)


LEARNER_KILLED_MID_GENERATION = """
import os, signal, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from grpolab.config import RolloutConfig
from grpolab.models.precision import TrainingPrecision
from grpolab.rollout.base import SamplingParams
from grpolab.rollout.engines import EngineRequest, build_engine_apart

if __name__ == "__main__":
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    precision = TrainingPrecision("float32", torch.float32, torch.float32)
    request = EngineRequest(RolloutConfig(), model, tokenizer, sys.argv[1], 0, 128, precision)
    engine = build_engine_apart(request, threads=1)
    prompts, params = [tokenizer("1 + 2 =")["input_ids"]] * 8, SamplingParams(max_new_tokens=64, seed=0)
    engine.generate(prompts, 4, params)  # the engine process is up and answering
    engine.child.conn.send(("generate", None, (prompts, 4, params)))  # its reply will find no learner
    print(f"engine {engine.pid}", flush=True)
    print("learner killed", file=sys.stderr, flush=True)  # what follows is the engine process's
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_an_engine_process_whose_learner_is_killed_exits_quietly(warm_model_dir, tmp_path):
    """The learner SIGKILLed while its engine process generates: the engine's reply meets a closed pipe and it
    ends without a traceback (its output shares the learner's: read to the end, once both have exited)."""
    import subprocess
    import sys
    import time

    script = tmp_path / "learner.py"
    script.write_text(LEARNER_KILLED_MID_GENERATION)
    done = subprocess.run(
        [sys.executable, str(script), str(warm_model_dir)], capture_output=True, text=True, timeout=300
    )
    out = done.stdout + done.stderr
    assert done.returncode == -signal.SIGKILL and "engine " in done.stdout, out
    pid = int(done.stdout.split("engine ")[1].split()[0])
    for _ in range(100):  # the engine process is gone too (it ends when its pipe closes)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the engine process {pid} outlived its learner")
    assert "Traceback" not in out and "BrokenPipeError" not in out, out
    assert len(done.stderr.split("learner killed", 1)[1].strip().splitlines()) <= 1, out
