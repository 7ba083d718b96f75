"""Token selection (80/20, Clip-Cov, KL-Cov) and the entropy bonus with Skywork-OR1's adaptive coefficient:
the whole optimizer step's gradient against the float64 references of tests/reference.py (loops over the whole
step), however the step is split into micro-batches; the adaptive coefficient's sequence and its resume; the
settings refused."""

from __future__ import annotations

import io

import pytest
import torch
from pydantic import ValidationError
from reference import reference_adaptive_coefficients, reference_quantile, reference_tokensel_loss
from test_update import ToyPolicy, make_data

from grpolab.learning.update import (
    StepContext,
    Trainee,
    UpdateHooks,
    UpdateSchedule,
    accumulate_gradients,
    run_update,
)
from grpolab.objectives.presets import PRESETS, get_algorithm
from grpolab.objectives.token_selection import AdaptiveEntropy, entropy_quantile_keep

N, T, MAX_NEW = 12, 9, 9

# each case: a preset with settings that make its selection bite on the toy batch (the papers' ratios of 2e-4 and
# 2e-3 of the tokens would pick one token of ~60), and the entropy bonus's coefficient
CASES = {
    "dapo_8020": (PRESETS["dapo_8020"], 0.0),
    "8020_sequence_rho_half": (PRESETS["grpo"].override(top_entropy_quantile=0.5), 0.0),
    "clip_cov": (PRESETS["clip_cov"].override(clip_cov_ratio=0.15, clip_cov_lb=0.0, clip_cov_ub=0.5), 0.0),
    "kl_cov": (PRESETS["kl_cov"].override(kl_cov_ratio=0.1, kl_cov_coef=0.7), 0.0),
    "entropy_bonus": (PRESETS["grpo"].override(entropy_coef=0.05), 0.05),
    "entropy_bonus_8020": (PRESETS["dapo_8020"].override(entropy_coef=0.03), 0.03),
}


def reference_grad(spec, data, policy, coef, seed):
    """d reference loss / d weight over the whole step (one forward of every row, loops)."""
    policy.weight.grad = None
    logp, entropy = policy(torch.arange(N))
    loss = reference_tokensel_loss(
        logp,
        data.old_logprobs,
        data.advantages,
        data.response_mask,
        entropy,
        spec=spec,
        max_new_tokens=MAX_NEW,
        entropy_coef=coef,
        generator=torch.Generator().manual_seed(seed),
    )
    loss.backward()
    return loss.detach(), policy.weight.grad.clone()


def ours(spec, data, policy, micro, coef, seed):
    policy.weight.grad = None
    step = accumulate_gradients(
        StepContext(
            spec,
            data,
            torch.randperm(N, generator=torch.Generator().manual_seed(99)),  # a shuffled step: order must not matter
            UpdateSchedule(micro, max_new_tokens=MAX_NEW, generator=torch.Generator().manual_seed(seed)),
            entropy_coef=coef if coef else None,
        ),
        policy,
    )
    return step.metrics.on_host(), policy.weight.grad.clone()


@pytest.mark.parametrize("case", list(CASES))
def test_the_step_gradient_matches_the_reference_for_any_micro_batch_split(case):
    spec, coef = CASES[case]
    policy = ToyPolicy(N, T, seed=11)
    data = make_data(policy, 11, groups=3, group_size=4, spec=spec)
    want_loss, want = reference_grad(spec, data, policy, coef, seed=5)
    for micro in (N, 1, 5):
        metrics, got = ours(spec, data, policy, micro, coef, seed=5)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
        assert metrics.loss == pytest.approx(float(want_loss), rel=1e-9, abs=1e-12)
    means = metrics.means()
    if spec.top_entropy_quantile < 1 or spec.cov_selection == "clip_cov":
        assert 0 < means["token_keep_frac"] < 1, "the selection drops some tokens and keeps some"
    if spec.cov_selection == "kl_cov":
        assert 0 < means["kl_cov_frac"] < 1
    # without the selection (and bonus) the gradient is another one: the test can fail
    plain = spec.override(top_entropy_quantile=1.0, cov_selection="none", entropy_coef=0.0, steps_per_epoch=2)
    _, base = ours(plain, data, policy, N, 0.0, seed=5)
    assert not torch.allclose(base, want, rtol=1e-4, atol=1e-8)


def test_the_quantile_threshold_is_the_linear_interpolation_and_ties_are_kept():
    values = torch.tensor([0.5, 0.1, 0.9, 0.3, 0.7, 0.3], dtype=torch.float64)
    threshold = reference_quantile(values.tolist(), 0.8)
    assert entropy_quantile_keep(values, 0.2).tolist() == [v >= threshold for v in values.tolist()]
    assert entropy_quantile_keep(torch.full((5,), 0.4, dtype=torch.float64), 0.2).all()  # all tied: all kept
    assert entropy_quantile_keep(values, 1.0).all()
    many = torch.rand(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for rho in (0.2, 0.37, 0.9):  # torch.quantile's threshold (ours sorts: no size limit)
        assert torch.equal(entropy_quantile_keep(many, rho), many >= torch.quantile(many, 1 - rho))


def test_clip_cov_draws_on_the_given_generator():
    """Same seed, same tokens; another seed, other tokens (the run's generator makes a resume exact)."""
    spec, _ = CASES["clip_cov"]
    policy = ToyPolicy(N, T, seed=12)
    data = make_data(policy, 12, groups=3, group_size=4, spec=spec)
    grads = {seed: ours(spec, data, policy, 4, 0.0, seed)[1] for seed in (1, 2)}
    torch.testing.assert_close(ours(spec, data, policy, 3, 0.0, 1)[1], grads[1], rtol=1e-10, atol=1e-13)
    assert not torch.allclose(grads[1], grads[2])
    # no generator given: the same draws every call, whatever torch's global generator did in between
    unseeded = []
    for _ in range(2):
        torch.rand(7)
        policy.weight.grad = None
        accumulate_gradients(StepContext(spec, data, torch.arange(N), UpdateSchedule(4, MAX_NEW)), policy)
        unseeded.append(policy.weight.grad.clone())
    torch.testing.assert_close(unseeded[0], unseeded[1], rtol=0, atol=0)


def test_kl_cov_penalises_zero_advantage_rows_so_they_are_fed():
    """A penalised token has a gradient at any advantage: its row is not pruned (pruning keeps the gradient)."""
    spec = PRESETS["kl_cov"].override(kl_cov_ratio=0.3)
    policy = ToyPolicy(N, T, seed=13)
    data = make_data(policy, 13, groups=3, group_size=4, spec=spec, zero_groups=(0,))
    policy.calls.clear()
    _, pruned = ours(spec, data, policy, 2, 0.0, 0)
    fed = {i for call in policy.calls for i in call}
    assert fed & {0, 1, 2, 3}, "some zero-advantage row carries a penalised token"
    _, unpruned = ours(spec.override(prune_zero_advantage=False), data, policy, 2, 0.0, 0)
    torch.testing.assert_close(pruned, unpruned, rtol=1e-10, atol=1e-13)


def adaptive_run(spec, batches, control, policy, opt):
    """One optimizer step per rollout batch; returns (applied coefficients, the steps' entropies measured here)."""
    applied, entropies = [], []
    for seed in batches:
        data = make_data(policy, seed, groups=3, group_size=4, spec=spec, zero_groups=())
        with torch.no_grad():
            _, h = policy(torch.arange(N))
        entropies.append(float((h * data.response_mask).sum() / data.response_mask.sum()))
        result = run_update(
            spec,
            data,
            Trainee(policy, opt, [policy.weight]),
            UpdateSchedule(micro_batch_size=5, max_new_tokens=MAX_NEW),
            UpdateHooks(entropy_control=control),
        )
        applied += result.entropy_coefs
        assert result.metrics()["entropy_coef"] == result.entropy_coefs[-1]  # logged every step
    return applied, entropies


ADAPTIVE = PRESETS["grpo"].override(
    use_adaptive_entropy=True, entropy_coef=0.0, entropy_coef_delta=0.4, entropy_coef_max=1.0
)


def test_the_adaptive_coefficient_follows_skywork_or1_and_resumes_exactly():
    policy = ToyPolicy(N, T, seed=14)
    with torch.no_grad():
        start = float(policy(torch.arange(N))[1].mean())
    spec = ADAPTIVE.override(entropy_target=start + 0.02)  # near the start: below, then pushed above by the bonus
    opt = torch.optim.SGD([policy.weight], lr=2.0)
    control = AdaptiveEntropy()
    applied, entropies = adaptive_run(spec, range(20, 26), control, policy, opt)
    want = reference_adaptive_coefficients(
        entropies, start=0.0, target=spec.entropy_target, delta=0.4, low=0.0, high=1.0
    )
    assert applied == pytest.approx(want, abs=1e-12)
    assert max(applied) > 0 and applied[0] == 0.0
    assert any(e > spec.entropy_target for e in entropies) and any(e <= spec.entropy_target for e in entropies)

    # stopped after 3 batches, the controller saved and loaded (as a checkpoint does): the same sequence
    policy2 = ToyPolicy(N, T, seed=14)
    opt2 = torch.optim.SGD([policy2.weight], lr=2.0)
    first = AdaptiveEntropy()
    head, _ = adaptive_run(spec, range(20, 23), first, policy2, opt2)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = AdaptiveEntropy()
    resumed.load_state_dict(torch.load(buffer))
    tail, _ = adaptive_run(spec, range(23, 26), resumed, policy2, opt2)
    assert head + tail == applied
    torch.testing.assert_close(policy2.weight, policy.weight, rtol=0, atol=0)


def test_a_checkpoint_without_the_coefficient_loads_as_no_step_yet():
    control = AdaptiveEntropy()
    control.observe(ADAPTIVE, 0.1)
    assert (control.coef, control.last_entropy) == (0.4, 0.1) and control.applied(ADAPTIVE) == 0.4
    old_checkpoint = AdaptiveEntropy()
    old_checkpoint.load_state_dict({})  # a checkpoint from before the field: no step yet
    assert old_checkpoint.applied(ADAPTIVE) == 0.0 and old_checkpoint.coef is None


def test_a_forward_without_entropies_is_refused_in_one_line():
    spec = PRESETS["dapo_8020"]
    policy = ToyPolicy(N, T, seed=15)
    data = make_data(policy, 15, groups=3, group_size=4, spec=spec)
    with pytest.raises(ValueError, match="needs the policy's entropies"):
        accumulate_gradients(
            StepContext(spec, data, torch.arange(N), UpdateSchedule(4, MAX_NEW)), lambda idx: (policy(idx)[0], None)
        )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"top_entropy_quantile": 0.2, "cov_selection": "kl_cov", "steps_per_epoch": 2}, "both select tokens"),
        ({"cov_selection": "clip_cov", "weight": "cispo"}, "use weight clip"),
        ({"cov_selection": "kl_cov", "weight": "gspo", "steps_per_epoch": 2}, "one ratio per sequence"),
        ({"cov_selection": "kl_cov"}, "single-update"),
        ({"cov_selection": "clip_cov", "clip_cov_lb": 5.0, "clip_cov_ub": 1.0}, "must be below"),
        ({"use_adaptive_entropy": True, "entropy_coef": 2.0}, "must lie in"),
        ({"top_entropy_quantile": 0.0}, "greater than 0"),
    ],
)
def test_bad_combinations_are_refused_in_one_line(overrides, message):
    with pytest.raises(ValidationError, match=message) as err:
        get_algorithm("grpo", **overrides)
    assert len(err.value.errors()) == 1


def test_the_new_presets_are_listed_with_their_formula(capsys):
    from grpolab.commands.cli import main

    assert main(["algorithms"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, term in [("dapo_8020", "quantile_(1-0.2)"), ("clip_cov", "random 0.0002"), ("kl_cov", "top 0.002")]:
        at = next(i for i, line in enumerate(lines) if line.startswith(name + " "))
        assert term in lines[at + 1], name  # the formula line under the preset's
    assert "- c_k (adaptive) * mean_t H" in ADAPTIVE.formula()


def test_a_bad_combination_on_the_command_line_is_one_error_line(capsys):
    from grpolab.commands.cli import main

    assert main(["config", "--algo", "grpo", "--algorithm.cov_selection", "kl_cov"]) == 2
    errors = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "set steps_per_epoch or epochs above 1" in errors[0]


# verl's Clip-Cov and KL-Cov (verl/trainer/ppo/core_algos.py at b178a3c, compute_policy_loss_clip_cov /
# compute_policy_loss_kl_cov), their torch lines transcribed (verl cannot be imported here): its config reads
# replaced by arguments, verl_F.masked_mean by a masked mean, agg_loss "token-mean" likewise.
def _masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def verl_clip_cov(old_log_prob, log_prob, advantages, response_mask, clip_cov_ratio, lb, ub, cliprange=0.2):
    ratio = torch.exp(log_prob - old_log_prob)
    pg_losses1 = -advantages * ratio
    corr = torch.ones_like(advantages)
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange, 1 + cliprange)
    clip_by_origin = (pg_losses2 > pg_losses1) & (response_mask > 0)
    cov_all = (advantages - _masked_mean(advantages, response_mask)) * (
        log_prob - _masked_mean(log_prob.detach(), response_mask)
    )
    cov_all[response_mask == 0] = -torch.inf
    cov_all[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * response_mask.sum().item()), 1)
    top_k_idx = torch.nonzero((cov_all < ub) & (cov_all > lb) & (response_mask > 0))
    if len(top_k_idx) > 0:
        top_k_idx = top_k_idx[torch.randperm(len(top_k_idx))[: min(clip_num, len(top_k_idx))]]
    corr[top_k_idx[:, 0], top_k_idx[:, 1]] = 0
    return _masked_mean(torch.maximum(pg_losses1, pg_losses2) * corr, response_mask)


def verl_kl_cov(old_log_prob, log_prob, advantages, response_mask, kl_cov_ratio, ppo_kl_coef):
    negative_approx_kl = log_prob - old_log_prob
    ratio = torch.exp(negative_approx_kl)
    pg_losses = -advantages * ratio
    pg_losses_kl = -advantages * ratio + ppo_kl_coef * negative_approx_kl.abs()
    all_valid = response_mask > 0
    all_valid_idx = torch.nonzero(all_valid.reshape(-1), as_tuple=True)[0]
    all_valid_adv = advantages[all_valid].detach().reshape(-1)
    all_valid_logp = log_prob[all_valid].detach().reshape(-1)
    cov = (all_valid_adv - all_valid_adv.mean()) * (all_valid_logp - all_valid_logp.mean())
    idx = all_valid_idx[torch.topk(cov, max(1, int(len(cov) * kl_cov_ratio)), largest=True).indices]
    rows, cols = idx // advantages.shape[1], idx % advantages.shape[1]
    pg_losses[rows, cols] = pg_losses_kl[rows, cols]
    return _masked_mean(pg_losses, response_mask)


@pytest.mark.parametrize("mode", ["clip_cov", "kl_cov"])
def test_one_micro_batch_step_equals_verls_function(mode):
    """With the whole step in one micro-batch (verl selects per micro-batch; grpolab over the step, which is the
    same here), grpolab's loss and gradient are verl's, Clip-Cov's draw included (verl draws on the global RNG,
    grpolab on the run's generator: the same seed gives the same permutation)."""
    spec, _ = CASES[mode]
    policy = ToyPolicy(N, T, seed=12)
    data = make_data(policy, 12, groups=3, group_size=4, spec=spec)
    metrics, got = ours(spec, data, policy, N, 0.0, seed=7)
    policy.weight.grad = None
    logp, _ = policy(torch.arange(N))
    adv = data.advantages[:, None].expand_as(logp)
    if mode == "clip_cov":
        with torch.random.fork_rng():  # verl draws on the global generator; the other tests' stays as it was
            torch.manual_seed(7)
            loss = verl_clip_cov(data.old_logprobs, logp, adv, data.response_mask, 0.15, 0.0, 0.5)
    else:
        loss = verl_kl_cov(data.old_logprobs, logp, adv, data.response_mask, 0.1, 0.7)
    loss.backward()
    torch.testing.assert_close(got, policy.weight.grad, rtol=1e-10, atol=1e-12)
    assert metrics.loss == pytest.approx(float(loss.detach()), rel=1e-10, abs=1e-12)
