"""Independent float64 references, written straight from the formulas (GUIDE section 2) with loops.

Deliberately naive: one sequence and one token at a time, no shared code with grpolab.objectives.losses.
"""

from __future__ import annotations

import math

import torch


def reference_advantages(
    rewards: list[list[float]], baseline: str, normalizer: str, eps: float = 1e-6
) -> list[list[float]]:
    out = []
    for group in rewards:
        g = len(group)
        mean = sum(group) / g
        if all(r == group[0] for r in group) and baseline == "mean":
            out.append([0.0] * g)
            continue
        centered = [r - mean for r in group] if baseline == "mean" else list(group)
        if normalizer == "std":
            std = math.sqrt(sum((r - mean) ** 2 for r in group) / (g - 1))
            centered = [c / (std + eps) for c in centered]
        elif normalizer == "mean":
            centered = [0.0 if mean == 0 else c / (mean + eps) for c in centered]
        out.append(centered)
    return out


def reference_loss(
    logp,
    old,
    adv,
    mask,
    *,
    weight,
    aggregation,
    eps_low=0.2,
    eps_high=0.2,
    z=None,
    max_new_tokens=None,
    ref=None,
    beta=0.0,
    engine=None,
    correction="none",
    cap=2.0,
):
    """Scalar float64 loss of one optimizer step. logp: [N, T] float64 leaf; others plain tensors."""
    n, t_len = mask.shape
    seq_token_losses = []
    total_tokens = 0
    kl_sum = 0.0
    for i in range(n):
        tokens = [t for t in range(t_len) if mask[i, t] > 0]
        total_tokens += len(tokens)
        a = float(adv[i])
        losses = []
        if weight == "gspo":
            log_s = sum(logp[i, t] - old[i, t] for t in tokens) / max(len(tokens), 1)
            s = torch.exp(log_s)
            seq_loss = -torch.minimum(s * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a)
            losses = [seq_loss for _ in tokens]
        else:
            for t in tokens:
                w = torch.exp(logp[i, t] - old[i, t])
                if weight == "none":
                    losses.append(-a * logp[i, t])
                elif weight == "noclip":
                    losses.append(-a * w)
                elif weight == "clip":
                    losses.append(-torch.minimum(w * a, torch.clamp(w, 1 - eps_low, 1 + eps_high) * a))
                elif weight == "cispo":
                    losses.append(-torch.clamp(w, max=1 + eps_high).detach() * a * logp[i, t])
        if correction != "none":
            if correction == "token":
                factors = [min(math.exp(float(old[i, t] - engine[i, t])), cap) for t in tokens]
            else:
                seq = min(math.exp(sum(float(old[i, t] - engine[i, t]) for t in tokens)), cap)
                factors = [seq for _ in tokens]
            losses = [loss * f for loss, f in zip(losses, factors)]
        seq_token_losses.append(losses)
        if ref is not None:
            for t in tokens:
                d = ref[i, t] - logp[i, t]
                kl_sum = kl_sum + torch.exp(d) - d - 1

    zero = logp.sum() * 0
    if aggregation == "sequence":
        total = sum((sum(ls, zero) / max(len(ls), 1) for ls in seq_token_losses), zero) / n
    elif aggregation == "token":
        total = sum((sum(ls, zero) for ls in seq_token_losses), zero) / total_tokens
    else:
        z = z if z is not None else n * max_new_tokens
        total = sum((sum(ls, zero) for ls in seq_token_losses), zero) / z
    if ref is not None and beta > 0:
        total = total + beta * kl_sum / total_tokens
    return total
