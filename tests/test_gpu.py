"""GPU-only checks (skipped without CUDA; ``benchmarks/gpu_check.py`` runs them on the GPU machine)."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import params_of, quick_config, same
from rich.console import Console
from test_edges import IndexDevices

from grpolab.run.trainer import Trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("algo", ["grpo", "rft", "offpolicy_clip", "dapo"])
def test_update_on_cuda_never_mixes_devices(algo, warm_model_dir, tmp_path):
    trainer = Trainer(
        quick_config(warm_model_dir, tmp_path / "run", algo=algo, **{"model.device": "cuda"}), Console(quiet=True)
    )
    rollout = trainer.parts.collector.collect(1)
    before = params_of(trainer.parts.model)
    with IndexDevices() as recorder:
        result = trainer.parts.learner.learn(rollout)
    trainer.close()
    assert recorder.pairs and all(source == index for source, index in recorder.pairs), recorder.pairs
    assert result["actual_updates"] == 0 or not same(before, params_of(trainer.parts.model))


@pytest.mark.parametrize("precision", ["fp32_master", "bf16_compensated"])
def test_bf16_rl_steps_on_cuda_with_the_sync_check(precision, warm_model_dir, tmp_path):
    cfg = quick_config(
        warm_model_dir,
        tmp_path / "run",
        **{"model.device": "cuda", "model.dtype": "bfloat16", "optim.precision": precision, "rollout.sync_check": True},
    )
    trainer = Trainer(cfg, Console(quiet=True))
    before = params_of(trainer.parts.model)
    records = [trainer.train_step(step) for step in (1, 2)]
    trainer.close()
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    assert records[0]["first_update/ratio_mean"] == pytest.approx(1.0, abs=1e-2) and not same(
        before, params_of(trainer.parts.model)
    )
    assert records[0]["sync/noise_floor_mean"] < 0.05


@pytest.mark.parametrize("autocast", [False, True])
def test_shared_prompts_on_cuda_match_the_previous_path(make_tiny_model, autocast):
    """The shared-prompt forward on CUDA: float32 within 1e-5 of token_logprobs, bf16 autocast within its noise."""
    from test_shared_prefix import _batch

    from grpolab.learning.packing import MicroBatchPlanner, prompt_keys
    from grpolab.learning.shared_prefix import layout_units, unit_logprobs
    from grpolab.models.logprobs import token_logprobs

    model = make_tiny_model("qwen3").cuda()
    ids, mask, response, plens, slens = (t.cuda() if torch.is_tensor(t) else t for t in _batch(model.config.vocab_size))
    units = MicroBatchPlanner(prompt_keys(ids, torch.tensor(plens)), plens, slens, share=True, max_sequences=64).units(
        list(range(len(ids)))
    )
    order = torch.tensor([r for u in units for r in u], device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        before = token_logprobs(model, ids, mask).logprobs[order] * response[order]
        shared = unit_logprobs(model, layout_units(ids, plens, slens, units, True), len(ids), ids.shape[1]).logprobs
    assert (shared - before).abs().max() <= (5e-2 if autocast else 1e-5)
