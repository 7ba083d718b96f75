"""VLLMEngine on a tiny float32 Llama: the rollout contract, log-probs, weight sync and its check.

One engine is shared by the module (start ~20 s); it can serve a LoRA adapter (test_vllm_lora.py's check of
the adapter sync runs on it, last before its close). Engine tests skip when vLLM is not installed
(run them with ``.venv-vllm/bin/pytest tests/test_rollout_vllm.py``); the pure sync-check tests
run everywhere. The model is conftest's ``vllm_model_dir`` (head_dim 32, tied embeddings).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import assert_engine_contract, group_members, live_processes, wait_until_gone
from conftest import descendants as _children
from transformers import AutoModelForCausalLM

from grpolab.learning.batching import collate
from grpolab.models.logprobs import token_logprobs
from grpolab.models.weights import ModelWeights
from grpolab.rollout import Completion, HFEngine, RolloutEngine, SamplingParams
from grpolab.rollout.engine_process import EngineDied
from grpolab.rollout.sync_check import (
    SyncCheck,
    WeightSyncError,
    engine_logprob_matrix,
    logprob_diff,
    verify_weight_sync,
)

PROMPTS = ["12+34=", "7+8=<think>", "a"]
TOL = 1e-4


def _flat(groups: list[list[Completion]]) -> list[Completion]:
    return [c for g in groups for c in g]


def _trainer_logprobs(model, completions: list[Completion], pad_id: int, temperature: float):
    batch = collate(completions, pad_id)
    with torch.no_grad():
        lp = token_logprobs(model, batch.input_ids, batch.attention_mask, temperature=temperature).logprobs
    return batch, lp


@pytest.fixture(scope="module")
def model_dir(vllm_model_dir):
    return vllm_model_dir


@pytest.fixture(scope="module")
def children_before():
    return _children()


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer, children_before):
    pytest.importorskip("vllm")
    from grpolab.rollout.vllm.engine import VLLMEngine

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    eng = VLLMEngine(model_dir, tokenizer, dtype="float32", seed=0, max_model_len=256, enforce_eager=True, lora_rank=4)
    yield eng
    eng.close()


@pytest.fixture
def model(model_dir):
    """A fresh trainer-side copy of the checkpoint the engine started from."""
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


# ---- pure sync check ------------------------------------------------------------------------
def test_sync_check_is_masked_and_raises():
    engine = torch.tensor([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, 0.0, 0.0]])
    trainer = torch.tensor([[-9.0, -1.1, -2.0, -9.0], [-9.0, -0.2, -9.0, -9.0]])
    mask = torch.tensor([[0, 1, 1, 0], [0, 1, 0, 0]], dtype=torch.float32)
    check = logprob_diff(engine, trainer, mask)
    assert check.num_tokens == 3
    assert check.max_abs_diff == pytest.approx(0.3) and check.mean_abs_diff == pytest.approx(0.4 / 3)
    assert verify_weight_sync(engine, trainer, mask, max_abs_diff=0.5) == check
    with pytest.raises(WeightSyncError, match="not sampling from the trainer's current weights"):
        verify_weight_sync(engine, trainer, mask, mean_abs_diff=0.1)
    assert logprob_diff(engine, trainer, torch.zeros_like(mask)) == SyncCheck(0.0, 0.0, 0)
    with pytest.raises(ValueError):
        verify_weight_sync(engine, trainer, mask)


def test_engine_logprob_matrix_matches_collate():
    completions = [
        Completion([5, 6], [7, 8, 2], [-0.1, -0.2, -0.3], "stop", ""),
        Completion([5], [9], [-1.5], "length", ""),
    ]
    batch = collate(completions, pad_id=0)
    assert torch.equal(engine_logprob_matrix(completions, batch.input_ids.shape[1]), batch.engine_logprobs)
    assert logprob_diff(completions, batch.engine_logprobs, batch.response_mask).max_abs_diff == 0.0


# ---- the engine -----------------------------------------------------------------------------
def test_contract(engine, tokenizer, prompts):
    assert isinstance(engine, RolloutEngine)
    assert engine.eos_token_ids == [tokenizer.eos_token_id]
    out = engine.generate(prompts, 8, SamplingParams(max_new_tokens=12, seed=0))
    assert [len(g) for g in out] == [8, 8, 8]
    flat = _flat(out)
    assert_engine_contract(out, prompts, tokenizer, max_new_tokens=12)
    assert any(c.finish_reason == "stop" for c in flat) and any(c.finish_reason == "length" for c in flat)
    assert len({tuple(c.completion_ids) for c in out[0]}) > 1  # the n samples differ
    again = engine.generate(prompts, 8, SamplingParams(max_new_tokens=12, seed=0))
    assert [c.completion_ids for c in _flat(again)] == [c.completion_ids for c in flat]  # seeded


@pytest.mark.parametrize("stop_len", [1, 3])
def test_stop_strings_kept_and_cut(engine, tokenizer, prompts, stop_len):
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=5)
    free = _flat(engine.generate(prompts, 2, params))
    source = next(c for c in free if len(c.completion_ids) > 6 + stop_len and c.finish_reason == "length")
    stop = tokenizer.decode(source.completion_ids[4 : 4 + stop_len])
    cut = _flat(
        engine.generate(prompts, 2, SamplingParams(max_new_tokens=20, temperature=0.8, seed=5, stop_strings=(stop,)))
    )
    hits = 0
    for f, c in zip(free, cut):
        assert f.completion_ids[: len(c.completion_ids)] == c.completion_ids  # same samples, cut earlier
        assert c.logprobs == pytest.approx(f.logprobs[: len(c.logprobs)], abs=1e-6)
        text = tokenizer.decode(c.completion_ids, skip_special_tokens=False)
        if stop in text:
            hits += 1
            assert c.finish_reason == "stop"
            assert stop not in tokenizer.decode(c.completion_ids[:-1], skip_special_tokens=False)
        else:
            assert c.completion_ids == f.completion_ids
    assert hits >= 1


def test_top_k_top_p_refused(engine, prompts):
    for params in (SamplingParams(max_new_tokens=4, top_k=5), SamplingParams(max_new_tokens=4, top_p=0.9)):
        with pytest.raises(ValueError, match="top_k=0 and top_p=1"):
            engine.generate(prompts, 1, params)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_match_trainer(engine, model, tokenizer, prompts, temperature):
    params = SamplingParams(max_new_tokens=16, temperature=temperature, seed=11)
    out = engine.generate(prompts, 4, params)
    if params.greedy:  # n greedy samples are n copies
        assert all(c.completion_ids == g[0].completion_ids and c is not g[0] for g in out for c in g[1:])
    flat = _flat(out)
    batch, lp = _trainer_logprobs(model, flat, tokenizer.pad_token_id, params.logprob_temperature)
    check = verify_weight_sync(batch.engine_logprobs, lp, batch.response_mask, max_abs_diff=TOL)
    assert check.num_tokens == batch.num_response_tokens > 0


def test_batch_larger_than_a_step(engine, model, tokenizer):
    """More prompt tokens than one scheduler step holds, all seeded (vLLM-CPU crashed on a seeded
    request whose prefill was split across steps)."""
    prompts = [tokenizer.encode(f"{i:03d}" + "1+2=3;" * 33) for i in range(24)]  # 24 x 4 x 201 tokens
    params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=7)
    flat = _flat(engine.generate(prompts, 4, params))
    batch, lp = _trainer_logprobs(model, flat, tokenizer.pad_token_id, 1.0)
    verify_weight_sync(batch.engine_logprobs, lp, batch.response_mask, max_abs_diff=TOL)


def test_greedy_matches_hf_engine(engine, model, tokenizer, prompts):
    params = SamplingParams(max_new_tokens=16, temperature=0.0)
    ours = _flat(engine.generate(prompts, 1, params))
    theirs = _flat(HFEngine(model, tokenizer).generate(prompts, 1, params))
    for a, b in zip(ours, theirs):
        assert (a.completion_ids, a.finish_reason, a.text) == (b.completion_ids, b.finish_reason, b.text)
        assert a.logprobs == pytest.approx(b.logprobs, abs=TOL)


def test_weight_sync_is_verified(engine, model, tokenizer, prompts):
    """An optimizer step moves the trainer; without a sync the check fails, after it it passes.
    A prompt longer than a KV block (128 on CPU) checks that no stale prefix-cache entry survives."""
    prompts = [*prompts, tokenizer.encode("9+9=18;" * 30)]
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=21)
    before = _flat(engine.generate(prompts, 4, params))
    batch = collate(before, tokenizer.pad_token_id)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-2)
    model.train()
    lp = token_logprobs(model, batch.input_ids, batch.attention_mask).logprobs
    (-(lp * batch.response_mask).sum() / batch.response_mask.sum()).backward()
    optimizer.step()
    model.eval()

    stale = _flat(engine.generate(prompts, 4, params))  # engine still on the old weights
    batch, lp = _trainer_logprobs(model, stale, tokenizer.pad_token_id, 1.0)
    with pytest.raises(WeightSyncError):
        verify_weight_sync(batch.engine_logprobs, lp, batch.response_mask, max_abs_diff=TOL)
    assert logprob_diff(stale, lp, batch.response_mask).mean_abs_diff > 1e-2

    engine.sync_weights(ModelWeights(model))
    synced = _flat(engine.generate(prompts, 4, params))  # same prompts: prefix cache must be stale-free
    batch, lp = _trainer_logprobs(model, synced, tokenizer.pad_token_id, 1.0)
    verify_weight_sync(synced, lp, batch.response_mask, max_abs_diff=TOL)


def test_a_synced_adapter_is_served_exactly_and_reloaded_in_place(engine, model_dir, tokenizer):
    """After the full-weight tests: from here on the engine serves the adapter (the module's last user)."""
    from test_vllm_lora import assert_serves_the_synced_adapter_exactly

    engine.sync_weights(ModelWeights(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)))  # the base
    assert_serves_the_synced_adapter_exactly(engine, model_dir, tokenizer)


def test_close_leaves_no_child_processes(engine, children_before):
    assert _children() - children_before  # the engine-core processes are running
    engine.close()
    engine.close()  # idempotent
    deadline = time.monotonic() + 10
    while _children() - children_before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _children() - children_before == set()


# ---- the engine under another interpreter -------------------------------------------------------
def _vllm_python() -> str:
    """GRPOLAB_VLLM_PYTHON (e.g. .venv-vllm/bin/python, from any venv), else this one if it has vLLM."""
    python = os.environ.get("GRPOLAB_VLLM_PYTHON")
    if python:
        return python
    pytest.importorskip("vllm")
    return sys.executable


@pytest.mark.slow  # ~45 s (a second interpreter, its engine); default tier: test_trainer_vllm.py's Ctrl-C of a run
def test_subprocess_engine(model_dir, model, tokenizer, prompts):
    """Contract, log-probs, a verified sync, with vLLM in a child interpreter; a server that stops answering
    (stopped here, as if its engine hung) is killed within the close timeout, its processes with it."""
    from grpolab.rollout.vllm.apart import vllm_process

    before = _children()
    # sleep_level: a logged no-op on CPU (no sleep mode there); sleeps between rollouts on GPU
    engine = vllm_process(
        model_dir,
        python=_vllm_python(),
        dtype="float32",
        seed=0,
        max_model_len=256,
        kv_cache_bytes=64 << 20,
        sleep_level=1,
    )
    try:
        assert isinstance(engine, RolloutEngine) and engine.eos_token_ids == [tokenizer.eos_token_id]
        params = SamplingParams(max_new_tokens=16, temperature=0.7, seed=3, stop_strings=("=",))
        out = engine.generate(prompts, 3, params)
        assert [len(g) for g in out] == [3, 3, 3] and all(c.prompt_ids == p for p, g in zip(prompts, out) for c in g)
        batch, lp = _trainer_logprobs(model, _flat(out), tokenizer.pad_token_id, 0.7)
        verify_weight_sync(batch.engine_logprobs, lp, batch.response_mask, max_abs_diff=TOL)

        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        engine.sync_weights(ModelWeights(model))
        flat = _flat(engine.generate(prompts, 3, params))
        batch, lp = _trainer_logprobs(model, flat, tokenizer.pad_token_id, 0.7)
        verify_weight_sync(batch.engine_logprobs, lp, batch.response_mask, max_abs_diff=TOL)
        with pytest.raises(EngineDied, match="failed while generating: .*top_k=0 and top_p=1"):  # errors come back
            engine.generate(prompts, 1, SamplingParams(max_new_tokens=4, top_k=3))
        assert _children() - before
        server = engine.pid
        assert len(group_members(server)) > 1, "the server leads its own group, its engine processes in it"
        os.kill(server, signal.SIGSTOP)
        started = time.monotonic()
        engine.close(timeout=5)
        assert time.monotonic() - started < 10
        assert wait_until_gone(lambda: group_members(server)) == set(), "no engine process outlives a killed server"
    finally:
        engine.close()
    deadline = time.monotonic() + 10
    while _children() - before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _children() - before == set()


_KILLED_TRAINER = """
import os, sys
sys.path.insert(0, sys.argv[3])
from conftest import descendants
from grpolab.rollout.vllm.apart import vllm_process
engine = vllm_process(sys.argv[1], python=sys.argv[2], dtype="float32", max_model_len=256, kv_cache_bytes=64 << 20)
print("engine processes", *descendants(), flush=True)
os.kill(os.getpid(), 9)
"""


@pytest.mark.slow
def test_a_killed_trainer_takes_the_engine_server_and_its_processes_with_it(model_dir):
    """kill -9 of the trainer: its vLLM server notices within a second and ends its engine's processes too."""
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_TRAINER, str(model_dir), _vllm_python(), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    engine = {
        int(p) for p in next(ln for ln in proc.stdout.splitlines() if ln.startswith("engine processes")).split()[2:]
    }
    assert len(engine) > 1, "the server and its engine-core process"
    assert wait_until_gone(lambda: engine & live_processes().keys()) == set()
