"""The settings rules and one-line formulas of token selection and the entropy bonus (docs/algorithms.md, "Token selection and entropy").

Kept apart from ``algorithms.py`` so that the spec stays a list of fields: ``check_token_selection`` raises the
one-line ValueError of a bad combination, ``token_selection_formula`` extends ``AlgorithmSpec.formula``. Both read
the settings below (``TokenSelectionSettings``, which ``AlgorithmSpec`` has), and ask the weight's registration
(``grpolab.objectives.surrogates``) what its tokens allow.
"""

from __future__ import annotations

from typing import Protocol

from grpolab.objectives.surrogates import get_surrogate, weights_that


class TokenSelectionSettings(Protocol):
    """The fields of an ``AlgorithmSpec`` that token selection and the entropy bonus read."""

    weight: str
    epochs: int
    steps_per_epoch: int
    top_entropy_quantile: float
    cov_selection: str
    clip_cov_ratio: float
    clip_cov_lb: float
    clip_cov_ub: float
    kl_cov_ratio: float
    kl_cov_coef: float
    entropy_coef: float
    use_adaptive_entropy: bool
    entropy_coef_min: float
    entropy_coef_max: float


def check_token_selection(spec: TokenSelectionSettings) -> None:
    """ValueError (one line, saying what to change) for a token selection or entropy setting that cannot work."""
    if spec.top_entropy_quantile < 1 and spec.cov_selection != "none":
        raise ValueError(
            f"top_entropy_quantile {spec.top_entropy_quantile:g} and cov_selection {spec.cov_selection} both select "
            "tokens; use one (set top_entropy_quantile 1 or cov_selection none)"
        )
    weight = get_surrogate(spec.weight)
    if spec.cov_selection != "none" and weight.ratio == "sequence":
        raise ValueError(
            f"cov_selection {spec.cov_selection} picks tokens, weight {weight.name} has one ratio per sequence; "
            "use weight clip or noclip"
        )
    if spec.cov_selection == "clip_cov" and not weight.clip_cov:
        clipped = " or ".join(weights_that(lambda s: s.clip_cov))
        raise ValueError(
            f"cov_selection clip_cov detaches tokens of the clipped objective; use weight {clipped}, not {weight.name}"
        )
    if spec.cov_selection == "clip_cov" and spec.clip_cov_lb >= spec.clip_cov_ub:
        raise ValueError(f"clip_cov_lb {spec.clip_cov_lb:g} must be below clip_cov_ub {spec.clip_cov_ub:g}")
    if spec.cov_selection == "kl_cov" and spec.epochs * spec.steps_per_epoch == 1:
        raise ValueError(
            "cov_selection kl_cov penalises |logp - logp_old|, which is 0 with a 0 gradient in a single-update "
            "schedule; set steps_per_epoch or epochs above 1 (the kl_cov preset uses 8 steps)"
        )
    if spec.use_adaptive_entropy and not spec.entropy_coef_min <= spec.entropy_coef <= spec.entropy_coef_max:
        raise ValueError(
            f"entropy_coef {spec.entropy_coef:g} (the adaptive coefficient's start) must lie in "
            f"[entropy_coef_min {spec.entropy_coef_min:g}, entropy_coef_max {spec.entropy_coef_max:g}]"
        )


def token_selection_formula(spec: TokenSelectionSettings) -> str:
    """The terms token selection and the entropy bonus add to the formula (empty when none is on)."""
    parts = []
    if spec.top_entropy_quantile < 1:
        parts.append(f"only tokens with H >= quantile_(1-{spec.top_entropy_quantile:g})(H of the step)")
    if spec.cov_selection == "clip_cov":
        parts.append(
            f"l = 0 on a random {spec.clip_cov_ratio:g} of tokens with {spec.clip_cov_lb:g} < "
            f"cov < {spec.clip_cov_ub:g}, cov = (logp - mean logp)(A - mean A) over the step"
        )
    if spec.cov_selection == "kl_cov":
        parts.append(
            f"+ {spec.kl_cov_coef:g}*|logp - logp_old| on the top {spec.kl_cov_ratio:g} of tokens by "
            "cov = (logp - mean logp)(A - mean A) over the step"
        )
    if spec.entropy_coef > 0 or spec.use_adaptive_entropy:
        coef = "c_k (adaptive)" if spec.use_adaptive_entropy else f"{spec.entropy_coef:g}"
        parts.append(f"- {coef} * mean_t H")
    return "".join(f"; {p}" for p in parts)
