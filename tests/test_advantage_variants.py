"""Advantage variants (docs/algorithms.md, "Advantage variants: Lite PPO, GDPO, 2-GRPO"): Lite PPO's batch std,
GDPO's decoupled reward terms and 2-GRPO's group size, against float64 loop references of the papers' formulas
(tests/reference_advantage_variants.py), against TRL 1.16's own code (the lines of
``GRPOTrainer._generate_and_score_completions`` that form the advantages, run unchanged), over two data-parallel
ranks, and through the config's refusals."""

from __future__ import annotations

import ast

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_advantage_variants import reference_batch_std_advantages, reference_decoupled_advantages
from test_rollout_correction_trl import _function, _run, _trl_source
from threaded_ranks import run_as_threads

from grpolab.commands.cli import main
from grpolab.config import ConfigError, load_config
from grpolab.learning.learner import LearnerState, PolicyLearner, TrainedModel
from grpolab.objectives.advantages import batch_advantages, decoupled_advantages, group_advantages
from grpolab.objectives.presets import PRESETS, get_algorithm
from grpolab.parallel.ranks import Ranks
from grpolab.rollout.collect import RolloutBatch
from grpolab.tasks.base import Example, Grade

EPS = 1e-6


def rewards_batch(seed: int, groups: int = 5, size: int = 4) -> torch.Tensor:
    """[B, G] float64 rewards on a 0.25 grid; group 1 all equal."""
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 5, (groups, size), generator=g).double() / 4
    rewards[1] = 0.5
    return rewards


def terms_batch(seed: int, groups: int = 5, size: int = 4, k: int = 3) -> torch.Tensor:
    """[B, G, K] float64 reward terms: binary correctness and format, a graded length penalty; group 1 all equal
    in every term, group 2 in its first term only."""
    g = torch.Generator().manual_seed(seed)
    terms = torch.randint(0, 2, (groups, size, k), generator=g).double()
    terms[:, :, 2] = -torch.randint(0, 5, (groups, size), generator=g).double() / 4
    terms[1] = terms[1, 0]
    terms[2, :, 0] = 1.0
    return terms


# ---- Lite PPO: the group's mean over the batch's std ---------------------------------------------------------
@pytest.mark.parametrize("baseline", ["mean", "none"])
@pytest.mark.parametrize("seed", [0, 1])
def test_batch_std_matches_the_reference(baseline, seed):
    rewards = rewards_batch(seed)
    got = group_advantages(rewards, baseline, "batch_std", EPS)
    want = torch.tensor(reference_batch_std_advantages(rewards.tolist(), baseline, EPS), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    if baseline == "mean":
        assert (got[1] == 0).all()  # an all-equal group: exactly 0


def test_batch_std_scales_every_group_alike_unlike_the_group_std():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    centered = rewards - rewards.mean(1, keepdim=True)
    lite = group_advantages(rewards, "mean", "batch_std", 0.0) / centered  # one scale for the whole batch
    torch.testing.assert_close(lite, torch.full_like(lite, 1 / rewards.std().item()))
    grpo = group_advantages(rewards, "mean", "std", 0.0) / centered  # one scale per group
    assert not torch.allclose(grpo[0], grpo[1])


# ---- GDPO: each term normalized in its group, the weighted sum whitened over the batch ------------------------
@pytest.mark.parametrize("normalizer", ["std", "none"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_matches_the_reference(normalizer, seed):
    terms, weights = terms_batch(seed), torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    got = decoupled_advantages(terms, weights, "mean", normalizer, EPS)
    want = reference_decoupled_advantages(terms.tolist(), weights.tolist(), normalizer, EPS)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    assert (got[1] == 0).all() and (got[0] != 0).any()


def test_decoupled_keeps_the_resolution_the_summed_reward_loses():
    """The paper's figure 2: two binary terms; GRPO maps (1, 0) and (0, 1) in a group of {(1,1), (1,0), (0,1),
    (0,0)} ... to distinct advantages only through the sum, and the groups {(1,0),(0,0)} and {(1,1),(0,0)}
    to the same +-0.707; GDPO tells the second group's better sample (both terms right) apart."""
    terms = torch.tensor([[[1.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [0.0, 0.0]]], dtype=torch.float64)
    weights = torch.ones(2, dtype=torch.float64)
    grpo = group_advantages((terms * weights).sum(2), "mean", "std", EPS)
    assert grpo[0, 0] == pytest.approx(grpo[1, 0])
    gdpo = decoupled_advantages(terms, weights, "mean", "std", EPS)
    assert gdpo[1, 0] > gdpo[0, 0] * 1.2


def test_decoupled_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match=r"\[B, G, K\]"):
        decoupled_advantages(torch.zeros(2, 4, 3), torch.ones(2), "mean", "std", EPS)


def test_batch_advantages_follow_the_spec():
    rewards, terms = rewards_batch(0), terms_batch(0)
    weights = torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    assert torch.equal(batch_advantages(PRESETS["grpo"], rewards), group_advantages(rewards, "mean", "std", EPS))
    assert torch.equal(
        batch_advantages(PRESETS["gdpo"], rewards, terms, weights),
        decoupled_advantages(terms, weights, "mean", "std", EPS),
    )
    with pytest.raises(ValueError, match="reward terms and their weights"):
        batch_advantages(PRESETS["gdpo"], rewards)


@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 5), g=st.integers(2, 6), k=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_property_both_variants_match_their_references(b, g, k, seed):
    gen = torch.Generator().manual_seed(seed)
    terms = torch.randint(0, 3, (b, g, k), generator=gen).double() / 2
    weights = torch.randint(0, 5, (k,), generator=gen).double() / 4
    got = decoupled_advantages(terms, weights, "mean", "std", EPS)
    want = reference_decoupled_advantages(terms.tolist(), weights.tolist(), "std", EPS)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    rewards = (terms * weights).sum(2)
    got = group_advantages(rewards, "mean", "batch_std", EPS)
    want = reference_batch_std_advantages(rewards.tolist(), "mean", EPS)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-9)
    assert torch.isfinite(got).all()


# ---- TRL 1.16's own lines on the same rewards -----------------------------------------------------------------
class TRLAdvantages:
    """The ``if self.multi_objective_aggregation == "sum_then_normalize": ... else: raise`` block of
    ``GRPOTrainer._generate_and_score_completions`` and ``nanstd`` of trl/trainer/utils.py, taken from the
    installed package's source and run unchanged on a stand-in ``self`` (the method itself generates, scores with
    the models and gathers over processes: it cannot be called on given rewards)."""

    def __init__(self) -> None:
        _, utils = _trl_source("trainer/utils.py")
        self.nanstd = _run([_function(utils, "nanstd")], {"torch": torch})["nanstd"]
        _, grpo = _trl_source("trainer/grpo_trainer.py")
        generate = _function(grpo, "_generate_and_score_completions")
        blocks = [
            n
            for n in ast.walk(generate)
            if isinstance(n, ast.If)
            and ast.unparse(n.test) == "self.multi_objective_aggregation == 'sum_then_normalize'"
        ]
        if len(blocks) != 1 or "normalize_then_sum" not in ast.unparse(blocks[0]):
            pytest.fail("trl: its advantage block moved; this test reads TRL 1.16's")
        self.block = blocks[0]

    def advantages(self, rewards_per_func, weights, num_generations, scale_rewards, aggregation) -> torch.Tensor:
        """TRL's ``advantages`` [N] from ``rewards_per_func`` [N, K] (N = B x G, grouped consecutively)."""
        me = type("Self", (), {})()
        me.multi_objective_aggregation, me.scale_rewards, me.reward_weights = aggregation, scale_rewards, weights
        me.reward_funcs = [None] * rewards_per_func.shape[1]
        space = {
            "self": me,
            "torch": torch,
            "nanstd": self.nanstd,
            "device": "cpu",
            "rewards_per_func": rewards_per_func,
            "num_generations": num_generations,
            "unscorable_mask": torch.isnan(rewards_per_func).all(dim=1),
        }
        _run([self.block], space)
        return space["advantages"]


@pytest.fixture(scope="module")
def trl_advantages() -> TRLAdvantages:
    pytest.importorskip("trl")
    return TRLAdvantages()


TRL_EPS = 1e-4  # TRL's constant
# TRL's nanstd forms Bessel's factor count / (count - 1) from integer counts: a float32 number (relative error up to 6e-8)
RTOL = 1e-7


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_std_matches_trl_scale_rewards_batch(trl_advantages, seed):
    rewards = rewards_batch(seed, groups=6, size=8)
    trl = trl_advantages.advantages(
        rewards.view(-1, 1), torch.ones(1, dtype=torch.float64), 8, "batch", "sum_then_normalize"
    )
    spec = PRESETS["lite_ppo"].override(adv_eps=TRL_EPS)
    ours = batch_advantages(spec, rewards)
    torch.testing.assert_close(ours.flatten(), trl, rtol=RTOL, atol=1e-12)
    # and TRL's group scaling is grpolab's std normalizer (unbiased std + eps), the check has teeth
    group = trl_advantages.advantages(
        rewards.view(-1, 1), torch.ones(1, dtype=torch.float64), 8, "group", "sum_then_normalize"
    )
    torch.testing.assert_close(
        group_advantages(rewards, "mean", "std", TRL_EPS).flatten(), group, rtol=RTOL, atol=1e-12
    )
    assert not torch.allclose(group, trl)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decoupled_matches_trl_normalize_then_sum(trl_advantages, seed):
    b, g, k = 6, 8, 3
    terms, weights = terms_batch(seed, b, g, k), torch.tensor([1.0, 0.5, 2.0], dtype=torch.float64)
    trl = trl_advantages.advantages(terms.view(-1, k), weights, g, "group", "normalize_then_sum")
    ours = batch_advantages(PRESETS["gdpo"].override(adv_eps=TRL_EPS), (terms * weights).sum(2), terms, weights)
    # TRL subtracts the batch mean also from a group with nothing to learn (~1e-17 here); grpolab keeps its 0
    torch.testing.assert_close(ours.flatten(), trl, rtol=RTOL, atol=1e-12)
    assert (ours[1] == 0).all() and trl.view(b, g)[1].abs().max() < 1e-12


# ---- the learner: the global batch's statistics on every rank ------------------------------------------------
def grade(terms: list[float]) -> Grade:
    """A grade of the arithmetic task with truncation shaping: answer reward, and the penalty as a component."""
    answer, penalty = terms
    return Grade(1.0, answer, components=(("truncation_penalty", penalty),), total=answer + penalty)


def rollout_of(terms: torch.Tensor) -> RolloutBatch:
    """A RolloutBatch of B groups x G grades from ``terms`` [B, G, 2] (answer reward, truncation penalty); the
    completions are not read by the advantages."""
    b, g, _ = terms.shape
    grades = [[grade(terms[i, j].tolist()) for j in range(g)] for i in range(b)]
    return RolloutBatch([Example(str(i), "q", "a") for i in range(b)], [[None] * g for _ in range(b)], grades)


def learner(algo: str, ranks: Ranks) -> PolicyLearner:
    """A learner of ``algo`` on a stand-in model (its advantages read the config and the rollout only)."""
    cfg = load_config(
        None,
        {
            "algo": algo,
            "algorithm.rollout_correction": "none",
            "reward.truncation_penalty": 0.5,
            "optim.shared_prompts": False,
        },
    )
    trained = TrainedModel(torch.nn.Linear(2, 2), None, None, torch.device("cpu"), 0)
    return PolicyLearner(cfg, trained, LearnerState({}), ranks=ranks)


def two_term_batch() -> torch.Tensor:
    terms = torch.zeros(4, 4, 2, dtype=torch.float64)
    terms[:, :, 0] = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1], [0, 1, 0, 0]], dtype=torch.float64)
    terms[:, :, 1] = -0.5 * torch.tensor([[0, 1, 1, 0], [0, 0, 0, 1], [0, 0, 0, 0], [1, 1, 0, 1]])
    return terms


@pytest.mark.parametrize("algo", ["lite_ppo", "gdpo"])
def test_two_ranks_train_on_the_global_batch_advantages(algo):
    rollout = rollout_of(two_term_batch())
    single, _, _ = learner(algo, Ranks()).global_advantages(rollout)
    ranked = run_as_threads(2, lambda rank: learner(algo, Ranks.current()).global_advantages(rollout))
    for rank, (advantages, _, part) in enumerate(ranked):
        assert part.groups == range(2 * rank, 2 * rank + 2)
        assert torch.equal(advantages, single)
        assert torch.equal(part.of(advantages), single[2 * rank : 2 * rank + 2])
        # computed from this rank's groups alone, the batch statistics would differ
        local = RolloutBatch(
            rollout.examples[part.groups.start : part.groups.stop],
            part.of(rollout.completions),
            part.of(rollout.grades),
        )
        assert not torch.allclose(learner(algo, Ranks()).advantages(local)[1], part.of(single).float())


def test_the_learner_gives_gdpo_the_reward_terms_and_weights():
    terms = two_term_batch()
    rewards, advantages, _ = learner("gdpo", Ranks()).advantages(rollout_of(terms))
    weights = torch.ones(2, dtype=torch.float64)
    want = reference_decoupled_advantages(terms.tolist(), weights.tolist(), "std", EPS)
    torch.testing.assert_close(advantages.double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rewards.double(), terms.sum(2))


def test_reward_terms_are_read_from_the_grades_and_a_missing_one_is_named():
    rollout = rollout_of(two_term_batch())
    terms = rollout.reward_terms(["answer_reward", "truncation_penalty"])
    assert terms.shape == (4, 4, 2) and torch.equal(terms.double(), two_term_batch())
    with pytest.raises(ValueError, match="reward term 'brevity' is missing .* example 0 sample 0"):
        rollout.reward_terms(["answer_reward", "brevity"])


# ---- presets and refusals ------------------------------------------------------------------------------------
def test_two_grpo_sets_the_group_size_and_refuses_another():
    assert load_config(None, {"algo": "two_grpo"}).rollout.group_size == 2
    assert load_config(None, {"algo": "two_grpo", "rollout.group_size": 2}).rollout.group_size == 2
    with pytest.raises(ConfigError) as err:
        load_config(None, {"algo": "two_grpo", "rollout.group_size": 8})
    assert len(str(err.value).splitlines()) == 1 and "rollout.group_size is 8" in str(err.value)
    # choosing another group size is an explicit override of the algorithm's
    assert load_config(None, {"algo": "two_grpo", "algorithm.group_size": None, "rollout.group_size": 8})
    assert load_config(None, {"algo": "grpo"}).rollout.group_size == 8  # others leave it alone


def test_a_resolved_config_loads_back():
    cfg = load_config(None, {"algo": "two_grpo"})
    again = load_config(None, {**{f"rollout.{k}": v for k, v in cfg.rollout.model_dump().items()}, "algo": "two_grpo"})
    assert again.rollout.group_size == 2


@pytest.mark.parametrize(
    "overrides,says",
    [
        ({}, "single weighted term (answer_reward)"),
        ({"task.name": "tests.custom_task:Custom"}, "a task class of your own"),
    ],
)
def test_gdpo_without_terms_to_decouple_is_refused(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config(None, {"algo": "gdpo", **overrides})
    assert len(str(err.value).splitlines()) == 1 and says in str(err.value), str(err.value)
    assert load_config(None, {"algo": "gdpo", "reward.overlong_buffer": 8}).reward_weights() == {
        "answer_reward": 1.0,
        "overlong_penalty": 1.0,
    }


DATASET = {"task.name": "dataset", "task.train": "train.jsonl", "task.validation_size": 4, "model.path": "model"}


def test_gdpo_weights_of_a_dataset_task_are_its_rewards():
    cfg = load_config(
        None,
        {
            "algo": "gdpo",
            **DATASET,
            "task.rewards": [{"function": "numeric"}, {"function": "reward_fns:brevity", "weight": 0.25}],
        },
    )
    assert cfg.reward_weights() == {"numeric": 1.0, "brevity": 0.25}


def test_gdpo_refuses_a_clipped_reward_model(reward_model_dir):
    rewards = [
        {"function": "numeric"},
        {"function": f"model:{reward_model_dir}", "name": "rm", "weight": 0.5, "options": {"clip": 2.0}},
    ]
    settings = {"algo": "gdpo", **DATASET, "task.rewards": rewards}
    with pytest.raises(ConfigError) as err:
        load_config(None, settings)
    assert len(str(err.value).splitlines()) == 1 and "reward model 'rm'" in str(err.value), str(err.value)
    rewards[1]["options"] = {"normalize": "batch"}
    assert load_config(None, settings).reward_weights() == {"numeric": 1.0, "rm": 0.5}


@pytest.mark.parametrize("overrides", [{"normalizer": "mean"}, {"normalizer": "batch_std"}, {"baseline": "none"}])
def test_gdpo_refuses_other_group_normalizations(overrides):
    with pytest.raises(ValueError, match="normalize_then_sum"):
        get_algorithm("gdpo", **overrides)


def test_formulas_name_the_advantage():
    assert PRESETS["lite_ppo"].formula().endswith("A = (r - mean_i(r)) / (std_batch(r) + eps)")
    assert "whiten_batch( sum_k w_k" in PRESETS["gdpo"].formula()
    assert PRESETS["two_grpo"].formula().endswith("A = (r - mean_i(r)) / (std_i(r) + eps), G = 2")
    assert PRESETS["grpo"].advantage_formula() == ""


def test_grpolab_algorithms_lists_the_variants_with_their_formulas(capsys):
    assert main(["algorithms"]) in (0, None)
    out = capsys.readouterr().out
    for name in ("lite_ppo", "gdpo", "two_grpo"):
        line = next(line for line in out.splitlines() if line.startswith(name))
        formula = out.splitlines()[out.splitlines().index(line) + 1]
        assert PRESETS[name].advantage_formula() in formula, formula
    assert "each reward term normalized apart" in out and "group size 2" in out


@pytest.mark.parametrize(
    "args,says",
    [
        (["--algo", "two_grpo", "--rollout.group_size", "8"], "rollout.group_size is 8"),
        (["--algo", "gdpo"], "nothing to decouple"),
    ],
)
def test_the_command_line_refuses_in_one_line_before_anything_is_written(args, says, tmp_path, capsys):
    code = main(["train", *args, "--output_dir", str(tmp_path / "run"), "--steps", "1"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert code != 0 and len(lines) == 1 and says in lines[0], lines
    assert not (tmp_path / "run").exists()
