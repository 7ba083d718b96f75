"""Algorithms as small declarative specs.

An algorithm is an :class:`AlgorithmSpec`: how advantages are formed (baseline, normalizer), how each
token is weighted (weight, eps_low, eps_high), how the per-token losses are reduced (aggregation), the
KL penalty, and the update schedule (epochs x optimizer steps per epoch over one rollout batch).
The trainer reads the fields; it never looks at the name. Adding an algorithm = one preset + its tests.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Baseline = Literal["mean", "none"]
Normalizer = Literal["std", "mean", "none"]
Weight = Literal["none", "noclip", "clip", "gspo", "cispo"]
Aggregation = Literal["sequence", "token", "constant"]
RolloutCorrection = Literal[
    "none",
    "token_truncate",
    "sequence_truncate",
    "geometric_truncate",
    "token_mask",
    "sequence_mask",
    "geometric_mask",
    "icepop",
]
# the setting: a mode, or "auto" (the run picks one when it starts: rollout_correction.resolve_rollout_correction)
RolloutCorrectionSetting = Literal["auto", RolloutCorrection]
# the old spelling of the rollout correction (config.json of runs from older commits): field -> (new field, values)
OLD_SPELLING: dict[str, tuple[str, dict[str, str]]] = {
    "engine_correction": (
        "rollout_correction",
        {"none": "none", "token": "token_truncate", "sequence": "sequence_truncate"},
    ),
    "engine_correction_cap": ("rollout_correction_upper", {}),
}

# One-line formula of each per-token weighting (w = exp(logp - logp_old), s = sequence ratio).
WEIGHT_FORMULAS: dict[str, str] = {
    "none": "-A * logp  (REINFORCE)",
    "noclip": "-A * w",
    "clip": "-min(w*A, clip(w, 1-eps_low, 1+eps_high)*A)",
    "gspo": "-min(s*A, clip(s, 1-eps_low, 1+eps_high)*A), s = exp(mean_t(logp - logp_old))",
    "cispo": "-sg(min(w, 1+eps_high)) * A * logp",
}
# on-policy distillation's per-token advantage (A: the task's sequence advantage)
DISTILL_FORMULA = "A_t = reward_coef*A + teacher_kl_coef*(logp_teacher - logp_old)"
AGGREGATION_FORMULAS: dict[str, str] = {
    "sequence": "mean_i( sum_t l*m / sum_t m )",
    "token": "sum l*m / sum m",
    "constant": "sum l*m / Z",
}


class UnknownAlgorithmError(ValueError):
    """The requested preset name does not exist."""


def translate_old_spelling(fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` with ``engine_correction`` (none / token / sequence) and ``engine_correction_cap`` renamed to
    ``rollout_correction`` (none / token_truncate / sequence_truncate) and ``rollout_correction_upper``; a
    ValueError when both spellings are given with different values."""
    if not any(old in fields for old in OLD_SPELLING):
        return fields
    out = dict(fields)
    for old, (new, values) in OLD_SPELLING.items():
        if old not in out:
            continue
        value = out.pop(old)
        value = values.get(value, value) if isinstance(value, str) else value
        if new in out and out[new] != value:
            raise ValueError(f"{old} is the old spelling of {new}; give only {new}")
        out[new] = value
    return out


class AlgorithmSpec(BaseModel):
    """Every setting that decides what an update computes. Frozen; derive variants with ``override``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(description="the preset this spec starts from (grpolab algorithms lists them)")
    reference: str = Field("", description="where the algorithm is published (informational)")
    # advantages
    baseline: Baseline = Field("mean", description="subtracted from each reward: the group mean, or none")
    normalizer: Normalizer = Field(
        "std", description="the advantage is divided by the group's std, its mean (MaxRL), or nothing"
    )
    adv_eps: float = Field(1e-6, ge=0, description="added to the normalizer's denominator")
    # per-token weighting
    weight: Weight = Field(
        "clip",
        description="each token's weight: none (REINFORCE), noclip (importance ratio), clip (PPO), gspo "
        "(sequence ratio, clipped), cispo (clipped, stop-gradient ratio)",
    )
    eps_low: float = Field(0.2, ge=0, lt=1, description="clip range below 1: the ratio's floor is 1 - eps_low")
    eps_high: float = Field(0.2, gt=0, description="clip range above 1: the ratio's ceiling is 1 + eps_high")
    # reduction over the response mask
    aggregation: Aggregation = Field(
        "sequence",
        description="per-token losses reduced as a mean per sequence then over sequences (sequence), "
        "a mean over all tokens (token), or a sum over a constant Z (constant)",
    )
    loss_denominator: float | None = Field(
        None, gt=0, description="Z for aggregation=constant; default = sequences per step x max new tokens"
    )
    # the rollout engine / trainer mismatch (grpolab.objectives.rollout_correction): each token's surrogate times
    # a detached weight from r = pi_old / pi_engine, and tokens or sequences dropped outside a band; "auto" by
    # default: none where engine and trainer agree, token_truncate where they cannot (docs/algorithms.md says why)
    rollout_correction: RolloutCorrectionSetting = Field(
        "auto",
        description="the engine / trainer mismatch correction from r = pi_old / pi_engine: token_truncate, "
        "sequence_truncate, geometric_truncate (weight clipped into [lower, upper]; r, its product or geometric "
        "mean over the sequence), token_mask, sequence_mask, geometric_mask (dropped outside [lower, upper]), "
        "icepop (token_mask with a required lower bound), none; auto = none when the engine samples in float32 "
        "from the current weights, token_truncate (TIS) when it samples in bfloat16 or from stale weights "
        "(the run's config.json records the choice)",
    )
    rollout_correction_upper: float = Field(
        2.0, gt=0, description="rollout_correction's cap (truncation) or upper bound (masking)"
    )
    rollout_correction_lower: float | None = Field(
        None,
        ge=0,
        description="rollout_correction's floor (truncation) or lower bound (masking); none = no lower bound",
    )
    off_policy_mask_delta: float | None = Field(
        None,
        ge=0,
        description="DeepSeek-V3.2's off-policy sequence mask: a sequence with negative advantage is dropped when its "
        "mean per-token log(pi_sampling / pi_current) exceeds this; none = off",
    )
    # KL penalty to a reference policy (k3), reduced as a per-token mean over each optimizer step
    beta: float = Field(
        0.0, ge=0, description="KL penalty (k3) to the frozen reference, a per-token mean; > 0 loads the reference"
    )
    # schedule over one rollout batch
    epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    steps_per_epoch: int = Field(1, ge=1, description="optimizer steps per pass (the batch split into minibatches)")
    shuffle_minibatches: bool = Field(
        True, description="shuffle the batch before each pass's minibatches (with more than one step per pass)"
    )
    # Rollout Routing Replay (MoE policies): every training forward routes each token to the experts chosen where
    # the behaviour log-probs were computed (the hf engine's generation, else the old-log-prob forward; the
    # weights stay live)
    routing_replay: bool = Field(
        False,
        description="MoE policies: every training forward routes each token to the experts chosen where its "
        "behaviour log-probs were computed (Rollout Routing Replay)",
    )
    # on-policy distillation (part: opd; grpolab.objectives.distillation): each sampled token's advantage is
    # reward_coef * A_i + teacher_kl_coef * (log pi_teacher - log pi_old), the frozen teacher of the run's [teacher]
    teacher_kl_coef: float = Field(
        0.0,
        ge=0,
        description="on-policy distillation: each sampled token's advantage gets this times minus the reverse KL "
        "of the sampling policy to the frozen teacher at that token, log pi_teacher - log pi_old (tinker's "
        "kl_penalty_coef, discount 0); > 0 needs teacher.path",
    )
    reward_coef: float = Field(
        1.0,
        ge=0,
        description="with teacher_kl_coef > 0: the task's sequence advantage enters each token's advantage times "
        "this (0 = pure distillation, the opd preset)",
    )
    # rollout-side behaviour: DAPO's dynamic sampling keeps the groups whose correctness (the task's answer
    # reward) is not all equal, 0 < #correct < G as in the paper, or with "reward" whose RL rewards (length
    # shaping and reward models included) are not all equal
    dynamic_sampling: bool = Field(
        False, description="DAPO's dynamic sampling: resample until the batch holds only groups that differ"
    )
    dynamic_sampling_filter: Literal["correct", "reward"] = Field(
        "correct",
        description="which groups dynamic sampling keeps: those whose correctness is not all equal "
        "(0 < #correct < G), or those whose RL rewards are not all equal",
    )
    max_resample_rounds: int = Field(3, ge=0, description="dynamic sampling's extra generation rounds per step")
    prune_zero_advantage: bool = Field(
        True,
        description="sequences whose advantage is 0 (no gradient) stay out of the training forward and backward; "
        "never with a KL term",
    )

    @model_validator(mode="before")
    @classmethod
    def _old_spelling(cls, data: Any) -> Any:
        return translate_old_spelling(data) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check(self) -> AlgorithmSpec:
        if self.normalizer == "mean" and self.baseline != "mean":
            raise ValueError("normalizer 'mean' (MaxRL) needs baseline 'mean'")
        lower, upper = self.rollout_correction_lower, self.rollout_correction_upper
        if lower is not None and lower >= upper:
            raise ValueError(
                f"rollout_correction_lower {lower} must be below rollout_correction_upper {upper}; "
                "lower the one or raise the other"
            )
        if self.rollout_correction == "icepop" and lower is None:
            raise ValueError("rollout_correction icepop needs rollout_correction_lower (a two-sided band, e.g. 0.5)")
        if self.reward_coef != 1.0 and not self.needs_teacher:
            raise ValueError(
                f"reward_coef {self.reward_coef:g} scales the task advantage beside the teacher's term; it needs "
                "teacher_kl_coef > 0 (e.g. --algo opd)"
            )
        if self.needs_teacher and self.off_policy_mask_delta is not None:
            raise ValueError(
                "off_policy_mask_delta drops sequences by the sign of their advantage, and on-policy distillation "
                "gives each token its own; drop off_policy_mask_delta or teacher_kl_coef"
            )
        if self.needs_teacher and self.dynamic_sampling and not self.reward_coef:
            raise ValueError(
                "dynamic_sampling drops groups whose task rewards are all equal, which pure distillation (reward_coef "
                "0) does not read: every group has the teacher's signal; drop dynamic_sampling or set reward_coef"
            )
        return self

    @property
    def is_single_update(self) -> bool:
        """One optimizer step per rollout batch: the update's ratio is exactly 1."""
        return self.epochs * self.steps_per_epoch == 1

    @property
    def needs_teacher(self) -> bool:
        """On-policy distillation: the update reads a frozen teacher's log-probs of the sampled tokens."""
        return self.teacher_kl_coef > 0

    def formula(self) -> str:
        weight = WEIGHT_FORMULAS[self.weight]
        if self.needs_teacher:  # each token's own advantage A_t
            weight = re.sub(r"\bA\b", "A_t", weight) + ", " + DISTILL_FORMULA
        return f"{weight}; reduced {AGGREGATION_FORMULAS[self.aggregation]}"

    def override(self, **changes: Any) -> AlgorithmSpec:
        """A validated copy with some fields changed (unknown fields and bad values raise)."""
        return AlgorithmSpec.model_validate({**self.model_dump(), **translate_old_spelling(changes)})


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
        # part opd: on-policy distillation as Thinking Machines (2025) publish it: per-token advantage -(log pi_old
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
