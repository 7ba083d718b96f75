"""On-policy distillation: the per-token advantage against its float64 reference, micro-batch exactness, the
spec's and the config's refusals, and the teacher's tokenizer check (tests/test_distillation_run.py: runs)."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import build_char_tokenizer
from reference import reference_distill_loss
from test_update import ToyPolicy, make_data, step_grad

from grpolab.config import ConfigError, load_config
from grpolab.learning.update import UpdateData
from grpolab.models.teacher import check_teacher_tokenizer
from grpolab.objectives.losses import PolicyLossInput, policy_loss, step_denominators
from grpolab.objectives.presets import PRESETS, get_algorithm

MAX_NEW = 12


def batch(seed: int, n: int = 6, t: int = 14):
    """float64 (logp, old, adv, teacher, mask): responses of random length after a short prompt."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(n, t, dtype=torch.float64)
    for i in range(n):
        start = int(torch.randint(0, 4, (1,), generator=g))
        mask[i, start : start + int(torch.randint(1, t - start + 1, (1,), generator=g))] = 1
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(n, t, generator=g, dtype=torch.float64) * 0.3
    teacher = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return logp, old, adv, teacher, mask


def loss_and_grad(spec, logp, old, adv, teacher, mask):
    leaf = logp.clone().requires_grad_(True)
    inp = PolicyLossInput(leaf, old, adv, mask, teacher_logprobs=teacher)
    loss, metrics = policy_loss(inp, spec, step_denominators(spec, mask, MAX_NEW))
    loss.backward()
    return loss.detach(), leaf.grad, metrics.means()


@pytest.mark.parametrize(
    "weight, aggregation, coefs",
    list(itertools.product(["noclip", "clip", "none"], ["token", "sequence"], [(1, 0), (0.5, 1)])),
)
def test_per_token_advantage_matches_the_float64_reference(weight, aggregation, coefs):
    kl_coef, reward_coef = coefs
    spec = PRESETS["opd"].override(
        weight=weight, aggregation=aggregation, teacher_kl_coef=kl_coef, reward_coef=reward_coef, eps_low=0.1
    )
    logp, old, adv, teacher, mask = batch(hash((weight, aggregation, coefs)) % 1000)
    loss, grad, _ = loss_and_grad(spec, logp, old, adv, teacher, mask)
    leaf = logp.clone().requires_grad_(True)
    expected = reference_distill_loss(
        leaf, old, adv, teacher, mask, weight=weight, aggregation=aggregation, teacher_kl_coef=kl_coef,
        reward_coef=reward_coef, eps_low=0.1, eps_high=spec.eps_high,
    )  # fmt: skip
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, leaf.grad, rtol=1e-10, atol=1e-12)


def test_on_policy_gradient_is_the_sampled_reverse_kl_gradient():
    """At the sampling policy (w = 1) the preset's gradient is E_t[grad logp_t * (logp_t - logp_teacher_t)] / tokens:
    minus the per-token reverse-KL advantage times the score, and its metric is the sampled reverse KL."""
    _, old, adv, teacher, mask = batch(7)
    loss, grad, means = loss_and_grad(PRESETS["opd"], old, old, adv, teacher, mask)
    expected = (old - teacher) * mask / mask.sum()
    torch.testing.assert_close(grad, expected, rtol=1e-12, atol=1e-14)
    assert means["teacher_kl"] == pytest.approx(float(((old - teacher) * mask).sum() / mask.sum()), rel=1e-12)
    assert means["ratio_mean"] == 1.0 and means["clip_frac"] == 0.0


def test_the_task_advantage_is_ignored_by_pure_distillation_and_mixed_in_with_reward_coef():
    logp, old, adv, teacher, mask = batch(3)
    pure = [loss_and_grad(PRESETS["opd"], logp, old, a, teacher, mask)[1] for a in (adv, -adv)]
    assert torch.equal(pure[0], pure[1])
    mixed = PRESETS["opd"].override(reward_coef=1.0)
    assert not torch.allclose(loss_and_grad(mixed, logp, old, adv, teacher, mask)[1], pure[0])


def test_existing_objectives_ignore_a_teacher():
    logp, old, adv, teacher, mask = batch(4)
    spec = PRESETS["grpo"]
    with_teacher = loss_and_grad(spec, logp, old, adv, teacher, mask)
    without = loss_and_grad(spec, logp, old, adv, None, mask)
    assert torch.equal(with_teacher[0], without[0]) and torch.equal(with_teacher[1], without[1])


def test_the_loss_refuses_a_distillation_step_without_teacher_log_probs():
    logp, old, adv, _, mask = batch(5)
    with pytest.raises(ValueError, match="needs the teacher's log-probs"):
        loss_and_grad(PRESETS["opd"], logp, old, adv, None, mask)


@pytest.mark.parametrize("overrides", [{}, {"reward_coef": 0.5, "steps_per_epoch": 2, "weight": "clip"}])
def test_micro_batch_split_gives_the_whole_batch_gradient(overrides):
    spec = PRESETS["opd"].override(**overrides)
    policy = ToyPolicy(12, 9, seed=11)
    data = make_data(policy, 3, groups=3, group_size=4, spec=spec)
    whole, m_whole = step_grad(spec, data, policy, micro=12)
    for micro in (1, 5):
        split, m_split = step_grad(spec, data, policy, micro)
        torch.testing.assert_close(split, whole, rtol=1e-10, atol=1e-13)
        assert m_split.means()["teacher_kl"] == pytest.approx(m_whole.means()["teacher_kl"], rel=1e-12)


def test_every_row_is_fed_even_when_every_task_advantage_is_zero():
    spec = PRESETS["opd"]
    policy = ToyPolicy(8, 6, seed=12)
    data = make_data(policy, 4, groups=2, group_size=4, spec=spec, zero_groups=(0, 1))
    assert (data.advantages == 0).all()
    policy.calls.clear()
    grad, _ = step_grad(spec, data, policy, micro=3)
    assert sorted(i for call in policy.calls for i in call) == list(range(8)) and grad.abs().sum() > 0


def test_data_parallel_rows_see_their_own_teacher_rows():
    """UpdateData.loss_input picks the teacher's rows with the others' (a rank's block, a micro-batch)."""
    data = UpdateData(
        advantages=torch.zeros(4), response_mask=torch.ones(4, 3), old_logprobs=None,
        teacher_logprobs=torch.arange(12.0).view(4, 3),
    )  # fmt: skip
    rows = torch.tensor([2, 0])
    assert torch.equal(data.loss_input(rows, torch.zeros(2, 3)).teacher_logprobs, data.teacher_logprobs[rows])


def test_the_spec_refuses_a_reward_coef_without_a_teacher_term():
    with pytest.raises(ValueError, match="reward_coef 0.5 .* needs teacher_kl_coef > 0"):
        get_algorithm("grpo", reward_coef=0.5)
    assert get_algorithm("opd", reward_coef=0.5).needs_teacher and not PRESETS["grpo"].needs_teacher
    with pytest.raises(ValueError, match="off_policy_mask_delta drops sequences by the sign of their advantage"):
        get_algorithm("opd", off_policy_mask_delta=0.1)
    with pytest.raises(ValueError, match="dynamic_sampling drops groups .* pure distillation"):
        get_algorithm("opd", dynamic_sampling=True)
    assert get_algorithm("opd", dynamic_sampling=True, reward_coef=1.0).dynamic_sampling  # the reward counts again


def test_grpolab_algorithms_shows_the_per_token_advantage():
    formula = PRESETS["opd"].formula()
    assert formula.startswith("-A_t * w, A_t = reward_coef*A + teacher_kl_coef*(logp_teacher - logp_old); reduced")
    assert "teacher" not in PRESETS["grpo"].formula()


def test_config_refuses_opd_without_a_teacher_and_a_teacher_without_opd():
    with pytest.raises(ConfigError, match="algorithm opd .* needs a teacher: set teacher.path"):
        load_config(None, {"algorithm.name": "opd"})
    with pytest.raises(ConfigError, match="teacher.path .* algorithm grpo does not read a teacher"):
        load_config(None, {"teacher.path": "some/folder"})
    cfg = load_config(None, {"algorithm.name": "opd", "teacher.path": "some/folder", "rollout.group_size": 1})
    assert cfg.teacher.path == "some/folder"  # pure distillation needs no group
    with pytest.raises(ConfigError, match="group_size 1"):
        load_config(
            None, {"algorithm.name": "opd", "teacher.path": "x", "rollout.group_size": 1, "algorithm.reward_coef": 1}
        )


def test_a_suite_run_names_its_teacher_absolutely(tmp_path, monkeypatch):
    from grpolab.studies.suite.prepare import frozen_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "teachers" / "t1").mkdir(parents=True)  # a local folder (an existing path wins over a hub id)
    cfg = load_config(None, {"algorithm.name": "opd", "teacher.path": "teachers/t1"})
    assert frozen_config(cfg, {"task_paths": {}}, None).teacher.path == str(tmp_path / "teachers" / "t1")


def _vocab_swapped(tokenizer):
    """The same tokens as ``tokenizer``, two of them with each other's ids."""
    vocab = dict(tokenizer.get_vocab())
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def test_teacher_tokenizer_must_give_every_token_the_same_id():
    student = build_char_tokenizer()
    check_teacher_tokenizer(student, build_char_tokenizer(), "t", chat_prompts=True)  # the same: accepted
    swapped = _vocab_swapped(student)
    assert len(swapped) == len(student)  # same size: a size check would pass it
    with pytest.raises(ValueError, match="teacher t: its tokenizer differs from the policy's: token 'a' is id"):
        check_teacher_tokenizer(student, swapped, "t", chat_prompts=False)
    other_eos = build_char_tokenizer()
    other_eos.eos_token = "<unk>"
    with pytest.raises(ValueError, match="eos token"):
        check_teacher_tokenizer(student, other_eos, "t", chat_prompts=False)


def test_teacher_chat_template_must_match_when_prompts_are_chat():
    student, teacher = build_char_tokenizer(), build_char_tokenizer()
    student.chat_template = "{{ messages[0]['content'] }}"
    teacher.chat_template = "Q: {{ messages[0]['content'] }}"
    check_teacher_tokenizer(student, teacher, "t", chat_prompts=False)  # prompts not rendered by a template
    with pytest.raises(ValueError, match="chat template differs"):
        check_teacher_tokenizer(student, teacher, "t", chat_prompts=True)


def test_no_learning_signal_warning_stays_quiet_while_the_teacher_trains():
    """Every task advantage 0 (all rewards equal) does not stop distillation: no 'no_learning_signal' warning."""
    from test_health import DEAD, step

    from grpolab.run.health import HealthMonitor, HealthSettings

    monitor = HealthMonitor(HealthSettings(no_signal_steps=2))
    records = [step(n, **{**DEAD, "actual_updates": 1, "total_actual_updates": n}) for n in (1, 2, 3)]
    assert [w for r in records for w in monitor.record(r)] == []
    assert [w.key for w in monitor.record(step(4, **DEAD, actual_updates=0))] == []  # a streak starts anew
    assert [w.key for w in monitor.record(step(5, **DEAD, actual_updates=0))] == ["no_learning_signal"]


def test_the_step_line_shows_the_kl_to_the_teacher():
    from grpolab.run.step import vital_signs

    record = {"step": 3, "reward_mean": 0.5, "teacher_kl": 0.1234567, "time/step": 1.0}
    assert "teacher_kl 0.1235" in vital_signs(record, 10, 5.0)
    del record["teacher_kl"]
    assert "teacher_kl" not in vital_signs(record, 10, 5.0)
