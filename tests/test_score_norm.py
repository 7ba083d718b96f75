"""Normalizing reward-model scores: float64 references written from the formulas (numpy)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from grpolab.objectives.score_norm import EPS, RunningMoments, batch_zscore, normalize_scores


def test_batch_zscore_is_the_population_zscore():
    x = np.array([0.5, -1.25, 3.0, 2.0, 2.0])
    expected = (x - x.mean()) / (x.std(ddof=0) + EPS)
    assert batch_zscore(torch.tensor(x)).numpy() == pytest.approx(expected, abs=1e-12)
    assert batch_zscore(torch.tensor([2.0, 2.0])).tolist() == [0.0, 0.0]
    assert batch_zscore(torch.tensor([7.0], dtype=torch.float64)).tolist() == [0.0]


def test_running_moments_equal_the_moments_of_everything_seen():
    rng = np.random.default_rng(0)
    batches = [rng.normal(3.0, 2.0, n) for n in (1, 7, 64, 3)]
    moments = RunningMoments()
    seen = []
    for batch in batches:
        moments.update(torch.tensor(batch, dtype=torch.float32))
        seen.extend(np.float32(batch).astype(np.float64))
        assert moments.count == len(seen)
        assert moments.mean == pytest.approx(np.mean(seen), abs=1e-12)
        assert moments.std == pytest.approx(np.std(seen, ddof=0), abs=1e-12)


def test_running_normalize_updates_then_applies_and_resumes_exactly():
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=16), rng.normal(size=16) + 1.0
    moments = RunningMoments()
    normalize_scores(torch.tensor(a), "running", moments)
    saved = dict(moments.state_dict())
    out = normalize_scores(torch.tensor(b), "running", moments).numpy()
    both = np.concatenate([a, b])
    assert out == pytest.approx((b - both.mean()) / (both.std() + EPS), abs=1e-12)
    resumed = RunningMoments()
    resumed.load_state_dict(saved)
    assert np.array_equal(normalize_scores(torch.tensor(b), "running", resumed).numpy(), out)
    assert resumed == moments


def test_clip_and_none():
    x = torch.tensor([-10.0, 0.5, 10.0])
    assert normalize_scores(x, "none").tolist() == [-10.0, 0.5, 10.0]
    assert normalize_scores(x, "none", clip=2.0).tolist() == [-2.0, 0.5, 2.0]
    assert normalize_scores(x, "batch", clip=1.0).abs().max().item() == 1.0
