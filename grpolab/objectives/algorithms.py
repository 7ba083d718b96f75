"""Algorithms as small declarative specs.

An algorithm is an :class:`AlgorithmSpec`: how advantages are formed (baseline, normalizer), how each
token is weighted (weight, eps_low, eps_high), how the per-token losses are reduced (aggregation), the
KL penalty, and the update schedule (epochs x optimizer steps per epoch over one rollout batch).
The trainer reads the fields; it never looks at the name. The presets are in ``presets.py``; the weights, with
the fields each reads, its checks and its formula, in ``surrogates/``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from grpolab.objectives.selection_rules import check_token_selection, token_selection_formula
from grpolab.objectives.surrogates import SURROGATES, get_surrogate, unread_parameter

Baseline = Literal["mean", "none"]
Normalizer = Literal["std", "mean", "none", "beta_density", "batch_std"]
MultiObjectiveAggregation = Literal["sum_then_normalize", "normalize_then_sum"]
Weight = Literal[tuple(SURROGATES)]  # the weights registered when this module is imported, in their order
Aggregation = Literal["sequence", "token", "constant", "sequence_sum"]
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
CovSelection = Literal["none", "clip_cov", "kl_cov"]
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

# on-policy distillation's per-token advantage (A: the task's sequence advantage)
DISTILL_FORMULA = "A_t = reward_coef*A + teacher_kl_coef*(logp_teacher - logp_old)"
AGGREGATION_FORMULAS: dict[str, str] = {
    "sequence": "mean_i( sum_t l*m / sum_t m )",
    "token": "sum l*m / sum m",
    "constant": "sum l*m / Z",
    "sequence_sum": "mean_i( sum_t l*m )",
}
# advantages whose formula is not GRPO's (r - mean) / std: their line in ``formula()``
NORMALIZER_FORMULAS: dict[str, str] = {
    "beta_density": "A = (r - p) / Beta(p; a, b) density, p = group mean, a, b fitted to the batch's p (BNPO)",
}


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
        "std",
        description="the advantage is divided by the group's std, its mean (MaxRL), nothing, the Beta density "
        "of the group's mean reward fitted over the batch (beta_density: BNPO, rewards in [0, 1]), or the std of "
        "every reward of the batch (batch_std, Lite PPO)",
    )
    adv_eps: float = Field(1e-6, ge=0, description="added to the normalizer's denominator")
    # advantage variants (docs/algorithms.md, "Advantage variants"): Lite PPO's batch_std normalizer (above), GDPO's
    # decoupled reward terms, 2-GRPO's group size (the config resolves it into rollout.group_size)
    multi_objective_aggregation: MultiObjectiveAggregation = Field(
        "sum_then_normalize",
        description="sum_then_normalize: the advantage of the RL reward (the weighted sum of its terms); "
        "normalize_then_sum (GDPO): each reward term normalized within its group, their weighted sum whitened "
        "over the batch (TRL's name and values)",
    )
    group_size: int | None = Field(
        None,
        ge=2,
        description="the rollout.group_size this algorithm is defined with (2-GRPO: 2), set into the rollout "
        "config (an explicit, different rollout.group_size is refused); None: rollout.group_size decides",
    )
    # per-token weighting
    weight: Weight = Field(
        "clip",
        description="each token's weight: " + ", ".join(f"{s.name} ({s.summary})" for s in SURROGATES.values()),
    )
    eps_low: float = Field(0.2, ge=0, lt=1, description="clip range below 1: the ratio's floor is 1 - eps_low")
    # verl's and prime-rl's losses (GMPO, GPG, DPPO, prime-rl's default; docs/algorithms.md): weight gmpo reads
    # eps_low / eps_high as log-ratio bounds, weight dppo as bounds on the sampled token's probability change
    ratio_cap: float | None = Field(
        None,
        gt=1,
        description="weight dppo: the ratio pi / pi_old truncated from above at this cap (value min(r, cap), "
        "gradient min(r, cap) x grad log pi; verl's clip_ratio_c); none = no cap",
    )
    kl_tau: float = Field(
        0.0,
        ge=0,
        description="adds kl_tau x the per-token mean of (log pi / pi_old)^2 over each optimizer step: prime-rl's "
        "kl_tau (Kimi K2.5's penalty toward the sampling policy; beta is the one toward the reference)",
    )
    valid_rescale: bool = Field(
        False,
        description="advantages times B / B_valid: the rollout batch's samples over those in groups whose rewards "
        "are not all equal (GPG's alpha); needs baseline mean",
    )
    filter_zero_advantages: bool = Field(
        False,
        description="zero-advantage sequences leave each optimizer step: out of every loss term (kl_tau's and "
        "beta's too) and every denominator (prime-rl's orchestrator setting of that name)",
    )
    eps_high: float = Field(0.2, gt=0, description="clip range above 1: the ratio's ceiling is 1 + eps_high")
    # TRL's loss types (docs/algorithms.md, "TRL's loss types"): INTELLECT-2's two-sided clip, SAPO's gate
    # temperatures and VESPO's gamma weight, each named as TRL's GRPOConfig names it
    clip_delta: float | None = Field(
        None,
        gt=1,
        description="INTELLECT-2's two-sided clip (TRL: delta): the unclipped term's ratio is capped at this, so a "
        "negative-advantage token's loss stays bounded; weight clip or gspo, above 1 + eps_high; none = off",
    )
    sapo_temperature_pos: float = Field(
        1.0, gt=0, description="SAPO's gate temperature for positive advantages (weight sapo)"
    )
    sapo_temperature_neg: float = Field(
        1.05, gt=0, description="SAPO's gate temperature for negative and zero advantages (weight sapo)"
    )
    vespo_k_pos: float = Field(2.0, ge=0, description="VESPO's shape k for advantages >= 0 (weight vespo)")
    vespo_lambda_pos: float = Field(3.0, gt=0, description="VESPO's rate lambda for advantages >= 0 (weight vespo)")
    vespo_k_neg: float = Field(3.0, ge=0, description="VESPO's shape k for negative advantages (weight vespo)")
    vespo_lambda_neg: float = Field(2.0, gt=0, description="VESPO's rate lambda for negative advantages (weight vespo)")
    # reduction over the response mask
    aggregation: Aggregation = Field(
        "sequence",
        description="per-token losses reduced as a mean per sequence then over sequences (sequence), "
        "a mean over all tokens (token), a sum over a constant Z (constant), or a sum per sequence then a mean "
        "over sequences (sequence_sum: LUSPO's length-scaled sequence loss)",
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
    use_bias_correction_kl: bool = Field(
        False,
        description="each token's k3 times the ratio pi / pi_old (with its gradient): DeepSeek-V3.2's unbiased "
        "estimate of the KL's gradient from samples of pi_old (TRL's use_bias_correction_kl, on there by default); "
        "needs beta > 0",
    )
    # token selection and entropy (grpolab.objectives.token_selection): 80/20 high-entropy
    # tokens, Clip-Cov, KL-Cov, each decided over the whole optimizer step; the entropy bonus with Skywork-OR1's
    # adaptive coefficient. Names as TRL's (top_entropy_quantile, entropy_coef, ...) and verl's (clip_cov_*, kl_cov_*)
    top_entropy_quantile: float = Field(
        1.0,
        gt=0,
        le=1,
        description="the policy gradient only on this top fraction of the step's response tokens by entropy "
        "(80/20: 0.2); 1 = every token",
    )
    cov_selection: CovSelection = Field(
        "none",
        description="tokens picked by the covariance of log-prob and advantage over the step: clip_cov (a random "
        "clip_cov_ratio of those with clip_cov_lb < cov < clip_cov_ub lose their gradient), kl_cov (the top "
        "kl_cov_ratio get kl_cov_coef x |logp - logp_old|), none",
    )
    clip_cov_ratio: float = Field(2e-4, gt=0, le=1, description="Clip-Cov: fraction of the step's tokens detached")
    clip_cov_lb: float = Field(1.0, description="Clip-Cov: the covariance band's lower bound (exclusive)")
    clip_cov_ub: float = Field(5.0, description="Clip-Cov: the covariance band's upper bound (exclusive)")
    kl_cov_ratio: float = Field(2e-3, gt=0, le=1, description="KL-Cov: fraction of the step's tokens penalised")
    kl_cov_coef: float = Field(1.0, ge=0, description="KL-Cov: the |logp - logp_old| penalty's coefficient")
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="entropy bonus: minus this times the mean token entropy of the step (the start value "
        "with use_adaptive_entropy)",
    )
    use_adaptive_entropy: bool = Field(
        False,
        description="Skywork-OR1's adaptive entropy coefficient: after each optimizer step it rises by "
        "entropy_coef_delta when the step's entropy is at or below entropy_target, else falls; applied only "
        "while the last step's entropy was at or below the target",
    )
    entropy_target: float = Field(0.2, ge=0, description="adaptive entropy: the target mean token entropy (nats)")
    entropy_coef_delta: float = Field(0.005, ge=0, description="adaptive entropy: the coefficient's step")
    entropy_coef_min: float = Field(0.0, ge=0, description="adaptive entropy: the coefficient's floor")
    entropy_coef_max: float = Field(1.0, ge=0, description="adaptive entropy: the coefficient's ceiling")
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
    # on-policy distillation (grpolab.objectives.distillation): each sampled token's advantage is
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
        self._check_advantages()
        lower, upper = self.rollout_correction_lower, self.rollout_correction_upper
        if lower is not None and lower >= upper:
            raise ValueError(
                f"rollout_correction_lower {lower} must be below rollout_correction_upper {upper}; "
                "lower the one or raise the other"
            )
        if self.use_bias_correction_kl and self.beta == 0:
            raise ValueError("use_bias_correction_kl corrects the KL penalty; it needs beta > 0 (e.g. 0.001)")
        if self.rollout_correction == "icepop" and lower is None:
            raise ValueError("rollout_correction icepop needs rollout_correction_lower (a two-sided band, e.g. 0.5)")
        self._check_weight()
        check_token_selection(self)
        self._check_teacher()
        return self

    def _check_advantages(self) -> None:
        """The advantage settings that need the group mean subtracted, or a normalizer GDPO can apply per term."""
        if self.normalizer == "mean" and self.baseline != "mean":
            raise ValueError("normalizer 'mean' (MaxRL) needs baseline 'mean'")
        if self.multi_objective_aggregation == "normalize_then_sum" and (
            self.baseline != "mean" or self.normalizer not in ("std", "none")
        ):
            raise ValueError(
                "multi_objective_aggregation 'normalize_then_sum' (GDPO) normalizes each reward term within its "
                f"group: it needs baseline 'mean' and normalizer 'std' or 'none', not {self.baseline!r} and "
                f"{self.normalizer!r}"
            )
        if self.normalizer == "beta_density" and self.baseline != "mean":
            raise ValueError(
                "normalizer 'beta_density' (BNPO) divides r - (group mean) by a density: it needs baseline 'mean'"
            )
        if self.valid_rescale and self.baseline != "mean":
            raise ValueError(
                "valid_rescale (GPG's B / B_valid) needs baseline 'mean' (without it all-equal groups still carry "
                "a gradient): use baseline mean or valid_rescale false"
            )

    def _check_weight(self) -> None:
        """The weight's settings, each refused in one line: a field another weight reads set away from its default
        (the one rule for every weight's own fields), the weight's own check, and a rollout correction it cannot
        fold into its weight (``grpolab.objectives.surrogates``)."""
        weight = get_surrogate(self.weight)
        defaults = type(self).model_fields
        unread = unread_parameter(self.weight, {k: v for k, v in self if v != defaults[k].default})
        if unread is not None:
            raise ValueError(unread)
        if weight.check is not None:
            weight.check(**weight.parameters(self))
        folded = weight.folds_correction
        if folded is not None and self.rollout_correction not in ("auto", "none", folded):
            raise ValueError(
                f"weight {self.weight} folds the rollout correction's per-token weight into its own (as TRL does), "
                f"which {self.rollout_correction} does not give; use rollout_correction {folded}, auto or none"
            )

    def _check_teacher(self) -> None:
        """On-policy distillation's settings that mean nothing without a teacher, or clash with its per-token
        advantages."""
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

    @property
    def is_single_update(self) -> bool:
        """One optimizer step per rollout batch: the update's ratio is exactly 1."""
        return self.epochs * self.steps_per_epoch == 1

    @property
    def needs_teacher(self) -> bool:
        """On-policy distillation: the update reads a frozen teacher's log-probs of the sampled tokens."""
        return self.teacher_kl_coef > 0

    def formula(self) -> str:
        weight = get_surrogate(self.weight).formula_line(self)
        if self.needs_teacher:  # each token's own advantage A_t
            weight = re.sub(r"\bA\b", "A_t", weight) + ", " + DISTILL_FORMULA
        loss = f"{weight}; reduced {AGGREGATION_FORMULAS[self.aggregation]}" + self._penalty_terms()
        advantage = self.advantage_formula()
        loss += token_selection_formula(self)
        return f"{loss}; {advantage}" if advantage else loss

    def _penalty_terms(self) -> str:
        """The formula's terms from verl's and prime-rl's losses: kl_tau, GPG's rescaling, zero advantages left out."""
        terms = [f" + {self.kl_tau:g} * mean_t (log w)^2"] if self.kl_tau else []
        terms += ["; A *= B / B_valid"] if self.valid_rescale else []
        terms += ["; rows with A = 0 left out"] if self.filter_zero_advantages else []
        return "".join(terms)

    def advantage_formula(self) -> str:
        """The advantage where it is not GRPO's family's (r - mean_i) / std_i; empty otherwise."""
        group = f", G = {self.group_size}" if self.group_size is not None else ""
        if self.multi_objective_aggregation == "normalize_then_sum":
            scale = " / (std_i(r_k) + eps)" if self.normalizer == "std" else ""
            return f"A = whiten_batch( sum_k w_k (r_k - mean_i(r_k)){scale} ){group}"
        if self.normalizer == "batch_std":
            centered = "r - mean_i(r)" if self.baseline == "mean" else "r"
            return f"A = ({centered}) / (std_batch(r) + eps){group}"
        if self.normalizer in NORMALIZER_FORMULAS:
            return NORMALIZER_FORMULAS[self.normalizer] + group
        if not group:
            return ""
        centered = "r - mean_i(r)" if self.baseline == "mean" else "r"
        scale = {"std": "std_i(r) + eps", "mean": "mean_i(r) + eps"}.get(self.normalizer)
        return f"A = ({centered}) / ({scale}){group}" if scale else f"A = {centered}{group}"

    def override(self, **changes: Any) -> AlgorithmSpec:
        """A validated copy with some fields changed (unknown fields and bad values raise)."""
        return AlgorithmSpec.model_validate({**self.model_dump(), **translate_old_spelling(changes)})
