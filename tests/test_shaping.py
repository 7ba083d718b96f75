"""Length shaping against the piecewise formulas, written out independently in float64."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpolab.tasks.base import Grade
from grpolab.tasks.shaping import overlong_penalty, shape_rewards, truncation_penalty


def dapo_reference(length: int, max_len: int, buffer: int, factor: float) -> float:
    """DAPO eq. 13: 0 up to L_max - L_cache, then linear to -1 at L_max, -1 beyond; times factor."""
    if length <= max_len - buffer:
        return 0.0
    if length <= max_len:
        return factor * ((max_len - buffer) - length) / buffer
    return -factor


@given(
    lengths=st.lists(st.integers(0, 600), min_size=1, max_size=40),
    max_len=st.integers(1, 512),
    buffer=st.integers(1, 512),
    factor=st.floats(0.01, 10),
)
def test_overlong_penalty_matches_the_formula(lengths, max_len, buffer, factor):
    got = overlong_penalty(torch.tensor(lengths), max_len, buffer, factor)
    want = torch.tensor([dapo_reference(n, max_len, buffer, factor) for n in lengths], dtype=torch.float64)
    assert got.dtype == torch.float64 and torch.allclose(got, want, rtol=0, atol=1e-12)


def test_overlong_penalty_values_and_off():
    got = overlong_penalty(torch.tensor([0, 96, 97, 112, 128]), max_len=128, buffer=32, factor=1.0).tolist()
    assert got == [0.0, 0.0, -1 / 32, -0.5, -1.0]
    assert overlong_penalty(torch.tensor([500]), 128, 0).tolist() == [0.0]
    assert truncation_penalty(torch.tensor([True, False]), 0.5).tolist() == [-0.5, 0.0]


def test_shaping_adds_named_components_to_the_rl_reward_only():
    grades = [Grade(1.0, 1.0), Grade(1.0, 0.0), Grade(0.0, 0.0)]
    shaped = shape_rewards(
        grades, [10, 120, 128], [False, False, True], max_len=128, penalty=0.5, buffer=16, factor=2.0
    )
    assert [g.answer_reward for g in shaped] == [1.0, 0.0, 0.0]  # accuracy untouched
    assert [dict(g.components) for g in shaped] == [
        {"truncation_penalty": 0.0, "overlong_penalty": 0.0},
        {"truncation_penalty": 0.0, "overlong_penalty": pytest.approx(-1.0)},
        {"truncation_penalty": -0.5, "overlong_penalty": -2.0},
    ]
    assert [g.reward for g in shaped] == pytest.approx([1.0, -1.0, -2.5])
    assert shape_rewards(grades, [1, 2, 3], [False] * 3, 128, 0.0, 0, 1.0) is grades
