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


def reference_rollout_correction(old, engine, mask, mode, upper, lower=None):
    """Per-token (weight, kept) lists of lists for each sequence's response tokens (float64, loops).

    r_t = exp(old_t - engine_t); the sequence's product ratio R = exp(sum_t log r_t), its geometric mean
    G = exp(mean_t log r_t). truncate: clip into [lower, upper] (no floor when lower is None);
    mask: keep the weight when it lies inside [lower, upper] (no floor when lower is None), else weight 0.
    """
    lo = -math.inf if lower is None else lower
    n, t_len = mask.shape
    weights, kept = [], []
    for i in range(n):
        tokens = [t for t in range(t_len) if mask[i, t] > 0]
        logs = [float(old[i, t]) - float(engine[i, t]) for t in tokens]
        if mode in ("token_truncate", "token_mask", "icepop"):
            raw = [math.exp(v) for v in logs]
        elif mode in ("sequence_truncate", "sequence_mask"):
            raw = [math.exp(sum(logs))] * len(tokens)
        elif mode in ("geometric_truncate", "geometric_mask"):
            raw = [math.exp(sum(logs) / max(len(tokens), 1))] * len(tokens)
        else:
            raw = [1.0] * len(tokens)
        if mode == "none":
            w, k = raw, [True] * len(tokens)
        elif mode.endswith("_truncate"):
            w, k = [min(max(r, lo), upper) for r in raw], [True] * len(tokens)
        else:
            k = [lo <= r <= upper for r in raw]
            w = [r if keep else 0.0 for r, keep in zip(raw, k)]
        weights.append(w)
        kept.append(k)
    return weights, kept


def reference_off_policy_mask(sampling, logp, adv, mask, delta):
    """DeepSeek-V3.2's sequence mask, one bool per sequence: drop it when A < 0 and
    (1/|o|) sum_t (log pi_sampling - log pi_theta) > delta."""
    n, t_len = mask.shape
    out = []
    for i in range(n):
        tokens = [t for t in range(t_len) if mask[i, t] > 0]
        kl = sum(float(sampling[i, t]) - float(logp[i, t]) for t in tokens) / max(len(tokens), 1)
        out.append(not (float(adv[i]) < 0 and kl > delta))
    return out


def reference_corrected_loss(
    logp,
    old,
    adv,
    mask,
    *,
    weight,
    aggregation,
    max_new_tokens,
    engine,
    mode,
    upper,
    lower=None,
    delta=None,
    eps_low=0.2,
    eps_high=0.2,
):
    """Scalar float64 loss with a rollout correction: each kept token's surrogate times its weight; dropped
    tokens add 0 to the numerator and still count in every denominator."""
    weights, kept = reference_rollout_correction(old, engine, mask, mode, upper, lower)
    seq_keep = (
        reference_off_policy_mask(engine, logp.detach(), adv, mask, delta) if delta is not None else [True] * len(kept)
    )
    n, t_len = mask.shape
    zero = logp.sum() * 0
    per_seq, total_tokens = [], 0
    for i in range(n):
        tokens = [t for t in range(t_len) if mask[i, t] > 0]
        total_tokens += len(tokens)
        a = float(adv[i])
        losses = []
        for j, t in enumerate(tokens):
            w = torch.exp(logp[i, t] - old[i, t])
            if weight == "clip":
                surrogate = -torch.minimum(w * a, torch.clamp(w, 1 - eps_low, 1 + eps_high) * a)
            elif weight == "none":
                surrogate = -a * logp[i, t]
            else:
                raise ValueError(weight)
            keep = kept[i][j] and seq_keep[i]
            losses.append(surrogate * weights[i][j] if keep else zero)
        per_seq.append(losses)
    if aggregation == "sequence":
        return sum((sum(ls, zero) / max(len(ls), 1) for ls in per_seq), zero) / n
    if aggregation == "token":
        return sum((sum(ls, zero) for ls in per_seq), zero) / total_tokens
    return sum((sum(ls, zero) for ls in per_seq), zero) / (n * max_new_tokens)


def reference_distill_loss(
    logp, old, adv, teacher, mask, *, weight, aggregation, teacher_kl_coef, reward_coef, eps_low=0.2, eps_high=0.2
):
    """On-policy distillation (Agarwal et al. 2024; Thinking Machines 2025, tinker cookbook's
    ``incorporate_kl_penalty`` with ``kl_discount_factor`` 0), float64 loops. Each sampled response token t of
    sequence i gets its own advantage

        A_it = reward_coef * A_i + teacher_kl_coef * (log pi_teacher(y_t) - log pi_old(y_t))

    (minus the sampled reverse KL of the sampling policy to the teacher, no discount: the token's own term only,
    a constant of the update), then the policy-gradient surrogate of ``weight`` (none: -A logp, noclip: -w A,
    clip: -min(w A, clip(w) A), w = exp(logp - logp_old)), reduced by ``aggregation``."""
    n, t_len = mask.shape
    per_seq, total_tokens = [], 0
    zero = logp.sum() * 0
    for i in range(n):
        losses = []
        for t in range(t_len):
            if mask[i, t] <= 0:
                continue
            total_tokens += 1
            a = reward_coef * float(adv[i]) + teacher_kl_coef * (float(teacher[i, t]) - float(old[i, t]))
            w = torch.exp(logp[i, t] - old[i, t])
            if weight == "none":
                losses.append(-a * logp[i, t])
            elif weight == "noclip":
                losses.append(-w * a)
            elif weight == "clip":
                losses.append(-torch.minimum(w * a, torch.clamp(w, 1 - eps_low, 1 + eps_high) * a))
            else:
                raise ValueError(weight)
        per_seq.append(losses)
    if aggregation == "token":
        return sum((sum(ls, zero) for ls in per_seq), zero) / total_tokens
    if aggregation == "sequence":
        return sum((sum(ls, zero) / max(len(ls), 1) for ls in per_seq), zero) / n
    raise ValueError(aggregation)
