"""A failure is a state, never a zero: a failed sample takes no part in its group's advantages or the loss.

Float64 references written from the formulas over plain lists of the valid samples only (a failed sample is not
there at all), against the tensor functions given the whole batch and a validity mask."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolab.learning.update import StepContext, UpdateData, UpdateSchedule, accumulate_gradients
from grpolab.objectives.advantages import (
    decoupled_advantages,
    group_advantages,
    informative_groups,
    min_valid_samples,
    valid_sample_scale,
)
from grpolab.objectives.beta_norm import beta_density_scale
from grpolab.objectives.presets import PRESETS
from grpolab.rollout.collect import RolloutBatch, kept_groups
from grpolab.rollout.failures import TooManyFailures, check_failure_rate, failure_metrics, failure_totals
from grpolab.tasks.base import ENVIRONMENT_TERM, Grade

EPS = 1e-6
LOCAL = [("mean", "std"), ("mean", "mean"), ("mean", "none"), ("none", "none"), ("none", "std")]


def reference_group(rewards: list[float], baseline: str, normalizer: str) -> list[float]:
    """One group's advantages from the formula, in float64, over exactly the samples given."""
    n = len(rewards)
    mean = sum(rewards) / n
    base = mean if baseline == "mean" else 0.0
    centered = [0.0] * n if baseline == "mean" and len(set(rewards)) == 1 else [r - base for r in rewards]
    if normalizer == "std":
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
        return [c / (std + EPS) for c in centered]
    if normalizer == "mean":
        return [0.0 if mean == 0 else c / (mean + EPS) for c in centered]
    return centered


def reference_batch(rewards: list[list[float]], valid: list[list[bool]], baseline: str, normalizer: str):
    """[B][G] advantages: each group over its valid samples (dropped under ``min_valid_samples``), a failed
    sample's 0; the batch-level scales (Lite PPO's std, BNPO's Beta fit) over the kept groups' valid samples."""
    least = min_valid_samples(baseline, normalizer)
    kept = [[r for r, v in zip(row, ok) if v] for row, ok in zip(rewards, valid)]
    kept = [k if len(k) >= least else None for k in kept]
    out = [[0.0] * len(row) for row in rewards]
    local = "none" if normalizer in ("batch_std", "beta_density") else normalizer
    scale = [1.0] * len(rewards)
    if normalizer == "batch_std":
        pool = [r for k in kept if k for r in k]
        m = sum(pool) / len(pool)
        std = math.sqrt(sum((r - m) ** 2 for r in pool) / (len(pool) - 1))
        scale = [1 / (std + EPS)] * len(rewards)
    if normalizer == "beta_density":
        means = [sum(k) / len(k) for k in kept if k]
        fitted = iter(beta_density_scale(torch.tensor(means, dtype=torch.float64))[:, 0].tolist())
        scale = [next(fitted) if k else 1.0 for k in kept]
    for b, (k, ok) in enumerate(zip(kept, valid)):
        if k is None:
            continue
        values = iter(reference_group(k, baseline, local))
        for g, v in enumerate(ok):
            if v:
                out[b][g] = next(values) * scale[b]
    return out


def masked(rewards, valid):
    return torch.tensor(rewards, dtype=torch.float64), torch.tensor(valid)


@pytest.mark.parametrize("baseline,normalizer", LOCAL)
def test_a_group_with_a_failed_sample_equals_the_group_without_it(baseline, normalizer):
    rewards = [[1.0, 0.0, 0.5, 1.0, 0.0, 0.25]]
    failed_one = [[True, True, False, True, True, True]]  # sample 2 failed: its 0.5 is never read
    got = group_advantages(*masked(rewards, failed_one)[:1], baseline, normalizer, EPS, masked(rewards, failed_one)[1])
    without = group_advantages(
        torch.tensor([[1.0, 0.0, 1.0, 0.0, 0.25]], dtype=torch.float64), baseline, normalizer, EPS
    )
    torch.testing.assert_close(got[0, [0, 1, 3, 4, 5]], without[0], rtol=0, atol=1e-12)
    assert got[0, 2] == 0.0
    # whatever the failed sample's reward says, nothing changes
    other = [[1.0, 0.0, -7.0, 1.0, 0.0, 0.25]] if normalizer != "mean" else [[1.0, 0.0, 9.0, 1.0, 0.0, 0.25]]
    again = group_advantages(*masked(other, failed_one)[:1], baseline, normalizer, EPS, masked(other, failed_one)[1])
    assert torch.equal(again, got)


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 6),
    st.integers(2, 8),
    st.sampled_from(LOCAL + [("mean", "batch_std"), ("none", "batch_std"), ("mean", "beta_density")]),
    st.integers(0, 2**31),
)
def test_masked_advantages_match_the_float64_reference_over_valid_samples_only(groups, size, combo, seed):
    baseline, normalizer = combo
    rng = random.Random(seed)
    rewards = [[rng.choice([0.0, 0.25, 1.0]) for _ in range(size)] for _ in range(groups)]
    valid = [[rng.random() > 0.2 for _ in range(size)] for _ in range(groups)]  # ~20% failed
    used = [sum(ok) for ok, row in zip(valid, rewards)]
    if normalizer == "batch_std" and sum(u for u in used if u >= min_valid_samples(baseline, normalizer)) < 2:
        return  # no two valid samples: no scale (the function's zeros are checked apart)
    got = group_advantages(*masked(rewards, valid)[:1], baseline, normalizer, EPS, masked(rewards, valid)[1])
    want = reference_batch(rewards, valid, baseline, normalizer)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)


def test_injected_failures_leave_the_valid_samples_advantages_unchanged():
    """A batch, then the same batch with 20% of its samples failed and their rewards scrambled: every valid
    sample's advantage is the one its group gives without the failed samples, for every preset's advantage."""
    rng = random.Random(7)
    rewards = [[float(rng.random() < 0.5) for _ in range(8)] for _ in range(10)]
    cells = [(b, g) for b in range(10) for g in range(8)]
    failed = set(rng.sample(cells, 16))  # 20%
    valid = [[(b, g) not in failed for g in range(8)] for b in range(10)]
    scrambled = [
        [rng.choice([0.0, 1.0, 0.5]) if (b, g) in failed else r for g, r in enumerate(row)]
        for b, row in enumerate(rewards)
    ]
    for name, spec in PRESETS.items():
        if spec.multi_objective_aggregation != "sum_then_normalize":
            continue
        got = group_advantages(
            *masked(scrambled, valid)[:1], spec.baseline, spec.normalizer, EPS, masked(scrambled, valid)[1]
        )
        want = reference_batch(rewards, valid, spec.baseline, spec.normalizer)
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9, msg=name)


def test_a_group_below_its_minimum_of_valid_samples_is_dropped():
    rewards, valid = masked([[1.0, 0.0, 1.0], [1.0, 0.0, 0.0]], [[True, False, False], [True, True, True]])
    got = group_advantages(rewards, "mean", "std", EPS, valid)
    assert torch.equal(got[0], torch.zeros(3)) and (got[1] != 0).all()
    assert min_valid_samples("mean", "std") == 2 and min_valid_samples("none", "none") == 1
    # no baseline, no group scale: one valid sample keeps its reward
    assert group_advantages(rewards, "none", "none", EPS, valid)[0].tolist() == [1.0, 0.0, 0.0]
    # a batch with fewer than two valid samples has no batch std: no contrast, zeros
    lone = group_advantages(rewards[:1], "none", "batch_std", EPS, valid[:1])
    assert torch.equal(lone, torch.zeros(1, 3))


def test_maxrl_never_reads_a_failed_samples_negative_reward():
    rewards, valid = masked([[1.0, -3.0, 0.0, 1.0]], [[True, False, True, True]])
    got = group_advantages(rewards, "mean", "mean", EPS, valid)
    want = reference_group([1.0, 0.0, 1.0], "mean", "mean")
    torch.testing.assert_close(got[0, [0, 2, 3]], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="needs rewards >= 0"):
        group_advantages(rewards, "mean", "mean", EPS)


def test_gdpo_with_failures_matches_its_reference_over_the_valid_samples():
    rng = random.Random(3)
    terms = [[[float(rng.random() < 0.5), rng.random()] for _ in range(6)] for _ in range(5)]
    valid = [[rng.random() > 0.2 for _ in range(6)] for _ in range(5)]
    valid[0] = [True] * 6
    got = decoupled_advantages(
        torch.tensor(terms, dtype=torch.float64),
        torch.tensor([1.0, 0.3], dtype=torch.float64),
        "mean",
        "std",
        EPS,
        torch.tensor(valid),
    )
    # the reference over the valid samples: per term per group, then whitened over the valid samples' sums
    per_term = [reference_batch([[s[k] for s in group] for group in terms], valid, "mean", "std") for k in range(2)]
    summed = [[per_term[0][b][g] + 0.3 * per_term[1][b][g] for g in range(6)] for b in range(5)]
    pool = [summed[b][g] for b in range(5) for g in range(6) if valid[b][g] and sum(valid[b]) >= 2]
    m = sum(pool) / len(pool)
    std = math.sqrt(sum((x - m) ** 2 for x in pool) / (len(pool) - 1))
    want = [
        [
            0.0
            if not (valid[b][g] and sum(valid[b]) >= 2) or all(x == 0 for x in summed[b])
            else (summed[b][g] - m) / (std + EPS)
            for g in range(6)
        ]
        for b in range(5)
    ]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    # with every sample valid, the mask changes nothing
    whole = torch.ones(5, 6, dtype=torch.bool)
    t = torch.tensor(terms, dtype=torch.float64)
    w = torch.tensor([1.0, 0.3], dtype=torch.float64)
    torch.testing.assert_close(
        decoupled_advantages(t, w, "mean", "std", EPS, whole), decoupled_advantages(t, w, "mean", "std", EPS)
    )


def test_gpg_scale_counts_valid_samples_only():
    rewards, valid = masked([[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]], [[True, True, False, True], [True] * 4])
    # 7 valid samples, 3 of them in the informative group
    assert valid_sample_scale(rewards, valid).item() == pytest.approx(7 / 3)
    assert valid_sample_scale(rewards).item() == pytest.approx(2 / 1)


def test_dynamic_sampling_judges_a_group_by_its_valid_samples():
    rewards, valid = masked(
        [[1.0, 0.0, 0.0], [1.0, 0.0, 1.0], [0.5, 0.5, 0.5]], [[True, False, True], [True, True, False], [True] * 3]
    )
    assert informative_groups(rewards, valid).tolist() == [True, True, False]
    ok, bad = Grade(1.0, 1.0), Grade.failed_as("reward", "boom", ("f",))
    grades = [[ok, bad, Grade(1.0, 1.0)], [ok, Grade(0.0, 0.0), bad]]
    # group 0: its valid samples are all right (the failed one's 0 is no contrast); group 1: one right, one wrong
    assert kept_groups(grades, "correct").tolist() == [False, True]


def test_a_failed_rows_tokens_train_nothing_and_count_in_no_denominator():
    """The gradient of a step whose failed rows are masked out equals the gradient of the step without those
    rows, for every preset's aggregation (their advantages are 0 and their tokens in no denominator)."""
    from test_update import ToyPolicy, make_data

    for name in ("grpo", "dr_grpo", "dapo", "gspo", "bnpo"):
        spec = PRESETS[name]
        policy = ToyPolicy(16, 7, seed=1)
        data = make_data(policy, seed=2, groups=4, group_size=4, spec=spec, zero_groups=())
        failed = torch.tensor([2, 5, 11])
        keep = torch.tensor([i for i in range(16) if i not in failed.tolist()])
        masked_mask = data.response_mask.clone()
        masked_mask[failed] = 0
        advantages = data.advantages.clone()
        advantages[failed] = 0
        with_failed = UpdateData(advantages, masked_mask, data.old_logprobs, data.ref_logprobs)
        grads = []
        for d, rows in ((with_failed, torch.arange(16)), (data, keep)):
            policy.weight.grad = None
            if d is data:
                d = UpdateData(advantages, data.response_mask, data.old_logprobs, data.ref_logprobs)
            accumulate_gradients(StepContext(spec, d, rows, UpdateSchedule(4, max_new_tokens=9)), policy)
            grads.append(policy.weight.grad.clone())
        torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14, msg=name)


def test_grade_failure_kinds():
    assert Grade(1.0, 1.0).ok
    assert Grade(0.0, 0.0, failed=("f",)).failure == "reward"
    assert Grade(0.0, 0.0, failed=(ENVIRONMENT_TERM,)).failure == "environment"
    assert Grade.failed_as("timeout", "timed out after 5 s", (ENVIRONMENT_TERM,)).failure == "timeout"
    with pytest.raises(ValueError, match="unknown failure kind 'gremlins'"):
        Grade(0.0, 0.0, failure="gremlins")
    # a failed sample stays failed when shaping adds a term
    assert not Grade(0.0, 0.0, failed=("f",)).plus("overlong_penalty", -0.5).ok


def test_failure_counts_and_the_stop_line():
    grades = [Grade(1.0, 1.0)] * 5 + [Grade.failed_as("reward", "reward 'f': RuntimeError: bug on 3", ("f",))] * 4
    grades += [Grade.failed_as("timeout", "environment e: timed out after 5 s", (ENVIRONMENT_TERM,))]
    metrics = failure_metrics(grades)
    assert metrics["rollout/failed"] == 5 and metrics["rollout/failed/reward"] == 4
    assert metrics["rollout/failed/timeout"] == 1 and metrics["rollout/failed/endpoint"] == 0
    assert metrics["rollout/failure_rate"] == 0.5
    failed = [(g.failure, g.error) for g in grades if not g.ok]
    check_failure_rate(failed, len(grades), 0.5, "step 3")  # at the limit: goes on
    with pytest.raises(TooManyFailures) as raised:
        check_failure_rate(failed, len(grades), 0.4, "step 3")
    line = str(raised.value)
    assert "\n" not in line
    assert line.startswith("step 3: 5 of 10 samples failed (over rollout.max_failure_rate 0.4): 4 reward, timeout 1")
    assert line.endswith("the first reward error: reward 'f': RuntimeError: bug on 3")
    assert failure_totals([metrics, {"rollout/failed/reward": 2}, {"reward_mean": 1.0}]) == {"reward": 6, "timeout": 1}


def test_a_rollout_batch_says_which_samples_are_valid():
    batch = RolloutBatch([], [], [[Grade(1.0, 1.0), Grade.failed_as("endpoint", "refused")]])
    assert batch.valid().tolist() == [[True, False]]


def test_a_reward_models_normalization_never_reads_a_failed_sample():
    """The batch z-score (and the running moments) of a reward model's scores are over the samples that did not
    fail: the valid samples' RL rewards equal those of the batch without the failed ones."""
    from types import SimpleNamespace

    from grpolab.rollout.reward_models import RewardModels
    from grpolab.tasks.reward_model_spec import RewardModelOptions, RewardModelSpec

    def scored(total: float, score: float, ok: bool = True) -> Grade:
        failed = () if ok else ("f",)
        return Grade(1.0, 1.0, components=(("rm", score),), total=total, failed=failed)

    for how in ("batch", "running"):
        spec = RewardModelSpec(path="m", name="rm", weight=0.5, options=RewardModelOptions(normalize=how))
        grades = [[scored(1.0, 0.2), scored(0.0, 9.0, ok=False), scored(1.0, -0.4)], [scored(0.0, 1.1)] * 2]
        without = [[scored(1.0, 0.2), scored(1.0, -0.4)], [scored(0.0, 1.1)] * 2]
        got = RewardModels([SimpleNamespace(spec=spec)]).reward(grades)
        want = RewardModels([SimpleNamespace(spec=spec)]).reward(without)
        assert [got[0][0].reward, got[0][2].reward, *[g.reward for g in got[1]]] == pytest.approx(
            [g.reward for group in want for g in group], abs=1e-12
        )
        assert not got[0][1].ok


def test_the_reports_pairing_leaves_out_items_that_failed_in_either_run():
    import numpy as np

    from grpolab.studies.report.runs import Outcomes, pair

    def outcomes(correct: dict[str, bool], failed: set[str]) -> Outcomes:
        ids = list(correct)
        return Outcomes(0, ids, ["h"] * len(ids), np.array([float(correct[i]) for i in ids]), [], frozenset(failed))

    a = outcomes({"x": True, "y": False, "z": True}, {"w"})  # w failed in a
    b = outcomes({"x": True, "w": True, "v": False}, {"y"})  # y failed in b; z only in a, v only in b
    matched = pair(a, b)
    assert matched.shared == 1 and matched.a.tolist() == [1.0] and matched.b.tolist() == [1.0]  # x alone
    assert matched.failed == 2 and matched.only_one == 2 and matched.differing == 0  # w and y; z and v


def test_pass_at_k_curves_count_each_items_samples_that_did_not_fail():
    from grpolab.objectives.stats import pass_at_k, pass_at_k_curve

    curve = pass_at_k_curve(4, [2, 1], samples=[4, 2])  # the second item lost 2 of its 4 samples
    assert curve[1] == pytest.approx((pass_at_k(4, 2, 1) + pass_at_k(2, 1, 1)) / 2)
    assert curve[4] == pytest.approx(pass_at_k(4, 2, 4))  # only the first item has 4
    assert pass_at_k_curve(0, [0, 0], samples=[0, 0]) == {}  # every sample failed
