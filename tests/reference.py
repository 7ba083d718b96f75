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


# --- token selection and entropy (issue 51, tokensel): written from the papers' formulas, loops only ---


def reference_quantile(values, q):
    """The q quantile of a list by linear interpolation between the sorted values (numpy's default)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def reference_token_choice(logp, old, adv, mask, entropy, *, spec, generator=None):
    """Per-token (keep, penalise, bonus) lists of lists over each row's response tokens, from the whole batch
    (one optimizer step). 80/20: keep H >= the (1 - rho) quantile. Covariance: cov = (logp - mean logp)(A - mean A),
    the means over every response token (A repeated per token). Clip-Cov: of the tokens with lb < cov < ub whose
    PPO clip is not active (-A clip(w) > -A w), in row-then-position order, drop the first max(1, int(ratio K)) of
    randperm(#candidates) on ``generator``. KL-Cov: penalise the max(1, int(ratio K)) largest cov (ties: earlier)."""
    n, t_len = mask.shape
    tokens = [(i, t) for i in range(n) for t in range(t_len) if mask[i, t] > 0]
    k = len(tokens)
    keep = {tok: True for tok in tokens}
    penalise = {tok: False for tok in tokens}
    bonus = {tok: True for tok in tokens}
    if spec.top_entropy_quantile < 1:
        threshold = reference_quantile([float(entropy[i, t]) for i, t in tokens], 1 - spec.top_entropy_quantile)
        for i, t in tokens:
            keep[(i, t)] = bonus[(i, t)] = float(entropy[i, t]) >= threshold
    if spec.cov_selection != "none":
        mean_lp = sum(float(logp[i, t]) for i, t in tokens) / k
        mean_a = sum(float(adv[i]) for i, t in tokens) / k
        cov = {(i, t): (float(logp[i, t]) - mean_lp) * (float(adv[i]) - mean_a) for i, t in tokens}
        count = max(1, int(k * (spec.clip_cov_ratio if spec.cov_selection == "clip_cov" else spec.kl_cov_ratio)))
        if spec.cov_selection == "clip_cov":
            candidates = []
            for i, t in tokens:
                w = math.exp(float(logp[i, t]) - float(old[i, t]))
                a = float(adv[i])
                clipped = -a * min(max(w, 1 - spec.eps_low), 1 + spec.eps_high) > -a * w
                if spec.clip_cov_lb < cov[(i, t)] < spec.clip_cov_ub and not clipped:
                    candidates.append((i, t))
            if candidates:
                for j in torch.randperm(len(candidates), generator=generator)[:count].tolist():
                    keep[candidates[j]] = False
        else:
            ranked = sorted(range(k), key=lambda j: (-cov[tokens[j]], j))
            for j in ranked[:count]:
                penalise[tokens[j]] = True
    rows = lambda d: [[d[(i, t)] for t in range(t_len) if mask[i, t] > 0] for i in range(n)]  # noqa: E731
    return rows(keep), rows(penalise), rows(bonus)


def reference_tokensel_loss(logp, old, adv, mask, entropy, *, spec, max_new_tokens, entropy_coef=0.0, generator=None):
    """Scalar float64 loss of one optimizer step with token selection and the entropy bonus: each token's
    surrogate (clip or noclip) times keep, plus kl_cov_coef |logp - old| where penalised; reduced by the spec's
    aggregation (dropped tokens still count); minus entropy_coef x mean of H over the bonus tokens.
    logp, entropy: [N, T] float64 (may require grad)."""
    keep, penalise, bonus = reference_token_choice(
        logp.detach(), old, adv, mask, entropy.detach(), spec=spec, generator=generator
    )
    n, t_len = mask.shape
    zero = logp.sum() * 0
    per_seq, total_tokens = [], 0
    h_sum, h_count = zero, 0
    for i in range(n):
        tokens = [t for t in range(t_len) if mask[i, t] > 0]
        total_tokens += len(tokens)
        a = float(adv[i])
        losses = []
        for j, t in enumerate(tokens):
            w = torch.exp(logp[i, t] - old[i, t])
            if spec.weight == "clip":
                loss = -torch.minimum(w * a, torch.clamp(w, 1 - spec.eps_low, 1 + spec.eps_high) * a)
            elif spec.weight == "noclip":
                loss = -a * w
            else:
                raise ValueError(spec.weight)
            loss = loss if keep[i][j] else zero
            if penalise[i][j]:
                loss = loss + spec.kl_cov_coef * torch.abs(logp[i, t] - old[i, t])
            losses.append(loss)
            if bonus[i][j]:
                h_sum, h_count = h_sum + entropy[i, t], h_count + 1
        per_seq.append(losses)
    if spec.aggregation == "sequence":
        total = sum((sum(ls, zero) / max(len(ls), 1) for ls in per_seq), zero) / n
    elif spec.aggregation == "token":
        total = sum((sum(ls, zero) for ls in per_seq), zero) / total_tokens
    else:
        total = sum((sum(ls, zero) for ls in per_seq), zero) / (n * max_new_tokens)
    if entropy_coef:
        total = total - entropy_coef * h_sum / max(h_count, 1)
    return total


def reference_adaptive_coefficients(entropies, *, start, target, delta, low, high):
    """Skywork-OR1's coefficient, as TRL applies it: step k uses c_k when e_{k-1} <= target (no e_{-1}: 0), then
    c_{k+1} = c_k + delta if e_k <= target else c_k - delta, clipped to [low, high]. Returns the applied list."""
    applied, c, last = [], start, None
    for e in entropies:
        applied.append(c if last is not None and last <= target else 0.0)
        c = min(max(c + (delta if e <= target else -delta), low), high)
        last = e
    return applied
