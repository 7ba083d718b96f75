"""Tool observations never enter the loss: no gradient, no sync check, no entropy metric.

A batch of tiny-model trajectories with observation spans is fed to every preset's update. The
gradient is the same whether or not the log-probs at observation positions (trainer's, old,
reference, engine) are perturbed; an entropy metric is the float64 mean over policy tokens only;
the sync check counts policy tokens only.
"""

from __future__ import annotations

import pytest
import torch

from grpolab.learning.batching import collate
from grpolab.learning.update import StepContext, UpdateData, UpdateSchedule, accumulate_gradients
from grpolab.models.logprobs import token_logprobs
from grpolab.objectives.losses import step_denominators
from grpolab.objectives.presets import PRESETS
from grpolab.rollout.base import Completion
from grpolab.rollout.sync_check import logprob_diff


def _trajectories(vocab: int) -> list[Completion]:
    """Four rows: two with observation spans (one of them two spans), one single-turn, one tool-only prefix."""
    g = torch.Generator().manual_seed(0)
    masks = [[1, 1, 1, 0, 0, 0, 1, 1, 1], [1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1], [1] * 6, [1, 0, 0, 1, 1]]
    out = []
    for i, mask in enumerate(masks):
        prompt = torch.randint(3, vocab, (3 + i,), generator=g).tolist()
        ids = torch.randint(3, vocab, (len(mask),), generator=g).tolist()
        logprobs = [-float(x) if m else 0.0 for x, m in zip(torch.rand(len(mask), generator=g) + 0.1, mask)]
        out.append(Completion(prompt, ids, logprobs, "stop", "", policy_mask=None if all(mask) else mask))
    return out


def _observation_positions(batch) -> torch.Tensor:
    """Bool [N, T]: completion columns whose policy mask is 0."""
    cols = torch.arange(batch.input_ids.shape[1])
    in_completion = (cols >= batch.prompt_lens[:, None]) & (cols < (batch.prompt_lens + batch.completion_lens)[:, None])
    return in_completion & (batch.response_mask == 0)


def test_collate_masks_exactly_the_observation_tokens(tokenizer):
    completions = _trajectories(len(tokenizer))
    batch = collate(completions, tokenizer.pad_token_id)
    for row, c in enumerate(completions):
        p = len(c.prompt_ids)
        assert batch.response_mask[row, p : p + len(c.completion_ids)].tolist() == c.mask
        assert (
            batch.response_mask[row, :p].sum() == 0 and batch.response_mask[row, p + len(c.completion_ids) :].sum() == 0
        )
        assert batch.attention_mask[row].sum() == p + len(c.completion_ids)  # observations are context
    obs = _observation_positions(batch)
    assert int(obs.sum()) == 3 + 5 + 0 + 2 and (batch.engine_logprobs[obs] == 0).all()
    assert batch.num_response_tokens == sum(c.num_policy_tokens for c in completions) == 21
    counts = batch.token_counts()
    assert counts == {
        "tokens/policy": 21,
        "tokens/masked_observation": 10,
        "tokens/masked_prompt": sum(len(c.prompt_ids) for c in completions),
        "tokens/masked_padding": batch.input_ids.numel() - 31 - counts["tokens/masked_prompt"],
    }


def _gradients(model, batch, spec, perturb: bool):
    """Model gradients and token metrics of one optimizer step over ``batch``; with ``perturb`` every
    log-prob at observation positions (trainer's, old, reference, engine) is changed."""
    obs = _observation_positions(batch)
    assert int(obs.sum()) == 10  # collate left the observations out of the response mask
    with torch.no_grad():
        frozen = token_logprobs(model, batch.input_ids, batch.attention_mask).logprobs
    old, ref, engine, teacher = frozen.clone(), frozen - 0.05, batch.engine_logprobs.clone(), frozen - 0.3
    if perturb:
        old, ref, engine, teacher = (torch.where(obs, t + 3.0, t) for t in (old, ref, engine, teacher))
    data = UpdateData(
        advantages=torch.tensor([1.0, -0.5, 0.7, -1.2]),
        response_mask=batch.response_mask,
        old_logprobs=old,
        ref_logprobs=ref,
        engine_logprobs=engine,
        teacher_logprobs=teacher,  # read by on-policy distillation only
    )

    def policy_logprobs(idx):
        stats = token_logprobs(model, batch.input_ids[idx], batch.attention_mask[idx], with_entropy=True)
        lp, entropy = stats.logprobs, stats.entropy
        if perturb:  # any weight on these positions would scale or shift the gradient
            lp, entropy = torch.where(obs[idx], lp * 5 + 2, lp), torch.where(obs[idx], entropy + 9, entropy)
        return lp, entropy

    model.zero_grad(set_to_none=True)
    schedule = UpdateSchedule(micro_batch_size=2, max_new_tokens=12)
    step = accumulate_gradients(StepContext(spec, data, torch.arange(4), schedule), policy_logprobs)
    return [p.grad.clone() for p in model.parameters()], step.metrics.means()


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_observation_log_probs_never_reach_the_gradient(make_tiny_model, tokenizer, name):
    masks = {"rollout_correction": "token_mask", "rollout_correction_lower": 0.5, "off_policy_mask_delta": 0.0}
    spec = PRESETS[name].override(**({"beta": 0.04, **masks} if name == "grpo" else {}))
    model = make_tiny_model("llama")
    batch = collate(_trajectories(len(tokenizer)), tokenizer.pad_token_id)
    clean, clean_metrics = _gradients(model, batch, spec, perturb=False)
    perturbed, perturbed_metrics = _gradients(model, batch, spec, perturb=True)
    assert any(g.abs().sum() > 0 for g in clean)
    for a, b in zip(clean, perturbed):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert clean_metrics == perturbed_metrics
    assert clean_metrics["metric_tokens"] == 21
    advantages = torch.tensor([1.0, -0.5, 0.7, -1.2])  # _gradients' (none is 0: every row is in the step)
    assert step_denominators(spec, batch.response_mask, 12, advantages=advantages).kl == 21  # the policy's tokens


def test_entropy_metric_is_the_mean_over_policy_tokens(make_tiny_model, tokenizer):
    model = make_tiny_model("llama")
    batch = collate(_trajectories(len(tokenizer)), tokenizer.pad_token_id)
    _, metrics = _gradients(model, batch, PRESETS["grpo"], perturb=True)
    with torch.no_grad():
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.double()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)  # predicts column t + 1
    entropy = -(logp.exp() * logp).sum(-1)
    policy = batch.response_mask[:, 1:].bool()
    assert metrics["entropy"] == pytest.approx(float(entropy[policy].mean()), rel=1e-5)


def test_sync_check_ignores_observation_positions(tokenizer):
    completions = _trajectories(len(tokenizer))
    batch = collate(completions, tokenizer.pad_token_id)
    trainer = batch.engine_logprobs + 1e-4 * batch.response_mask
    obs = _observation_positions(batch)
    clean = logprob_diff(batch.engine_logprobs, trainer, batch.response_mask)
    noisy = logprob_diff(batch.engine_logprobs, torch.where(obs, trainer - 7.0, trainer), batch.response_mask)
    assert clean == noisy and clean.num_tokens == 21
    assert clean.max_abs_diff == pytest.approx(1e-4, rel=1e-3)
    # the completions themselves, as the check also takes them: observation log-probs are 0, not compared
    assert logprob_diff(completions, trainer, batch.response_mask).num_tokens == 21
