"""The update schedule: micro-batch and pruning exactness, skipped steps, schedules, guards."""

from __future__ import annotations

import pytest
import torch
from host_reads import HostReads
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolab.learning.update import (
    StepContext,
    Trainee,
    UpdateData,
    UpdateSchedule,
    accumulate_gradients,
    run_update,
)
from grpolab.objectives.algorithms import AlgorithmSpec
from grpolab.objectives.losses import NonFiniteError
from grpolab.objectives.presets import PRESETS

V, D = 11, 5


class ToyPolicy:
    """log p(token) = log_softmax(x @ W): real parameters shared by every sequence (float64)."""

    def __init__(self, n: int, t: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(D, V, generator=g, dtype=torch.float64) * 0.5)
        self.features = torch.randn(n, t, D, generator=g, dtype=torch.float64)
        self.tokens = torch.randint(0, V, (n, t), generator=g)
        self.calls: list[list[int]] = []  # rows of each call made with grad enabled
        self.no_grad_calls: list[list[int]] = []

    def __call__(self, idx: torch.Tensor):
        (self.calls if torch.is_grad_enabled() else self.no_grad_calls).append(idx.tolist())
        logits = self.features[idx] @ self.weight
        logprobs = logits.log_softmax(-1).gather(-1, self.tokens[idx, :, None])[..., 0]
        entropy = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)
        return logprobs, entropy


def make_data(policy: ToyPolicy, seed: int, groups: int, group_size: int, spec: AlgorithmSpec, zero_groups=(0,)):
    from grpolab.objectives.advantages import group_advantages

    n, t = policy.tokens.shape
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 2, (groups, group_size), generator=g).double()
    for z in zero_groups:
        rewards[z] = 0.0
    adv = group_advantages(rewards, spec.baseline, spec.normalizer).flatten()
    mask = torch.zeros(n, t, dtype=torch.float64)
    for i in range(n):
        start = int(torch.randint(1, 3, (1,), generator=g))
        mask[i, start : start + int(torch.randint(1, t - start + 1, (1,), generator=g))] = 1
    with torch.no_grad():
        old, _ = policy(torch.arange(n))
        old = old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.1  # slightly stale
    ref = old + 0.05
    # a frozen teacher's log-probs, for on-policy distillation (the other objectives never read them)
    teacher = old - torch.rand(n, t, generator=g, dtype=torch.float64) if spec.needs_teacher else None
    return UpdateData(advantages=adv, response_mask=mask, old_logprobs=old, ref_logprobs=ref, teacher_logprobs=teacher)


def step_grad(spec, data, policy, micro):
    policy.weight.grad = None
    rows, draws = torch.arange(data.advantages.shape[0]), torch.Generator().manual_seed(0)  # Clip-Cov's draw
    step = accumulate_gradients(StepContext(spec, data, rows, UpdateSchedule(micro, 9, generator=draws)), policy)
    grad = policy.weight.grad
    return (None if grad is None else grad.clone()), step.metrics


@pytest.mark.parametrize("name", list(PRESETS))
def test_micro_batch_split_gives_the_whole_batch_gradient(name):
    spec = PRESETS[name].override(beta=0.03)
    policy = ToyPolicy(12, 9, seed=1)
    data = make_data(policy, 1, groups=3, group_size=4, spec=spec)
    whole, m_whole = step_grad(spec, data, policy, micro=12)
    for micro in (1, 5):
        split, m_split = step_grad(spec, data, policy, micro)
        torch.testing.assert_close(split, whole, rtol=1e-10, atol=1e-13)
        assert m_split.tokens == m_whole.tokens
        assert m_split.means()["ratio_mean"] == pytest.approx(m_whole.means()["ratio_mean"], rel=1e-12)


@pytest.mark.parametrize(
    "mode, upper, lower",
    [
        ("token_truncate", 1.1, None),
        ("sequence_mask", 1.5, 0.7),
        ("geometric_mask", 1.03, 0.98),
        ("icepop", 1.1, 0.9),
    ],
)
def test_rollout_corrections_keep_the_micro_batch_split_exact(mode, upper, lower):
    """Dropped tokens still count in the step's denominators: any split and pruning give the whole gradient."""
    spec = PRESETS["grpo"].override(
        rollout_correction=mode,
        rollout_correction_upper=upper,
        rollout_correction_lower=lower,
        off_policy_mask_delta=0.01,
        beta=0.03,
    )
    policy = ToyPolicy(12, 9, seed=5)
    data = make_data(policy, 5, groups=3, group_size=4, spec=spec)
    g = torch.Generator().manual_seed(6)
    data.engine_logprobs = (
        data.old_logprobs + torch.randn(data.old_logprobs.shape, generator=g, dtype=torch.float64) * 0.1
    )
    whole, m_whole = step_grad(spec.override(prune_zero_advantage=False), data, policy, micro=12)
    means = m_whole.means()
    assert 0 < means["rollout_masked_frac"] + means["rollout_truncated_frac"] < 1, "the band cuts some tokens"
    for micro in (1, 5):
        split, m_split = step_grad(spec, data, policy, micro)
        torch.testing.assert_close(split, whole, rtol=1e-10, atol=1e-13)
        for name in (
            "rollout_is_weight_mean",
            "rollout_is_weight_max",
            "rollout_masked_frac",
            "rollout_kl_k3",
            "rollout_is_ratio_mean",
            "rollout_is_ratio_max",
        ):
            assert m_split.means()[name] == pytest.approx(means[name], rel=1e-12), name


@pytest.mark.parametrize("name", list(PRESETS))
def test_pruning_zero_advantage_sequences_keeps_the_gradient(name):
    spec = PRESETS[name]
    if spec.needs_teacher:
        pytest.skip("every token has an advantage of its own: nothing to prune (test_distillation.py feeds them all)")
    policy = ToyPolicy(12, 9, seed=2)
    data = make_data(policy, 2, groups=3, group_size=4, spec=spec, zero_groups=(0, 2))
    policy.calls.clear()
    pruned, _ = step_grad(spec, data, policy, micro=2)
    fed = sorted(i for call in policy.calls for i in call)
    unpruned, _ = step_grad(spec.override(prune_zero_advantage=False), data, policy, micro=2)
    torch.testing.assert_close(pruned, unpruned, rtol=1e-10, atol=1e-13)
    if spec.cov_selection == "kl_cov":  # its penalty has a gradient at any advantage (tests/test_token_selection.py)
        assert set(fed) >= set(torch.nonzero(data.advantages).flatten().tolist())
    else:
        assert fed == torch.nonzero(data.advantages).flatten().tolist()
    assert len(fed) < 12


def test_rft_never_feeds_wrong_samples_to_the_model():
    spec = PRESETS["rft"]
    policy = ToyPolicy(8, 6, seed=3)
    data = make_data(policy, 3, groups=2, group_size=4, spec=spec, zero_groups=())
    policy.calls.clear()
    step_grad(spec, data, policy, micro=3)
    fed = {i for call in policy.calls for i in call}
    assert fed == set(torch.nonzero(data.advantages).flatten().tolist())
    assert all(data.advantages[i] == 1.0 for i in fed)


def test_kl_penalty_disables_pruning_so_the_gradient_stays_exact():
    spec = PRESETS["grpo"].override(beta=0.1)
    policy = ToyPolicy(8, 6, seed=4)
    data = make_data(policy, 4, groups=2, group_size=4, spec=spec)
    policy.calls.clear()
    step_grad(spec, data, policy, micro=8)
    assert sorted(policy.calls[0]) == list(range(8))


def optimizer_for(policy):
    return torch.optim.AdamW([policy.weight], lr=1e-2)


@pytest.mark.parametrize("name,steps", [("grpo", 1), ("gspo", 4), ("cispo", 4), ("offpolicy_clip", 32)])
def test_schedule_runs_epochs_times_steps(name, steps):
    spec = PRESETS[name]
    policy = ToyPolicy(64, 6, seed=5)
    data = make_data(policy, 5, groups=8, group_size=8, spec=spec, zero_groups=())
    result = run_update(
        spec,
        data,
        Trainee(policy, optimizer_for(policy), [policy.weight]),
        UpdateSchedule(micro_batch_size=16, max_new_tokens=6, generator=torch.Generator().manual_seed(0)),
    )
    assert result.attempted == steps
    assert result.actual <= steps and result.actual >= 1
    assert len(result.grad_norms) == result.actual


def test_first_on_policy_update_has_ratio_exactly_one():
    spec = PRESETS["grpo"]
    policy = ToyPolicy(16, 6, seed=6)
    data = make_data(policy, 6, groups=4, group_size=4, spec=spec)
    with torch.no_grad():
        data.old_logprobs = policy(torch.arange(16))[0]
    result = run_update(
        spec, data, Trainee(policy, optimizer_for(policy), [policy.weight]), UpdateSchedule(4, max_new_tokens=6)
    )
    m = result.metrics()
    assert m["first_update/ratio_mean"] == 1.0 and m["first_update/clip_frac"] == 0.0
    assert m["actual_updates"] == 1 and "entropy" in m


def test_multi_epoch_updates_drift_from_the_frozen_old_logprobs():
    spec = PRESETS["gspo"].override(eps_low=0.2, eps_high=0.2)
    policy = ToyPolicy(16, 6, seed=7)
    data = make_data(policy, 7, groups=4, group_size=4, spec=spec, zero_groups=())
    with torch.no_grad():
        data.old_logprobs = policy(torch.arange(16))[0]
    result = run_update(
        spec,
        data,
        Trainee(policy, torch.optim.SGD([policy.weight], lr=5.0), [policy.weight]),
        UpdateSchedule(micro_batch_size=16, max_new_tokens=6),
    )
    assert result.first_step["ratio_mean"] == 1.0
    assert result.tokens.ratio_max > 1.0 or result.tokens.ratio_min < 1.0


def test_all_zero_advantages_skip_the_optimizer_step():
    spec = PRESETS["grpo"]
    policy = ToyPolicy(8, 6, seed=8)
    data = make_data(policy, 8, groups=2, group_size=4, spec=spec, zero_groups=(0, 1))
    before = policy.weight.detach().clone()
    result = run_update(
        spec, data, Trainee(policy, optimizer_for(policy), [policy.weight]), UpdateSchedule(4, max_new_tokens=6)
    )
    assert (result.attempted, result.actual) == (1, 0)
    assert torch.equal(policy.weight.detach(), before)


def test_non_finite_gradient_raises_before_the_optimizer_step():
    spec = PRESETS["grpo"]
    policy = ToyPolicy(8, 6, seed=9)
    data = make_data(policy, 9, groups=2, group_size=4, spec=spec, zero_groups=())
    policy.features[3, :] = float("inf")  # forward gives finite masked values but a NaN gradient
    before = policy.weight.detach().clone()
    opt = optimizer_for(policy)
    with pytest.raises(NonFiniteError):
        run_update(spec, data, Trainee(policy, opt, [policy.weight]), UpdateSchedule(4, max_new_tokens=6))
    assert torch.equal(policy.weight.detach(), before)
    assert not opt.state  # no optimizer state was created


def test_impossible_split_is_refused():
    spec = PRESETS["offpolicy_clip"]
    policy = ToyPolicy(12, 6, seed=10)
    data = make_data(policy, 10, groups=3, group_size=4, spec=spec)
    with pytest.raises(ValueError, match="cannot be split into 32"):
        run_update(
            spec, data, Trainee(policy, optimizer_for(policy), [policy.weight]), UpdateSchedule(4, max_new_tokens=6)
        )


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 1000),
    groups=st.integers(1, 4),
    group_size=st.integers(2, 5),
    micro=st.integers(1, 7),
    name=st.sampled_from(list(PRESETS)),
)
def test_property_split_and_prune_equivalence(seed, groups, group_size, micro, name):
    spec = PRESETS[name]
    n = groups * group_size
    policy = ToyPolicy(n, 7, seed=seed)
    data = make_data(
        policy, seed, groups=groups, group_size=group_size, spec=spec, zero_groups=(0,) if groups > 1 else ()
    )
    whole, _ = step_grad(spec.override(prune_zero_advantage=False), data, policy, micro=n)
    split, _ = step_grad(spec, data, policy, micro=micro)
    if split is None or whole is None:  # the step's whole loss is zero: nothing is backpropagated
        assert split is None and whole is None and (data.advantages == 0).all()
        return
    torch.testing.assert_close(split, whole, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("grpo", {}),
        ("offpolicy_clip", {"steps_per_epoch": 2}),
        ("dapo_8020", {"entropy_coef": 0.01}),  # the selection's pass and the bonus: reads per step, too
        ("kl_cov", {"steps_per_epoch": 2, "kl_cov_ratio": 0.1}),
    ],
)
def test_the_update_waits_for_the_device_per_optimizer_step_not_per_micro_batch(name, overrides):
    """The micro-batch loop keeps its metrics, loss and finiteness checks on the device: an optimizer step
    in micro-batches of one row reads as many values as the same step in one micro-batch."""
    spec = PRESETS[name].override(beta=0.03, rollout_correction="none", **overrides)  # the run resolves auto
    reads, rows_per_step = {}, 12 // spec.steps_per_epoch
    for micro in (rows_per_step, 1):
        policy = ToyPolicy(12, 9, seed=4)
        data = make_data(policy, 4, groups=3, group_size=4, spec=spec)
        data.engine_logprobs = data.old_logprobs - 0.01
        with HostReads() as mode:
            result = run_update(
                spec,
                data,
                Trainee(policy, optimizer_for(policy), [policy.weight]),
                UpdateSchedule(micro_batch_size=micro, max_new_tokens=9, generator=torch.Generator().manual_seed(0)),
            )
        assert result.actual == spec.epochs * spec.steps_per_epoch
        reads[micro] = mode.count
    assert reads[1] == reads[rows_per_step] > 0
