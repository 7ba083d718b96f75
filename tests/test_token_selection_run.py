"""The adaptive entropy coefficient through real runs of the tiny model: logged every step, in every checkpoint,
and a stopped and resumed run applies the same coefficients (and Clip-Cov draws the same tokens) as an
uninterrupted one. The math: tests/test_token_selection.py."""

from __future__ import annotations

import pytest
import torch
from conftest import quick_config, run_numbers, train_until

from grpolab.config import load_run_config
from grpolab.run.rundir import read_metrics
from grpolab.run.state import STATE_FILE
from grpolab.run.trainer import Trainer, train


def test_a_run_logs_the_adaptive_coefficient_every_step_and_checkpoints_it(warm_model_dir, tmp_path):
    run = tmp_path / "run"
    settings = {"use_adaptive_entropy": True, "entropy_target": 100.0, "entropy_coef_delta": 0.01}
    train(quick_config(warm_model_dir, run, **{f"algorithm.{k}": v for k, v in settings.items()}))
    records = [r for r in read_metrics(run / "metrics.jsonl") if "entropy_coef" in r]
    assert [r["entropy_coef"] for r in records] == pytest.approx([0.0, 0.01])  # c_1 = 0.01 once e_0 <= target
    state = torch.load(run / "checkpoints" / "step_000002" / STATE_FILE, weights_only=False)
    assert state["entropy_control"]["coef"] == pytest.approx(0.02) and state["entropy_control"]["last_entropy"] < 100


@pytest.mark.slow  # two runs of the tiny model; default tier: ..._follows_skywork_or1_and_resumes_exactly (the
# controller's save and load, tests/test_token_selection.py) and ..._logs_the_adaptive_coefficient_every_step_and_checkpoints_it (the checkpoint)
def test_a_resumed_run_applies_the_same_adaptive_coefficients(warm_model_dir, tmp_path):
    settings = {
        "steps": 4,
        "checkpoint.every": 2,
        "algorithm.use_adaptive_entropy": True,
        "algorithm.entropy_target": 100.0,
        "algorithm.entropy_coef_delta": 0.01,
        "algorithm.cov_selection": "clip_cov",  # its draws on the run's generator resume too
        "algorithm.clip_cov_ratio": 0.05,
        "algorithm.clip_cov_lb": 0.0,
        "algorithm.steps_per_epoch": 2,
    }
    train(quick_config(warm_model_dir, tmp_path / "full", **settings))
    train_until(quick_config(warm_model_dir, tmp_path / "cut", **settings), stop_at=4)
    train(load_run_config(tmp_path / "cut"), resume=True)
    full = run_numbers(tmp_path / "full")
    assert run_numbers(tmp_path / "cut") == full
    assert [r["entropy_coef"] for r in full if "entropy_coef" in r] == pytest.approx(
        [0.01, 0.03, 0.05, 0.07]
    )  # the last of 2 steps
    assert any(0 < r.get("token_keep_frac", 1) < 1 for r in full)


@pytest.mark.slow  # two runs; default tier: test_token_selection.py::..._for_any_micro_batch_split (the same claim
# on a toy policy in float64, against the reference)
def test_the_real_model_learns_the_same_whatever_the_micro_batches(warm_model_dir, tmp_path):
    """The trainer's path (planned micro-batches, shared prompts) with the 80/20 selection and the entropy bonus
    over the step: micro-batches of 16 rows sharing prompts or of ~300 tokens each without, the same parameters
    and selection. (Not KL-Cov: at a rollout batch's first step its |logp - logp_old| is float32 noise whose sign
    the layout decides; docs/algorithms.md.)"""
    common = {"algorithm.name": "dapo_8020", "algorithm.entropy_coef": 0.01, "steps": 2, "eval.every": 100}
    results = []
    for i, split in enumerate(
        ({"optim.shared_prompts": True}, {"optim.shared_prompts": False, "optim.micro_batch_tokens": 300})
    ):
        trainer = Trainer(quick_config(warm_model_dir, tmp_path / str(i), **common, **split))
        try:
            records = [trainer.train_step(step) for step in (1, 2)]
            results.append((records, [p.detach().clone() for p in trainer.parts.model.parameters()]))
        finally:
            trainer.close()
    (records_a, params_a), (records_b, params_b) = results
    # float32 summation order only: AdamW moves an element whose gradient is rounding noise by up to ~lr (1e-3)
    # (test_shared_prefix.py); a token selected differently would move most weights by ~lr
    diff = torch.cat([(a - b).abs().flatten() for a, b in zip(params_a, params_b)])
    assert float((diff > 5e-5).double().mean()) < 1e-3 and float(diff.max()) < 1e-3
    for ra, rb in zip(records_a, records_b):
        assert ra["actual_updates"] == rb["actual_updates"] > 0
        assert ra["token_keep_frac"] == pytest.approx(rb["token_keep_frac"], abs=1e-9) and 0 < ra["token_keep_frac"] < 1
        assert ra["bonus_entropy"] == pytest.approx(rb["bonus_entropy"], rel=1e-5)
