"""Presets: the names users type, their exact settings, overrides and validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from grpolab.common.validation import describe_validation_error
from grpolab.objectives.presets import PRESETS, UnknownAlgorithmError, get_algorithm

EXPECTED = {  # GUIDE section 2: baseline, normalizer, weight, eps_low, eps_high, aggregation, epochs, steps
    "grpo": ("mean", "std", "clip", 0.2, 0.2, "sequence", 1, 1),
    "grpo_constant": ("mean", "std", "clip", 0.2, 0.2, "constant", 1, 1),
    "dr_grpo": ("mean", "none", "clip", 0.2, 0.2, "constant", 1, 1),
    "rft": ("none", "none", "none", 0.2, 0.2, "constant", 1, 1),
    "maxrl": ("mean", "mean", "clip", 0.2, 0.2, "constant", 1, 1),
    "gspo": ("mean", "std", "gspo", 3e-4, 4e-4, "sequence", 1, 4),  # the paper's sec. 5.1
    "cispo": ("mean", "std", "cispo", 0.2, 5.0, "token", 4, 1),
    "dapo": ("mean", "std", "clip", 0.2, 0.28, "token", 1, 1),
    "offpolicy_naive": ("mean", "std", "none", 0.2, 0.2, "sequence", 1, 32),
    "offpolicy_noclip": ("mean", "std", "noclip", 0.2, 0.2, "sequence", 1, 32),
    "offpolicy_clip": ("mean", "std", "clip", 0.2, 0.2, "sequence", 1, 32),
    "offpolicy_gspo": ("mean", "std", "gspo", 3e-4, 3e-4, "sequence", 1, 32),
    # TRL's loss types
    "sapo": ("mean", "std", "sapo", 0.2, 0.2, "sequence", 1, 4),
    "bnpo": ("mean", "beta_density", "clip", 0.2, 0.28, "sequence_sum", 1, 1),
    "luspo": ("mean", "std", "gspo", 3e-4, 4e-4, "sequence_sum", 1, 4),
    "vespo": ("mean", "std", "vespo", 0.2, 0.2, "token", 1, 4),
    "intellect2": ("mean", "std", "clip", 0.2, 0.2, "sequence", 1, 1),
    # verl's and prime-rl's losses
    "gmpo": ("mean", "std", "gmpo", 0.4, 0.4, "sequence", 1, 1),  # log-space clip (e^-0.4, e^0.4)
    "gpg": ("mean", "none", "none", 0.2, 0.2, "token", 1, 1),  # with valid_rescale
    "dppo": ("mean", "std", "dppo", 0.2, 0.2, "token", 1, 1),  # TV thresholds, ratio_cap 20
    "prime_rl": ("mean", "none", "dppo", 0.2, 0.2, "token", 1, 1),  # with kl_tau 1e-3
    # advantage variants: Lite PPO (batch std), GDPO (decoupled terms), 2-GRPO (group size 2)
    "lite_ppo": ("mean", "batch_std", "clip", 0.2, 0.2, "token", 1, 1),
    "gdpo": ("mean", "std", "clip", 0.2, 0.2, "sequence", 1, 1),
    "two_grpo": ("mean", "std", "clip", 0.2, 0.2, "sequence", 1, 1),
    # token selection and entropy
    "dapo_8020": ("mean", "std", "clip", 0.2, 0.28, "token", 1, 1),  # DAPO + the top 20% of tokens by entropy
    "clip_cov": ("mean", "std", "clip", 0.2, 0.2, "token", 1, 8),
    "kl_cov": ("mean", "std", "noclip", 0.2, 0.2, "token", 1, 8),
    # part opd: on-policy distillation (Thinking Machines 2025): per-token -(reverse KL), importance sampling
    "opd": ("mean", "std", "noclip", 0.2, 0.2, "token", 1, 1),
}


def test_presets_are_exactly_the_documented_ones():
    assert set(PRESETS) == set(EXPECTED)
    for name, fields in EXPECTED.items():
        s = PRESETS[name]
        got = (s.baseline, s.normalizer, s.weight, s.eps_low, s.eps_high, s.aggregation, s.epochs, s.steps_per_epoch)
        assert got == fields, name
        assert s.beta == 0.0 and s.name == name
    assert PRESETS["dapo"].dynamic_sampling and not PRESETS["grpo"].dynamic_sampling
    extras = {n: (s.ratio_cap, s.kl_tau, s.valid_rescale) for n, s in PRESETS.items()}
    assert extras.pop("gpg") == (None, 0.0, True) and extras.pop("dppo") == (20.0, 0.0, False)
    assert extras.pop("prime_rl") == (None, 1e-3, False)
    assert set(extras.values()) == {(None, 0.0, False)}  # the other presets keep the defaults
    assert [n for n, s in PRESETS.items() if s.multi_objective_aggregation != "sum_then_normalize"] == ["gdpo"]
    assert {n: s.group_size for n, s in PRESETS.items() if s.group_size is not None} == {"two_grpo": 2}


def test_every_field_can_be_overridden_and_is_validated():
    spec = get_algorithm("grpo", eps_high=0.28, aggregation="token", beta=0.04, epochs=2)
    assert (spec.eps_high, spec.aggregation, spec.beta, spec.epochs) == (0.28, "token", 0.04, 2)
    assert PRESETS["grpo"].eps_high == 0.2  # presets are not mutated
    with pytest.raises(ValidationError) as err:
        get_algorithm("grpo", aggregation="median", eps_low=1.5)
    lines = describe_validation_error(err.value)
    assert len(lines) == 2 and any(line.startswith("aggregation:") for line in lines)
    with pytest.raises(ValidationError):
        get_algorithm("grpo", no_such_field=1)
    with pytest.raises(ValidationError, match="MaxRL"):
        get_algorithm("rft", normalizer="mean")


def test_unknown_algorithm_lists_the_choices():
    with pytest.raises(UnknownAlgorithmError, match="grpo, grpo_constant"):
        get_algorithm("ppo2")


def test_single_update_flag_and_formula():
    assert PRESETS["grpo"].is_single_update and not PRESETS["gspo"].is_single_update
    assert "clip(w, 1-eps_low, 1+eps_high)" in PRESETS["grpo"].formula()
    assert "/ Z" in PRESETS["dr_grpo"].formula()
