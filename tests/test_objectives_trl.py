"""TRL's loss types against TRL's own code (TRL 1.16, ``GRPOTrainer._compute_loss``) on identical inputs.

The pattern and the helpers are tests/test_rollout_correction_trl.py's (imported, not copied): TRL's methods taken out
of the installed package's source with ``ast`` and run unchanged on a stand-in ``self`` holding TRL's settings,
which returns our log-probs where TRL would run the model. Here also ``get_gamma_weights`` (VESPO's weight; its
``@torch.no_grad()`` put back, since the helper drops decorators). Each loss type's loss and gradient equal
grpolab's preset within float32 rounding:

- sapo:  TRL ``loss_type="sapo"`` (``sapo_temperature_pos`` / ``_neg``) = weight sapo, aggregation sequence;
- vespo: TRL ``loss_type="vespo"`` (``vespo_k_pos`` ...) = weight vespo, aggregation token; with TRL's
  ``token_truncate`` correction folded into the sequence ratio = rollout_correction token_truncate;
- luspo: TRL ``loss_type="luspo"`` with ``importance_sampling_level="sequence"`` = weight gspo, aggregation
  sequence_sum;
- delta: TRL ``args.delta`` = clip_delta (weight clip; and gspo = TRL's sequence level);
- bnpo:  TRL's ``loss_type="bnpo"`` is a reduction only (a token mean of each micro-batch, divided by the
  accumulation steps), not the BNPO paper's Beta normalization: equal to aggregation token with one micro-batch,
  a different number (and not split-invariant) with more; shown below.
"""

from __future__ import annotations

import ast
import math

import pytest
import torch

trl = pytest.importorskip("trl")

from test_rollout_correction_trl import ATOL, RTOL, TRL, _function, _run, _trl_source, batch, trl_inputs  # noqa: E402

from grpolab.objectives.losses import PolicyLossInput, policy_loss, step_denominators  # noqa: E402
from grpolab.objectives.presets import PRESETS  # noqa: E402

N, T = 8, 12
# GRPOConfig's fields of these loss types -> ours (same names; TRL's delta is our clip_delta)
CONFIG_FIELDS = {
    "sapo_temperature_pos": "sapo_temperature_pos",
    "sapo_temperature_neg": "sapo_temperature_neg",
    "vespo_k_pos": "vespo_k_pos",
    "vespo_lambda_pos": "vespo_lambda_pos",
    "vespo_k_neg": "vespo_k_neg",
    "vespo_lambda_neg": "vespo_lambda_neg",
    "delta": "clip_delta",
}


def trl_defaults() -> dict:
    """GRPOConfig's defaults of ``CONFIG_FIELDS``, read from the installed source (``field(default=...)``)."""
    _, tree = _trl_source("trainer/grpo_config.py")
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in CONFIG_FIELDS:
            default = [k.value for k in node.value.keywords if k.arg == "default"]
            out[node.target.id] = ast.literal_eval(default[0])
    if set(out) != set(CONFIG_FIELDS):
        pytest.fail(f"trl {trl.__version__}: GRPOConfig lacks {set(CONFIG_FIELDS) - set(out)}")
    return out


@pytest.fixture(scope="module")
def trl_code() -> TRL:
    code = TRL()
    _, grpo = _trl_source("trainer/grpo_trainer.py")
    _run([_function(grpo, "get_gamma_weights")], code.globals)
    code.gamma_weights = torch.no_grad()(code.globals["get_gamma_weights"])  # its decorator, dropped by _run
    return code


def trl_settings(code: TRL, loss_type: str, *, level="token", eps=(0.2, 0.2), delta=None, correction=False, **args):
    """TRL's stand-in ``self`` for ``loss_type`` without the rollout correction (unless ``correction``: token_truncate
    with cap 1.05), one process, one micro-batch per optimizer step; ``args`` go to ``self.args`` (GRPOConfig)."""
    me = code.settings("token_truncate", 1.05, None, loss_type)
    me.use_vllm = me.vllm_importance_sampling_correction = correction
    me.importance_sampling_level = level
    me.epsilon_low, me.epsilon_high = eps
    me.get_gamma_weights = code.gamma_weights
    for name, value in {**trl_defaults(), "delta": delta, **args}.items():
        setattr(me.args, name, value)
    return me


def trl_loss(code: TRL, me, logp, old, adv, mask, engine=None, ref=None) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's ``_compute_loss``: its loss and d loss / d logp. ``engine``: the sampling log-probs, whose truncated
    ratio goes in as TRL's ``importance_sampling_ratio`` (only then, as in TRL); ``ref``: the reference's (with
    ``me.beta`` > 0)."""
    leaf = logp.clone().requires_grad_(True)
    me._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, torch.zeros_like(leaf), None)
    extra = {} if ref is None else {"ref_per_token_logps": ref}
    if engine is not None:
        extra["importance_sampling_ratio"] = code.ratio(me, old, engine, mask)
    inputs = trl_inputs(mask, adv, old, engine, **extra)
    loss = code.globals["_compute_loss"](me, None, inputs)
    loss.backward()
    return loss.detach(), leaf.grad


def ours(spec, logp, old, adv, mask, engine=None, ref=None) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logp.clone().requires_grad_(True)
    inp = PolicyLossInput(leaf, old, adv, mask, ref_logprobs=ref, engine_logprobs=engine)
    loss, _ = policy_loss(inp, spec, step_denominators(spec, mask, mask.shape[1]))
    loss.backward()
    return loss.detach(), leaf.grad


def spread_out(logp, old, scale: float):
    """The batch's current log-probs moved ``scale`` times further from the old ones (off-policy enough that the
    clip, gate or weight differs from the on-policy gradient)."""
    return old + (logp - old) * scale


def assert_same(got, want):
    torch.testing.assert_close(got[0], want[0], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(got[1], want[1], rtol=RTOL, atol=ATOL)


def test_our_defaults_are_trls():
    spec = PRESETS["grpo"]
    assert {ours: getattr(spec, ours) for ours in CONFIG_FIELDS.values()} == {
        CONFIG_FIELDS[name]: value for name, value in trl_defaults().items()
    }


@pytest.mark.parametrize("temperatures", [(1.0, 1.05), (0.5, 2.0)])
def test_sapo_equals_trl(trl_code, temperatures):
    logp, old, _, adv, mask = batch(11)
    logp = spread_out(logp, old, 4.0)
    pos, neg = temperatures
    me = trl_settings(trl_code, "sapo", sapo_temperature_pos=pos, sapo_temperature_neg=neg)
    spec = PRESETS["sapo"].override(sapo_temperature_pos=pos, sapo_temperature_neg=neg)
    want = trl_loss(trl_code, me, logp, old, adv, mask)
    assert_same(ours(spec, logp, old, adv, mask), want)
    # the gate matters here: GRPO's clipped loss is another gradient
    assert not torch.allclose(ours(PRESETS["grpo"], logp, old, adv, mask)[1], want[1], rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("shape", [(2.0, 3.0, 3.0, 2.0), (1.0, 1.5, 4.0, 3.0)])
def test_vespo_equals_trl(trl_code, shape):
    logp, old, _, adv, mask = batch(12)
    logp = spread_out(logp, old, 0.5)  # sequence ratios (products) around 1: phi far from 0 and from 1
    k_pos, lambda_pos, k_neg, lambda_neg = shape
    names = dict(vespo_k_pos=k_pos, vespo_lambda_pos=lambda_pos, vespo_k_neg=k_neg, vespo_lambda_neg=lambda_neg)
    want = trl_loss(trl_code, trl_settings(trl_code, "vespo", **names), logp, old, adv, mask)
    assert_same(ours(PRESETS["vespo"].override(**names), logp, old, adv, mask), want)
    phi = trl_code.gamma_weights(adv[:, None], logp - old, mask, None, k_pos, lambda_pos, k_neg, lambda_neg)
    assert 0.1 < float(phi.min()) and float(phi.max()) < 5 and float((phi - 1).abs().max()) > 0.05


def test_vespo_with_trl_token_truncate_equals_ours(trl_code):
    """TRL folds its token_truncate weight into VESPO's sequence ratio (and does not multiply the loss by it)."""
    logp, old, engine, adv, mask = batch(13)
    logp, engine = spread_out(logp, old, 0.3), spread_out(engine, old, 0.3)
    want = trl_loss(trl_code, trl_settings(trl_code, "vespo", correction=True), logp, old, adv, mask, engine)
    spec = PRESETS["vespo"].override(rollout_correction="token_truncate", rollout_correction_upper=1.05)
    assert_same(ours(spec, logp, old, adv, mask, engine), want)
    plain = ours(PRESETS["vespo"], logp, old, adv, mask)
    assert not torch.allclose(plain[0], want[0], rtol=1e-3, atol=0), "the correction changes this batch's loss"


def test_luspo_equals_trl_at_the_sequence_level(trl_code):
    logp, old, _, adv, mask = batch(14)
    eps = (0.02, 0.03)  # wide enough that this batch has sequences inside and outside the clip
    me = trl_settings(trl_code, "luspo", level="sequence", eps=eps)
    spec = PRESETS["luspo"].override(eps_low=eps[0], eps_high=eps[1])
    want = trl_loss(trl_code, me, logp, old, adv, mask)
    assert_same(ours(spec, logp, old, adv, mask), want)
    log_s = ((logp - old) * mask).sum(1) / mask.sum(1)
    outside = (log_s.exp() < 1 - eps[0]) | (log_s.exp() > 1 + eps[1])
    assert 0 < int(outside.sum()) < N
    gspo = ours(PRESETS["gspo"].override(eps_low=eps[0], eps_high=eps[1]), logp, old, adv, mask)
    assert not torch.allclose(gspo[0], want[0], rtol=1e-3, atol=0)


@pytest.mark.parametrize(
    "loss_type, level, weight", [("grpo", "token", "clip"), ("dapo", "token", "clip"), ("grpo", "sequence", "gspo")]
)
def test_two_sided_clip_equals_trl_delta(trl_code, loss_type, level, weight):
    logp, old, _, adv, mask = batch(15)
    logp = spread_out(logp, old, 3.0 if level == "token" else 12.0)
    delta = 1.3
    me = trl_settings(trl_code, loss_type, level=level, delta=delta)
    aggregation = {"grpo": "sequence", "dapo": "token"}[loss_type]
    spec = PRESETS["intellect2"].override(weight=weight, aggregation=aggregation, clip_delta=delta)
    want = trl_loss(trl_code, me, logp, old, adv, mask)
    assert_same(ours(spec, logp, old, adv, mask), want)
    without = ours(spec.override(clip_delta=None), logp, old, adv, mask)
    assert not torch.allclose(without[1], want[1], rtol=1e-3, atol=1e-6), "delta binds on this batch"


def test_trl_bnpo_is_a_micro_batch_token_mean_not_the_paper(trl_code):
    """One micro-batch: TRL's bnpo is our token aggregation. Two micro-batches (gradient accumulation 2): TRL sums
    each half's token mean / 2, a different number from the step's token mean, which ours keeps for any split."""
    logp, old, _, adv, mask = batch(16)
    logp = spread_out(logp, old, 2.0)
    spec = PRESETS["grpo"].override(aggregation="token")
    whole = trl_loss(trl_code, trl_settings(trl_code, "bnpo"), logp, old, adv, mask)
    assert_same(ours(spec, logp, old, adv, mask), whole)
    halves = [slice(0, 2), slice(2, N)]  # unequal token counts
    assert mask[halves[0]].sum() != mask[halves[1]].sum()
    me = trl_settings(trl_code, "bnpo")
    me.current_gradient_accumulation_steps = 2
    trl_split = sum(trl_loss(trl_code, me, logp[h], old[h], adv[h], mask[h])[0] for h in halves)
    assert not math.isclose(float(trl_split), float(whole[0]), rel_tol=1e-3)
    denominators = step_denominators(spec, mask, T)
    ours_split = sum(
        policy_loss(PolicyLossInput(logp[h], old[h], adv[h], mask[h]), spec, denominators)[0] for h in halves
    )
    assert float(ours_split) == pytest.approx(float(whole[0]), rel=1e-6)


@pytest.mark.parametrize("corrected", [False, True])
def test_the_kl_penalty_with_and_without_the_bias_correction_equals_trl(trl_code, corrected):
    """TRL adds beta * k3 (times w with ``use_bias_correction_kl``, DeepSeek-V3.2) to each token's loss before its
    loss type's reduction; with dapo's (a token mean over the step) that is our separate token mean of the KL."""
    logp, old, ref, adv, mask = batch(16)
    logp = spread_out(logp, old, 3.0)  # w far enough from 1 that the correction changes the gradient
    me = trl_settings(trl_code, "dapo", eps=(0.2, 0.28), use_bias_correction_kl=corrected)
    me.beta = 0.3
    spec = PRESETS["dapo"].override(beta=0.3, use_bias_correction_kl=corrected)
    want = trl_loss(trl_code, me, logp, old, adv, mask, ref=ref)
    assert_same(ours(spec, logp, old, adv, mask, ref=ref), want)
    other = ours(spec.override(use_bias_correction_kl=not corrected), logp, old, adv, mask, ref=ref)
    assert not torch.allclose(other[1], want[1], rtol=1e-3, atol=1e-6), "the correction matters on this batch"
