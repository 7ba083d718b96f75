"""Independent float64 references, written straight from the formulas (GUIDE section 2) with loops.

Deliberately naive: one sequence and one token at a time, no shared code with grpolab.objectives.losses.
"""

from __future__ import annotations

import math

import torch


def reference_advantages(
    rewards: list[list[float]], baseline: str, normalizer: str, eps: float = 1e-6, valid_rescale: bool = False
) -> list[list[float]]:
    """valid_rescale: GPG's alpha = B / (B - M), M the samples of groups whose rewards are all equal."""
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
    if valid_rescale:
        total = sum(len(group) for group in rewards)
        invalid = sum(len(group) for group in rewards if all(r == group[0] for r in group))
        alpha = total / (total - invalid) if total > invalid else 1.0
        out = [[alpha * a for a in group] for group in out]
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
    kl_ratio=False,
    engine=None,
    correction="none",
    cap=2.0,
    delta=None,
    tau_pos=1.0,
    tau_neg=1.05,
    vespo=(2.0, 3.0, 3.0, 2.0),
    ratio_cap=None,
    kl_tau=0.0,
    filter_zero_advantages=False,
):
    """Scalar float64 loss of one optimizer step. logp: [N, T] float64 leaf; others plain tensors.

    The TRL loss types (their papers' formulas): delta (INTELLECT-2's two-sided clip) caps the ratio of the
    unclipped term at delta; sapo: -A * (4 / tau) * sigmoid(tau * (w - 1)), tau = tau_pos when A > 0 else tau_neg;
    vespo: -sg(phi(W)) * A * logp, W = prod_t w_t over the sequence, phi(W) = e^lam * W^k * e^(-lam * W) with
    (k, lam) = vespo[0:2] when A >= 0 else vespo[2:4]; aggregation sequence_sum (LUSPO): each sequence's summed
    token losses (for gspo: its loss times its length), a mean over sequences.

    gmpo (Zhao et al., 2025): a sequence's objective is sign(A) * (prod_t |min(r_t A, clip(r_t, e^-eps_low,
    e^eps_high) A)|)^(1/|o|), the same value on each of its tokens. dppo (Qi et al., 2026, Binary-TV): a token
    is dropped when A > 0 and p - p_old > eps_high or A < 0 and p - p_old < -eps_low (p the sampled token's
    probability), else -min(r, ratio_cap) * A with the truncated factor held fixed (r without a cap).
    kl_tau: + kl_tau * sum over response tokens of (logp - old)^2 / response tokens of the step (prime-rl).
    filter_zero_advantages: the sequences with A = 0 are not in the step at all (prime-rl's orchestrator).
    """
    if filter_zero_advantages:
        keep = [i for i in range(mask.shape[0]) if float(adv[i]) != 0]
        logp, old, adv, mask = logp[keep], old[keep], adv[keep], mask[keep]
        ref = ref[keep] if ref is not None else None
        engine = engine[keep] if engine is not None else None
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
            unclipped = s if delta is None else torch.clamp(s, max=delta)
            seq_loss = -torch.minimum(unclipped * a, torch.clamp(s, 1 - eps_low, 1 + eps_high) * a)
            losses = [seq_loss for _ in tokens]
        elif weight == "vespo":
            log_w = sum(float(logp[i, t].detach() - old[i, t]) for t in tokens)  # the whole sequence's ratio, detached
            k, lam = (vespo[0], vespo[1]) if a >= 0 else (vespo[2], vespo[3])
            big_w = math.exp(log_w)
            phi = math.exp(lam) * big_w**k * math.exp(-lam * big_w)
            losses = [-phi * a * logp[i, t] for t in tokens]
        elif weight == "gmpo" and a == 0:
            losses = [logp.sum() * 0 for _ in tokens]  # the paper's sign(A) = 0 (and no 0 ** (1/|o|) gradient)
        elif weight == "gmpo":
            product = logp.sum() * 0 + 1.0
            for t in tokens:
                w = torch.exp(logp[i, t] - old[i, t])
                product = product * torch.abs(
                    torch.minimum(w * a, torch.clamp(w, math.exp(-eps_low), math.exp(eps_high)) * a)
                )
            sign = 1.0 if a > 0 else -1.0
            seq_objective = sign * product ** (1.0 / max(len(tokens), 1))
            losses = [-seq_objective for _ in tokens]
        else:
            for t in tokens:
                w = torch.exp(logp[i, t] - old[i, t])
                if weight == "none":
                    losses.append(-a * logp[i, t])
                elif weight == "noclip":
                    losses.append(-a * w)
                elif weight == "clip":
                    unclipped = w if delta is None else torch.clamp(w, max=delta)
                    losses.append(-torch.minimum(unclipped * a, torch.clamp(w, 1 - eps_low, 1 + eps_high) * a))
                elif weight == "sapo":
                    tau = tau_pos if a > 0 else tau_neg
                    losses.append(-a * (4 / tau) * torch.sigmoid(tau * (w - 1)))
                elif weight == "cispo":
                    losses.append(-torch.clamp(w, max=1 + eps_high).detach() * a * logp[i, t])
                elif weight == "dppo":
                    moved = math.exp(float(logp[i, t].detach())) - math.exp(float(old[i, t]))
                    if (a > 0 and moved > eps_high) or (a < 0 and moved < -eps_low):
                        losses.append(logp.sum() * 0)
                    elif ratio_cap is not None and float(w.detach()) > ratio_cap:
                        losses.append(-(ratio_cap / w.detach()) * w * a)
                    else:
                        losses.append(-w * a)
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
                ratio = torch.exp(logp[i, t] - old[i, t]) if kl_ratio else 1.0  # DeepSeek-V3.2's correction
                kl_sum = kl_sum + ratio * (torch.exp(d) - d - 1)

    zero = logp.sum() * 0
    if aggregation == "sequence":
        total = sum((sum(ls, zero) / max(len(ls), 1) for ls in seq_token_losses), zero) / n
    elif aggregation == "sequence_sum":
        total = sum((sum(ls, zero) for ls in seq_token_losses), zero) / n
    elif aggregation == "token":
        total = sum((sum(ls, zero) for ls in seq_token_losses), zero) / total_tokens
    else:
        z = z if z is not None else n * max_new_tokens
        total = sum((sum(ls, zero) for ls in seq_token_losses), zero) / z
    if ref is not None and beta > 0:
        total = total + beta * kl_sum / total_tokens
    if kl_tau > 0:
        sq = sum((((logp[i, t] - old[i, t]) ** 2) for i in range(n) for t in range(t_len) if mask[i, t] > 0), zero)
        total = total + kl_tau * sq / total_tokens
    return total


def reference_beta_advantages(rewards: list[list[float]]) -> list[list[float]]:
    """BNPO (Xiao et al., 2025, eq. for A_{alpha,beta} with the variance-minimising alpha, beta): rewards in
    [0, 1]; p_i = group i's mean reward; a, b = the method-of-moments Beta fit of the p_i over the batch
    (their mean m and unbiased variance v: a = m (m (1 - m) / v - 1), b = (1 - m) (m (1 - m) / v - 1));
    alpha = max(1 + a / 3, 1), beta = max(1 + b / 3, 1); A_ij = (r_ij - p_i) / f(p_i; alpha, beta), f the
    Beta density (1 / f capped at 1e6 as the authors' code does). One group, or all p_i equal (v = 0):
    alpha = beta = 1, f = 1, A = r - p. A group whose rewards are all equal gets 0."""
    ps = [sum(g) / len(g) for g in rewards]
    k = len(ps)
    m = sum(ps) / k
    v = sum((p - m) ** 2 for p in ps) / (k - 1) if k > 1 else 0.0
    if v > 0:
        a, b = m * (m * (1 - m) / v - 1), (1 - m) * (m * (1 - m) / v - 1)
        alpha, beta = max(1 + a / 3, 1.0), max(1 + b / 3, 1.0)
    else:
        alpha = beta = 1.0
    norm = math.gamma(alpha + beta) / (math.gamma(alpha) * math.gamma(beta))
    out = []
    for group, p in zip(rewards, ps):
        if all(r == group[0] for r in group):
            out.append([0.0] * len(group))
            continue
        density = norm * p ** (alpha - 1) * (1 - p) ** (beta - 1)
        scale = min(1 / density, 1e6) if density > 0 else 1e6
        out.append([(r - p) * scale for r in group])
    return out


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


# --- token selection and entropy: written from the papers' formulas, loops only ---


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
