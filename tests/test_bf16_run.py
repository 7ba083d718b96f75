"""A bf16 run on a CPU with native bf16: float32 masters, the hf engine on its own bf16 copy refreshed by each sync."""

from __future__ import annotations

import pytest
import torch
from conftest import quick_config
from rich.console import Console

from grpolab.common.provenance import native_bf16
from grpolab.rollout.hf import decode as decode_module
from grpolab.run.trainer import Trainer

pytestmark = pytest.mark.skipif(not native_bf16(), reason="needs a CPU with native bf16 (AVX512-BF16 or AMX-BF16)")


def test_a_bf16_run_trains_with_the_engine_on_its_bf16_copy_refreshed_at_each_sync(
    warm_model_dir, tmp_path, monkeypatch
):
    sampled = []
    sample_step = decode_module.sample_step

    def recording(logits, uniform, temperature, top_k=0, top_p=1.0):
        tokens, logprobs = sample_step(logits, uniform, temperature, top_k, top_p)
        sampled.append((logits.dtype, logprobs.dtype))
        return tokens, logprobs

    monkeypatch.setattr(decode_module, "sample_step", recording)
    cfg = quick_config(warm_model_dir, tmp_path / "run", **{"model.dtype": "bfloat16", "steps": 3, "eval.every": 100})
    trainer = Trainer(cfg, Console(quiet=True))
    try:
        parts = trainer.parts
        engine, master = parts.engine, parts.model
        assert parts.precision.storage == torch.float32 and parts.precision.compute == torch.bfloat16
        copy = engine.copy
        assert copy is not None and copy.source is master
        linear = copy.model.lm_head.weight
        assert linear.dtype == torch.bfloat16 and master.lm_head.weight.dtype == torch.float32
        previous = [t.clone() for t, _ in copy.pairs()]
        for step in (1, 2, 3):
            record = trainer.train_step(step)
            assert record["total_actual_updates"] == step  # it trained
            assert copy.refreshes == step  # one refresh per sync, none per decoding step
            now = [t.clone() for t, _ in copy.pairs()]
            # right after the sync: the bf16 cast of the master's new weights, not the previous step's
            assert all(torch.equal(mine, theirs.detach().to(mine.dtype)) for mine, theirs in copy.pairs())
            assert any(not torch.equal(a, b) for a, b in zip(previous, now) if a.dtype == torch.bfloat16)
            previous = now
            # the sync check compared the engine's log-probs with the trainer's, and passed
            assert 0 < record["sync/logprob_diff_mean"] and record["sync/margin"] < 1
    finally:
        trainer.close()
    assert sampled and set(sampled) == {(torch.float32, torch.float32)}  # log-prob math in float32
