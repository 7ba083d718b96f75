"""80/20 high-entropy tokens and the entropy bonus (fixed and Skywork-OR1's adaptive coefficient) against TRL's
own code (TRL 1.16, ``GRPOTrainer._compute_loss`` and ``get_high_entropy_mask``), run unchanged on a stand-in
``self`` as in tests/test_rollout_correction_trl.py (whose ``TRL`` pieces and batches this reuses).

One process and one micro-batch: TRL selects and averages per micro-batch, grpolab over the whole optimizer
step, so they agree exactly where the step is one micro-batch (tests/test_token_selection.py proves the split
invariance). The same semantics in both: a token is kept when its entropy is at least the (1 - rho) quantile
(linear interpolation); dropped tokens count in every denominator; the bonus is minus coef x the mean entropy
over the kept tokens, not rescaled by the policy loss's normalisation; the adaptive coefficient applied at a step
is c_k when the previous step's entropy was at or below the target, then c moves by delta.
"""

from __future__ import annotations

import ast

import pytest
import torch
from test_rollout_correction_trl import ATOL, RTOL, TRL, N, T, _function, _run, _trl_source, batch, trl_inputs

from grpolab.learning.update import StepContext, UpdateData, UpdateSchedule, accumulate_gradients
from grpolab.objectives.presets import PRESETS
from grpolab.objectives.token_selection import AdaptiveEntropy

LOSS_TYPES = {"grpo": "sequence", "dapo": "token", "dr_grpo": "constant"}


@pytest.fixture(scope="module")
def trl_code() -> TRL:
    code = TRL()
    _, grpo = _trl_source("trainer/grpo_trainer.py")
    _run([_function(grpo, "get_high_entropy_mask")], code.globals)
    return code


def stand_in(trl_code, loss_type, rho, coef, adaptive=False, target=0.2, delta=0.005):
    """TRL's ``self`` without the engine correction, with its entropy settings (GRPOConfig's names)."""
    me = trl_code.settings("token_truncate", 2.0, None, loss_type)
    me.use_vllm = False
    me.top_entropy_quantile = rho
    me.get_high_entropy_mask = lambda e, m, q: trl_code.globals["get_high_entropy_mask"](me, e, m, q)
    me.accelerator.pad_across_processes = lambda x, dim, pad_index: x
    me.accelerator.sync_gradients = True
    me._entropy_bonus_enabled = coef != 0.0 or adaptive
    me.entropy_coef, me.use_adaptive_entropy = coef, adaptive
    me._last_world_entropy, me._entropy_window_stats = float("inf"), None
    me.args.entropy_target, me.args.entropy_coef_delta = target, delta
    me.args.entropy_coef_min, me.args.entropy_coef_max = 0.0, 1.0
    return me


def trl_loss(trl_code, me, logp, entropy, old, adv, mask):
    """TRL's loss and its gradients d/d logp, d/d entropy (the model's outputs stood in by leaves)."""
    lp, ent = logp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    me._get_per_token_logps_and_entropies = lambda *a, **k: (lp, ent, None)
    loss = trl_code.globals["_compute_loss"](me, None, trl_inputs(mask, adv, old, old))
    loss.backward()
    return loss.detach(), lp.grad, ent.grad


def our_loss(spec, logp, entropy, old, adv, mask, coef):
    """grpolab's whole step (the selection's pass, then one micro-batch) with the model stood in by leaves."""
    lp, ent = logp.clone().requires_grad_(True), entropy.clone().requires_grad_(True)
    data = UpdateData(advantages=adv, response_mask=mask, old_logprobs=old)
    step = accumulate_gradients(
        StepContext(
            spec.override(prune_zero_advantage=False),
            data,
            torch.arange(N),
            UpdateSchedule(N, max_new_tokens=T),
            entropy_coef=coef,
        ),
        lambda idx: (lp[idx], ent[idx]),
    )
    return torch.tensor(step.metrics.on_host().loss, dtype=torch.float32), lp.grad, ent.grad, step.metrics.means()


def entropies(seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.rand(N, T, generator=torch.Generator().manual_seed(seed)) * 2 * scale


@pytest.mark.parametrize("rho, coef", [(0.2, 0.0), (0.5, 0.0), (0.2, 0.05), (1.0, 0.05)])
@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
def test_trl_top_entropy_quantile_and_entropy_bonus_give_our_loss(trl_code, loss_type, rho, coef):
    logp, old, _, adv, mask = batch(8)
    entropy = entropies(9)
    me = stand_in(trl_code, loss_type, rho, coef)
    want, want_lp, want_ent = trl_loss(trl_code, me, logp, entropy, old, adv, mask)
    spec = PRESETS["grpo"].override(aggregation=LOSS_TYPES[loss_type], top_entropy_quantile=rho, entropy_coef=coef)
    loss, grad_lp, grad_ent, means = our_loss(spec, logp, entropy, old, adv, mask, coef if coef else None)
    torch.testing.assert_close(loss, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad_lp, want_lp, rtol=RTOL, atol=ATOL)
    if coef:
        torch.testing.assert_close(grad_ent, want_ent, rtol=RTOL, atol=ATOL)
    if rho < 1:  # the mask bites: TRL keeps rho of the tokens, as we do
        kept = trl_code.globals["get_high_entropy_mask"](me, entropy, mask, 1 - rho)
        assert means["token_keep_frac"] == pytest.approx(float(kept.sum() / mask.sum()), rel=1e-6)
        assert 0 < means["token_keep_frac"] < 1


def test_trl_adaptive_entropy_coefficient_is_ours_step_by_step(trl_code):
    """Five optimizer steps whose entropies cross the target both ways: TRL's loss, its coefficient after each
    step and ours agree (ours is the run's controller, the state its checkpoints save)."""
    logp, old, _, adv, mask = batch(10)
    target, delta = 0.5, 0.1
    me = stand_in(trl_code, "dapo", 1.0, 0.0, adaptive=True, target=target, delta=delta)
    spec = PRESETS["grpo"].override(
        aggregation="token", use_adaptive_entropy=True, entropy_target=target, entropy_coef_delta=delta
    )
    control, coefs = AdaptiveEntropy(), []
    for k, scale in enumerate([0.3, 0.3, 0.3, 1.0, 0.2]):  # mean entropy ~ scale: below, below, below, above, below
        entropy = entropies(20 + k, scale)
        want, _, want_ent = trl_loss(trl_code, me, logp, entropy, old, adv, mask)
        coef = control.applied(spec)
        loss, _, grad_ent, means = our_loss(spec, logp, entropy, old, adv, mask, coef)
        control.observe(spec, means["bonus_entropy"] / means["bonus_tokens"])
        torch.testing.assert_close(loss, want, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(grad_ent, want_ent, rtol=RTOL, atol=ATOL)
        assert control.coef == pytest.approx(me.entropy_coef, abs=1e-7), k
        coefs.append(control.coef)
    assert coefs == pytest.approx([0.1, 0.2, 0.3, 0.2, 0.3]) and control.applied(spec) == pytest.approx(0.3)


def test_the_trl_source_still_has_the_pieces_read_here(trl_code):
    assert "get_high_entropy_mask" in trl_code.globals
    _, grpo = _trl_source("trainer/grpo_trainer.py")
    body = ast.unparse(_function(grpo, "_compute_loss"))
    assert "self._last_world_entropy <= self.args.entropy_target" in body
