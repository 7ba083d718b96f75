"""verl's and prime-rl's losses (GMPO, GPG, DPPO, prime-rl's default) against their papers' float64 references
(tests/reference.py), against the peers' own functions run standalone on the same inputs (verl and prime-rl
cannot be imported here: their few torch lines are transcribed below, each naming its source), and their
settings' refusals."""

from __future__ import annotations

import pytest
import torch
from reference import reference_advantages, reference_loss
from test_distributed import assert_single_process_update, updates
from test_losses import MAX_NEW, impl_loss_and_grad, make_batch, ref_loss_and_grad
from test_update import ToyPolicy, make_data, step_grad
from threaded_ranks import run_as_threads

from grpolab.config import ConfigError, validate_config
from grpolab.learning.learner import PolicyLearner
from grpolab.objectives.advantages import valid_sample_scale
from grpolab.objectives.losses import PolicyLossInput, policy_loss, step_denominators
from grpolab.objectives.presets import PRESETS
from grpolab.parallel.ranks import Ranks
from grpolab.rollout.collect import RolloutBatch
from grpolab.tasks.base import Grade


def _reference_matches(spec, seed, spread):
    logp, old, adv, mask, ref = make_batch(seed, spread=spread)
    loss, grad, metrics = impl_loss_and_grad(spec, logp, old, adv, mask, ref)
    want, want_grad = ref_loss_and_grad(spec, logp, old, adv, mask, ref)
    torch.testing.assert_close(loss, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)
    return metrics.means(), (logp, old, adv, mask)


# --- GMPO ---------------------------------------------------------------------------------------------------


def test_gmpo_clips_both_sides_in_log_space_as_the_paper():
    """A spread wide enough that the log-space clip cuts tokens of both advantage signs."""
    seen_low = seen_high = 0.0
    for seed in range(4):
        m, _ = _reference_matches(PRESETS["gmpo"], seed, spread=0.7)
        seen_low, seen_high = seen_low + m["clip_low_frac"], seen_high + m["clip_high_frac"]
    assert seen_low > 0 and seen_high > 0


def test_gmpo_is_not_the_arithmetic_mean_of_clipped_ratios():
    """The geometric mean differs from GRPO's token mean on the same batch (the test could fail)."""
    logp, old, adv, mask, _ = make_batch(5, spread=0.3)
    gmpo, _, _ = impl_loss_and_grad(PRESETS["gmpo"], logp, old, adv, mask)
    grpo_wide, _, _ = impl_loss_and_grad(PRESETS["grpo"].override(eps_low=0.33, eps_high=0.49), logp, old, adv, mask)
    assert abs(float(gmpo) - float(grpo_wide)) > 1e-4


def test_gmpo_on_a_single_update_has_grpos_gradient():
    """At ratio 1 (one optimizer step per batch) d(A exp(mean_t l_t)) = A mean_t dlogp: GRPO's sequence mean."""
    logp, _, adv, mask, _ = make_batch(11)
    _, gmpo, _ = impl_loss_and_grad(PRESETS["gmpo"], logp, logp.clone(), adv, mask)
    _, grpo, _ = impl_loss_and_grad(PRESETS["grpo"], logp, logp.clone(), adv, mask)
    torch.testing.assert_close(gmpo, grpo, rtol=1e-12, atol=1e-15)


def verl_geo_mean(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high):
    """verl's compute_policy_loss_geo_mean (verl/trainer/ppo/core_algos.py, volcengine/verl b178a3c): the loss
    lines, config read as arguments; advantages [bs, T] (verl's token-level advantages)."""
    negative_approx_kl = log_prob - old_log_prob
    sgn_advantage = torch.sign(advantages)
    negative_approx_kl_clamp = torch.clamp(negative_approx_kl, -clip_low, clip_high)
    negative_approx_kl_min = torch.min(sgn_advantage * negative_approx_kl, sgn_advantage * negative_approx_kl_clamp)
    negative_approx_kl_min = sgn_advantage * negative_approx_kl_min
    response_mask_sum = response_mask.sum(dim=-1)
    ratio = torch.exp((negative_approx_kl_min * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8))
    advantage = (advantages * response_mask).sum(dim=-1) / (response_mask_sum + 1e-8)
    return torch.mean(-advantage * ratio)


def test_gmpo_matches_verl_geo_mean():
    """Same numbers as verl's geo_mean up to its 1e-8 in the denominators (verl: a mean over the micro-batch's
    sequences; grpolab: over the step's, exact under micro-batching)."""
    spec = PRESETS["gmpo"]
    logp, old, adv, mask, _ = make_batch(6, spread=0.6)
    loss, grad, _ = impl_loss_and_grad(spec, logp, old, adv, mask)
    leaf = logp.clone().requires_grad_(True)
    theirs = verl_geo_mean(old, leaf, adv[:, None] * mask, mask, spec.eps_low, spec.eps_high)
    theirs.backward()
    torch.testing.assert_close(loss, theirs.detach(), rtol=1e-7, atol=1e-10)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-7, atol=1e-10)


# --- DPPO and prime-rl's default loss -----------------------------------------------------------------------


def test_dppo_masks_and_truncates_as_the_paper():
    """A cap low enough to truncate some kept tokens; both masks fire on these batches."""
    spec = PRESETS["dppo"].override(ratio_cap=1.3)
    truncated = masked_low = masked_high = 0
    for seed in range(4):
        m, (logp, old, adv, mask) = _reference_matches(spec, seed, spread=0.5)
        masked_low, masked_high = masked_low + m["clip_low_frac"], masked_high + m["clip_high_frac"]
        truncated += int(((torch.exp(logp - old) > 1.3) & mask.bool() & (adv[:, None] != 0)).sum())
    assert truncated > 0 and masked_low > 0 and masked_high > 0


def test_dppo_masks_by_probability_change_not_by_ratio():
    """A rare token may double (ratio 2, far outside PPO's clip) and stay; a likely one moving 0.25 is masked."""
    logp = torch.log(torch.tensor([[0.02, 0.70]], dtype=torch.float64))
    old = torch.log(torch.tensor([[0.01, 0.45]], dtype=torch.float64))
    mask, adv = torch.ones(1, 2, dtype=torch.float64), torch.tensor([1.0], dtype=torch.float64)
    _, grad, metrics = impl_loss_and_grad(PRESETS["prime_rl"].override(kl_tau=0.0), logp, old, adv, mask)
    assert grad[0, 0] == pytest.approx(-2.0 / 2) and grad[0, 1] == 0.0  # d(-r A)/dlogp = -r A, token mean
    assert metrics.means()["clip_high_frac"] == 0.5


def verl_dppo_tv(old_log_prob, log_prob, advantages, response_mask, clip_low, clip_high, clip_ratio_c):
    """verl's compute_policy_loss_dppo_tv (verl/trainer/ppo/core_algos.py, verl-project/verl 2026): the loss
    lines with loss_agg_mode token-mean; advantages [bs, T]."""
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    truncated_ratio = torch.clamp(ratio, max=clip_ratio_c).detach()
    prob, old_prob = torch.exp(log_prob), torch.exp(old_log_prob)
    valid_positive_mask = (prob - old_prob) <= clip_high
    valid_negative_mask = (prob - old_prob) >= -clip_low
    valid_mask = torch.where(advantages > 0, valid_positive_mask, valid_negative_mask).detach().float()
    pg_losses = -advantages * truncated_ratio * log_prob * valid_mask
    return (pg_losses * response_mask).sum() / response_mask.sum()


def test_dppo_has_verl_dppo_tv_gradient_but_not_its_value():
    """verl writes the truncated ratio as sg(min(r, C)) * log p: the paper's gradient, another value."""
    spec = PRESETS["dppo"].override(ratio_cap=1.3)
    logp, old, adv, mask, _ = make_batch(7, spread=0.5)
    loss, grad, _ = impl_loss_and_grad(spec, logp, old, adv, mask)
    leaf = logp.clone().requires_grad_(True)
    theirs = verl_dppo_tv(old, leaf, adv[:, None].expand_as(mask), mask, spec.eps_low, spec.eps_high, 1.3)
    theirs.backward()
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-10, atol=1e-13)
    assert abs(float(loss) - float(theirs.detach())) > 1e-3


def prime_rl_default_loss(trainer_logprobs, inference_logprobs, advantages, loss_mask, mask_low, mask_high, kl_tau):
    """prime-rl's default_loss_fn (src/prime_rl/trainer/rl/loss.py, PrimeIntellect-ai/prime-rl 559b447) for one
    sample [seq], adv_tau 1: the per-sample sum that compute_loss divides by the step's token count."""
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    invalid = torch.where(advantages > 0, probs_diff > mask_high, probs_diff < -mask_low)
    keep_mask = loss_mask & ~invalid
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    return (-pg_loss + kl_tau * kl_loss).sum()


@pytest.mark.parametrize("kl_tau", [1e-3, 0.5])
def test_prime_rl_matches_prime_rl_default_loss(kl_tau):
    """pi_old plays prime-rl's inference log-probs (docs/algorithms.md: where they differ); the zero-advantage
    sequence is not in prime-rl's step (its orchestrator's filter_zero_advantages, on by default)."""
    spec = PRESETS["prime_rl"].override(kl_tau=kl_tau)
    logp, old, adv, mask, _ = make_batch(8, spread=0.5)
    _reference_matches(spec, 8, spread=0.5)
    loss, grad, metrics = impl_loss_and_grad(spec, logp, old, adv, mask)
    leaf = logp.clone().requires_grad_(True)
    shipped = [i for i in range(mask.shape[0]) if adv[i] != 0]
    assert len(shipped) == mask.shape[0] - 1
    theirs = (
        sum(
            prime_rl_default_loss(
                leaf[i], old[i], adv[i].expand(mask.shape[1]), mask[i].bool(), spec.eps_low, spec.eps_high, kl_tau
            )
            for i in shipped
        )
        / mask[shipped].sum()
    )
    theirs.backward()
    torch.testing.assert_close(loss, theirs.detach(), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-10, atol=1e-13)
    assert metrics.means()["log_ratio_sq"] > 0 and metrics.means()["clip_frac"] > 0


def test_kl_tau_reaches_zero_advantage_rows_unless_they_leave_the_step():
    logp, old, adv, mask, _ = make_batch(9, spread=0.3)
    kept = PRESETS["prime_rl"].override(filter_zero_advantages=False)
    _, without, _ = impl_loss_and_grad(kept.override(kl_tau=0.0), logp, old, adv, mask)
    _, with_tau, _ = impl_loss_and_grad(kept, logp, old, adv, mask)
    _, filtered, _ = impl_loss_and_grad(PRESETS["prime_rl"], logp, old, adv, mask)
    assert adv[0] == 0 and (without[0] == 0).all() and (with_tau[0] != 0).any() and (filtered[0] == 0).all()
    _reference_matches(kept, 9, spread=0.3)
    _reference_matches(PRESETS["grpo"].override(filter_zero_advantages=True, beta=0.1), 9, spread=0.3)


@pytest.mark.parametrize("single_update", [True, False])
@pytest.mark.parametrize("filtered", [True, False])
def test_kl_tau_row_pruning_is_exact(single_update, filtered):
    """Zero-advantage rows are pruned where kl_tau cannot reach them: with one optimizer step (the old
    log-probs are the update's own, log-ratio exactly 0) or when they leave the step; else all are fed."""
    spec = PRESETS["prime_rl"].override(filter_zero_advantages=filtered)
    policy = ToyPolicy(12, 9, seed=2)
    data = make_data(policy, 2, groups=3, group_size=4, spec=spec, zero_groups=(0, 2))
    if single_update:
        data.old_logprobs = None
    policy.calls.clear()
    pruned, _ = step_grad(spec, data, policy, micro=2)
    fed = sorted(i for call in policy.calls for i in call)
    unpruned, _ = step_grad(spec.override(prune_zero_advantage=False), data, policy, micro=2)
    torch.testing.assert_close(pruned, unpruned, rtol=1e-12, atol=1e-15)
    if single_update or filtered:
        assert fed == torch.nonzero(data.advantages).flatten().tolist() and len(fed) < 12
    else:
        assert fed == list(range(12))


# --- GPG ----------------------------------------------------------------------------------------------------


REWARDS = [[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 1.0, 1.0]]


def test_gpg_alpha_is_the_papers_and_not_verls_count_of_nonzero_rewards():
    rewards = torch.tensor(REWARDS, dtype=torch.float64)
    alpha = float(valid_sample_scale(rewards))
    assert alpha == 2.0  # 16 samples, 8 of them in groups whose rewards differ
    want = reference_advantages(REWARDS, "mean", "none", valid_rescale=True)
    plain = reference_advantages(REWARDS, "mean", "none")
    assert want == [[alpha * a for a in group] for group in plain]
    # verl's compute_gpg_outcome_advantage: alpha = bsz / count_nonzero(scores), the samples with a reward
    assert rewards.numel() / int(torch.count_nonzero(rewards)) == pytest.approx(16 / 8)  # equal here by chance
    other = torch.tensor([[1.0, 1.0], [1.0, 0.0]], dtype=torch.float64)
    assert float(valid_sample_scale(other)) == 2.0 and other.numel() / int(torch.count_nonzero(other)) == 4 / 3
    assert float(valid_sample_scale(torch.zeros(2, 3))) == 1.0  # nothing to learn: no division by 0


def test_the_learner_rescales_gpgs_advantages_over_the_whole_batch():
    """PolicyLearner.advantages (run on a bare stand-in for the learner's state: it reads only ``spec``)."""
    grades = [[Grade(format_reward=1.0, answer_reward=r) for r in group] for group in REWARDS]
    rollout = RolloutBatch(examples=[], completions=[[] for _ in grades], grades=grades)

    class State:
        spec = PRESETS["gpg"]

    _, got, _ = PolicyLearner.advantages(State(), rollout)
    want = torch.tensor(reference_advantages(REWARDS, "mean", "none", valid_rescale=True), dtype=got.dtype)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    State.spec = PRESETS["gpg"].override(valid_rescale=False)
    assert torch.equal(PolicyLearner.advantages(State(), rollout)[1] * 2, got)


# --- every new preset: data parallel, refusals, listing ---------------------------------------------------------


@pytest.mark.parametrize(
    "name, overrides", [("gmpo", {"steps_per_epoch": 4}), ("prime_rl", {"steps_per_epoch": 4}), ("dppo", {})]
)
def test_two_ranks_make_the_single_process_update(name, overrides):
    ranked = run_as_threads(2, lambda rank: updates(name, Ranks.current(), **overrides))
    assert_single_process_update(ranked, name, overrides)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"name": "grpo", "ratio_cap": 5.0}, "ratio_cap 5 is read by weight dppo only; weight clip does not read it"),
        ({"name": "dppo", "eps_high": 1.5}, "never masks"),
        ({"name": "gpg", "baseline": "none"}, "valid_rescale (GPG's B / B_valid) needs baseline 'mean'"),
        ({"name": "dppo", "ratio_cap": 0.5}, "ratio_cap"),
        ({"name": "prime_rl", "kl_tau": -1.0}, "kl_tau"),
    ],
)
def test_bad_combinations_are_refused_in_one_line(fields, needle):
    with pytest.raises(ConfigError) as err:
        validate_config({"algorithm": fields})
    message = str(err.value)
    assert "\n" not in message and needle in message and "algorithm" in message


def test_each_new_preset_has_its_formula():
    assert "exp(mean_t sgn(A)" in PRESETS["gmpo"].formula()
    assert PRESETS["gpg"].formula().endswith("A *= B / B_valid")
    assert "p-p_old > eps_high" in PRESETS["dppo"].formula() and "w truncated at 20" in PRESETS["dppo"].formula()
    assert "+ 0.001 * mean_t (log w)^2" in PRESETS["prime_rl"].formula()


def test_kl_tau_term_is_a_per_token_mean_over_the_step():
    """Split into two micro-batches, each divides by the step's tokens: the parts add up to the whole."""
    spec = PRESETS["prime_rl"].override(kl_tau=0.7)
    logp, old, adv, mask, _ = make_batch(10, spread=0.3)
    den = step_denominators(spec, mask, MAX_NEW, advantages=adv)
    assert den.kl == mask[adv != 0].sum() < mask.sum()  # the zero-advantage row is not in the step
    whole, _ = policy_loss(PolicyLossInput(logp, old, adv, mask), spec, den)
    parts = sum(
        policy_loss(PolicyLossInput(logp[s], old[s], adv[s], mask[s]), spec, den)[0]
        for s in (slice(0, 3), slice(3, None))
    )
    torch.testing.assert_close(parts, whole, rtol=1e-12, atol=1e-14)
    want = reference_loss(
        logp,
        old,
        adv,
        mask,
        weight="dppo",
        aggregation="token",
        max_new_tokens=MAX_NEW,
        kl_tau=0.7,
        filter_zero_advantages=True,
    )
    torch.testing.assert_close(whole, want, rtol=1e-10, atol=1e-12)
