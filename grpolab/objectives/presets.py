"""The presets: each published objective as an ``AlgorithmSpec`` (``grpolab algorithms`` lists them; docs/algorithms.md
has each one's formula, paper and where the peers' implementations differ). Adding an algorithm = one preset + its
float64 reference test.
"""

from __future__ import annotations

from typing import Any

from grpolab.objectives.algorithms import AlgorithmSpec


class UnknownAlgorithmError(ValueError):
    """The requested preset name does not exist."""


_OFFPOLICY = dict(epochs=1, steps_per_epoch=32)

PRESETS: dict[str, AlgorithmSpec] = {
    spec.name: spec
    for spec in [
        AlgorithmSpec(name="grpo", reference="DeepSeekMath (Shao et al., 2024)"),
        AlgorithmSpec(
            name="grpo_constant",
            aggregation="constant",
            reference="GRPO advantages with Dr. GRPO's constant denominator",
        ),
        AlgorithmSpec(
            name="dr_grpo",
            normalizer="none",
            aggregation="constant",
            reference="Understanding R1-Zero-Like Training (Liu et al., 2025)",
        ),
        AlgorithmSpec(
            name="rft",
            baseline="none",
            normalizer="none",
            weight="none",
            aggregation="constant",
            reference="Rejection-sampling fine-tuning (RAFT / STaR style)",
        ),
        AlgorithmSpec(
            name="maxrl",
            normalizer="mean",
            aggregation="constant",
            reference="MaxRL (Tajwar et al., 2026, arXiv 2602.02710)",
        ),
        # the paper (sec. 5.1): each rollout batch partitioned into four minibatches, one optimizer step each;
        # left and right clipping ranges 3e-4 and 4e-4
        AlgorithmSpec(
            name="gspo",
            weight="gspo",
            eps_low=3e-4,
            eps_high=4e-4,
            steps_per_epoch=4,
            reference="Group Sequence Policy Optimization (Zheng et al., 2025)",
        ),
        AlgorithmSpec(
            name="cispo",
            weight="cispo",
            eps_high=5.0,
            aggregation="token",
            epochs=4,
            reference="MiniMax-M1 (MiniMax, 2025)",
        ),
        AlgorithmSpec(
            name="dapo",
            eps_low=0.2,
            eps_high=0.28,
            aggregation="token",
            dynamic_sampling=True,
            reference="DAPO (Yu et al., 2025)",
        ),
        AlgorithmSpec(
            name="offpolicy_naive",
            weight="none",
            **_OFFPOLICY,
            reference="REINFORCE on stale samples (baseline for the off-policy family)",
        ),
        AlgorithmSpec(
            name="offpolicy_noclip", weight="noclip", **_OFFPOLICY, reference="Unclipped importance sampling"
        ),
        AlgorithmSpec(
            name="offpolicy_clip",
            weight="clip",
            **_OFFPOLICY,
            reference="PPO clip (Schulman et al., 2017) over many steps",
        ),
        AlgorithmSpec(
            name="offpolicy_gspo",
            weight="gspo",
            eps_low=3e-4,
            eps_high=3e-4,
            **_OFFPOLICY,
            reference="GSPO over many steps",
        ),
        # TRL's loss types (docs/algorithms.md, "TRL's loss types"): SAPO, BNPO, LUSPO, VESPO, two-sided clip
        AlgorithmSpec(
            name="sapo",
            weight="sapo",
            steps_per_epoch=4,  # the gate differs from GRPO's only off-policy: four minibatches, as gspo
            reference="Soft Adaptive Policy Optimization (Gao et al., Qwen, 2025, arXiv 2511.20347)",
        ),
        AlgorithmSpec(
            name="bnpo",
            normalizer="beta_density",
            eps_high=0.28,
            aggregation="sequence_sum",  # the authors' run: clip 0.2 / 0.28, verl's seq-mean-token-sum
            reference="BNPO: Beta Normalization Policy Optimization (Xiao et al., 2025, arXiv 2506.02864)",
        ),
        AlgorithmSpec(
            name="luspo",
            weight="gspo",
            eps_low=3e-4,
            eps_high=4e-4,
            aggregation="sequence_sum",
            steps_per_epoch=4,  # GSPO's setup (our gspo preset), its loss scaled by each sequence's length
            reference="Length-Unbiased Sequence Policy Optimization (Liu et al., 2026, arXiv 2602.05261)",
        ),
        AlgorithmSpec(
            name="vespo",
            weight="vespo",
            aggregation="token",  # TRL's reduction for vespo
            steps_per_epoch=4,  # the weight differs from REINFORCE's only off-policy: four minibatches, as gspo
            reference="VESPO (Shen et al., 2026, arXiv 2602.10693)",
        ),
        AlgorithmSpec(
            name="intellect2",
            clip_delta=4.0,
            reference="INTELLECT-2 (Prime Intellect, 2025, arXiv 2505.07291): GRPO with a two-sided clip, delta 4",
        ),
        # verl's and prime-rl's losses (docs/algorithms.md, "verl's and prime-rl's losses")
        # GMPO: the paper's clip range (e^-0.4, e^0.4), set in log space; a mean over sequences
        AlgorithmSpec(
            name="gmpo",
            weight="gmpo",
            eps_low=0.4,
            eps_high=0.4,
            reference="Geometric-Mean Policy Optimization (Zhao et al., 2025, arXiv 2507.20673); verl geo_mean",
        ),
        # GPG: REINFORCE on r - mean (F_norm = 1) times B / B_valid, a mean over all tokens
        AlgorithmSpec(
            name="gpg",
            normalizer="none",
            weight="none",
            aggregation="token",
            valid_rescale=True,
            reference="GPG: Group Policy Gradient (Chu et al., 2025, arXiv 2504.02546); verl gpg",
        ),
        # DPPO-Binary-TV as verl runs it: thresholds 0.2 (verl's clip_ratio), ratio capped at 20 (clip_ratio_c)
        AlgorithmSpec(
            name="dppo",
            weight="dppo",
            ratio_cap=20.0,
            aggregation="token",
            reference="DPPO (Qi et al., 2026, arXiv 2602.04879), Binary-TV; verl dppo_tv",
        ),
        # prime-rl's default loss (DefaultLossConfig): DPPO mask 0.2 / 0.2, no cap, kl_tau 1e-3, A = r - mean, a
        # mean over the tokens of the sequences whose advantage is not 0 (its orchestrator drops the others)
        AlgorithmSpec(
            name="prime_rl",
            normalizer="none",
            weight="dppo",
            aggregation="token",
            kl_tau=1e-3,
            filter_zero_advantages=True,
            reference="prime-rl's default loss: DPPO-Binary-TV + Kimi K2.5's squared log-ratio (prime-rl, 2026)",
        ),
        # advantage variants (docs/algorithms.md, "Advantage variants")
        # Lite PPO: the paper's two techniques on the vanilla (critic-free) PPO clip loss: the group's mean over
        # the batch's std, and token-level aggregation
        AlgorithmSpec(
            name="lite_ppo",
            normalizer="batch_std",
            aggregation="token",
            reference="Tricks or Traps? A Deep Dive into RL for LLM Reasoning (Liu et al., 2025), Lite PPO",
        ),
        AlgorithmSpec(
            name="gdpo",
            multi_objective_aggregation="normalize_then_sum",
            reference="GDPO: Group reward-Decoupled Normalization Policy Optimization (Liu et al., NVIDIA, 2026)",
        ),
        AlgorithmSpec(
            name="two_grpo",
            group_size=2,
            reference="It Takes Two: Your GRPO Is Secretly DPO (Wu et al., 2025), 2-GRPO",
        ),
        # token selection and entropy (docs/algorithms.md, "Token selection and entropy")
        # Beyond the 80/20 Rule (Wang et al., 2025): DAPO's recipe, the gradient on the top 20% of tokens by entropy
        AlgorithmSpec(
            name="dapo_8020",
            eps_low=0.2,
            eps_high=0.28,
            aggregation="token",
            dynamic_sampling=True,
            top_entropy_quantile=0.2,
            reference="Beyond the 80/20 Rule (Wang et al., 2025)",
        ),
        # The Entropy Mechanism of RL for Reasoning LMs (Cui et al., 2025): token-mean PPO clip 0.2, 8 mini-batch
        # steps per rollout batch (256 prompts, mini-batches of 32); Clip-Cov's ratio 2e-4 in the band (1, 5)
        AlgorithmSpec(
            name="clip_cov",
            aggregation="token",
            steps_per_epoch=8,
            cov_selection="clip_cov",
            reference="Clip-Cov, The Entropy Mechanism of RL for Reasoning LMs (Cui et al., 2025)",
        ),
        # the same paper's KL-Cov: the unclipped ratio, |logp - logp_old| (coefficient 1) on the top 2e-3 by covariance
        AlgorithmSpec(
            name="kl_cov",
            weight="noclip",
            aggregation="token",
            steps_per_epoch=8,
            cov_selection="kl_cov",
            reference="KL-Cov, The Entropy Mechanism of RL for Reasoning LMs (Cui et al., 2025)",
        ),
        # on-policy distillation (docs/algorithms.md, "On-policy distillation"): on-policy distillation as Thinking Machines (2025) publish it: per-token advantage -(log pi_old
        # - log pi_teacher), no discount, no task reward, importance-sampling loss, a mean over the step's tokens
        AlgorithmSpec(
            name="opd",
            weight="noclip",
            aggregation="token",
            teacher_kl_coef=1.0,
            reward_coef=0.0,
            reference="On-Policy Distillation (Agarwal et al., 2024; Thinking Machines, 2025)",
        ),
    ]
}


def get_algorithm(name: str, **overrides: Any) -> AlgorithmSpec:
    """The preset called ``name`` with ``overrides`` applied and validated."""
    if name not in PRESETS:
        raise UnknownAlgorithmError(f"unknown algorithm {name!r}; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name].override(**overrides) if overrides else PRESETS[name]
