"""Independent float64 references of the advantage variants (docs/algorithms.md, "Advantage variants"), written
straight from the papers' formulas with loops, one group, one sample and one reward term at a time; no code
shared with grpolab.objectives.

- Lite PPO ("Tricks or Traps? A Deep Dive into RL for LLM Reasoning", Liu et al. 2025, sec. 4.1 and 5):
  A_ij = (r_ij - mean_j' r_ij') / (std over every reward of the batch + eps), the std unbiased.
- GDPO (Liu et al., NVIDIA, arXiv 2601.05242, eq. 4-6): per reward term k, A^k_ij = (r^k_ij - mean_j' r^k_ij') /
  (std_j' r^k_ij' + eps); S_ij = sum_k w_k A^k_ij; A_ij = (S_ij - mean over the batch of S) / (std over the batch
  of S + eps).
"""

from __future__ import annotations

import math


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def _unbiased_std(values: list[float]) -> float:
    m = _mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def reference_batch_std_advantages(rewards: list[list[float]], baseline: str, eps: float) -> list[list[float]]:
    """Lite PPO: the group's mean subtracted (baseline "mean"; a group of equal rewards gets 0), divided by the
    unbiased std of all B x G rewards of the batch plus eps."""
    flat = [r for group in rewards for r in group]
    std = _unbiased_std(flat)
    out = []
    for group in rewards:
        mean = _mean(group)
        if baseline == "mean" and all(r == group[0] for r in group):
            out.append([0.0] * len(group))
            continue
        out.append([((r - mean) if baseline == "mean" else r) / (std + eps) for r in group])
    return out


def reference_decoupled_advantages(
    terms: list[list[list[float]]], weights: list[float], normalizer: str, eps: float
) -> list[list[float]]:
    """GDPO: ``terms`` [B][G][K] unweighted reward terms, ``weights`` [K]. Each term normalised within its group
    (normalizer "std": over the unbiased std plus eps; "none": centred only; a group whose term is all equal
    gets 0 for it), the weighted sum, then whitened over the batch (unbiased std plus eps). A group whose
    weighted sum is 0 at every sample gets exactly 0 (its batch-mean term is 0 in exact arithmetic)."""
    n_groups, n_terms = len(terms), len(weights)
    summed = []
    for i in range(n_groups):
        group = terms[i]
        row = [0.0] * len(group)
        for k in range(n_terms):
            values = [sample[k] for sample in group]
            if all(v == values[0] for v in values):
                continue
            mean = _mean(values)
            scale = _unbiased_std(values) + eps if normalizer == "std" else 1.0
            for j, v in enumerate(values):
                row[j] += weights[k] * (v - mean) / scale
        summed.append(row)
    flat = [s for row in summed for s in row]
    mean, std = _mean(flat), _unbiased_std(flat)
    out = []
    for row in summed:
        if all(s == 0.0 for s in row):
            out.append([0.0] * len(row))
        else:
            out.append([(s - mean) / (std + eps) for s in row])
    return out
