"""The rollout corrections and the loss around them against TRL's own code (TRL 1.16, ``GRPOTrainer``).

TRL's importance-sampling correction is not a function: it is an ``if`` block inside
``GRPOTrainer._generate_and_score_completions`` (trl/trainer/grpo_trainer.py, 1.16.0 lines 2660-2708:
``per_token_logps_diff = (old_per_token_logps - sampling_per_token_logps) * mask`` ... the ``raise`` for an
unknown mode), and its ratio metrics are the next ``if`` block of the same method (lines 2860-2896).
Importing ``GRPOTrainer`` takes 10-15 s (transformers' Trainer, accelerate, vLLM probes), so nothing here
imports it: the test reads the installed package's source, takes these pieces out with ``ast`` (the two
blocks, the whole ``GRPOTrainer._compute_loss`` method, the static ``get_off_policy_mask``, and ``nanmin`` /
``nanmax`` of trl/trainer/utils.py) and runs them unchanged on a stand-in ``self`` that holds TRL's settings
and returns our log-probs where TRL would run the model. So TRL's code computes the ratio, the off-policy
mask, the loss (grpo, bnpo, dapo, dr_grpo, cispo) and its gradient on the same random float32 inputs as
``grpolab.objectives``, and the two agree within float32 rounding, for each of TRL's modes (token_truncate,
token_mask, sequence_truncate, sequence_mask) with an upper bound only and with both bounds, with and without
``off_policy_mask_threshold``; grpolab's ``icepop`` is TRL's ``token_mask`` with both bounds.

Semantics, the same in both: log r = logp_old - logp_engine (logp_old: the trainer's log-probs before the
first update); the sequence ratio is the product exp(sum_t log r_t), not a geometric mean (grpolab's
geometric_* modes have no TRL counterpart); a masked token or sequence gets weight 0 and still counts in
every denominator (TRL multiplies ``per_token_loss`` by the masked ratio, then divides by the same token,
sequence or constant counts); a ratio exactly at a bound is kept; the weight multiplies the policy surrogate
after the off-policy mask and before the KL term (the KL term is not reweighted).

Differences found (docs/algorithms.md, "Rollout corrections", says them too):
- TRL's ``vllm_importance_sampling_clip_max`` may be None (mask modes: no upper bound); grpolab's upper bound
  is always a number.
- TRL replaces a NaN sampling log-prob (a token vLLM could not score) by a log ratio of 0; grpolab's engines
  always return every log-prob, so there is no such case.
- TRL's ``sampling/importance_sampling_ratio/mean`` in a sequence mode is a mean over sequences; grpolab's
  ``rollout_is_weight_mean`` is a mean over response tokens (a long sequence weighs more). In token modes
  they are the same number (checked below), and so are the maxima.
- TRL's cispo caps the ratio at ``epsilon_high`` itself; grpolab's at 1 + eps_high (checked below with the
  translation).
"""

from __future__ import annotations

import ast
import importlib.util
import math
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")

from grpolab.objectives.losses import PolicyLossInput, policy_loss, step_denominators  # noqa: E402
from grpolab.objectives.presets import PRESETS  # noqa: E402
from grpolab.objectives.rollout_correction import off_policy_sequence_mask, rollout_correction  # noqa: E402

TRL_MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
# TRL loss_type -> grpolab aggregation (and weight)
LOSS_TYPES = {"grpo": "sequence", "bnpo": "token", "dapo": "token", "dr_grpo": "constant", "cispo": "token"}
N, T = 8, 12
RTOL, ATOL = 2e-5, 1e-6  # float32 rounding: sums in another order


def _trl_source(relative: str) -> tuple[str, ast.Module]:
    spec = importlib.util.find_spec("trl")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    text = path.read_text()
    return text, ast.parse(text)


def _function(tree: ast.AST, name: str) -> ast.FunctionDef:
    found = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name]
    if len(found) != 1:
        pytest.fail(f"trl {trl.__version__}: expected one function {name} in its source, found {len(found)}")
    return found[0]


def _run(nodes: list[ast.stmt], namespace: dict) -> dict:
    for node in nodes:
        if isinstance(node, ast.FunctionDef):
            node.decorator_list = []  # @staticmethod, @torch.no_grad(), @profiling_decorator
    module = ast.fix_missing_locations(ast.Module(body=nodes, type_ignores=[]))
    exec(compile(module, "<trl>", "exec"), namespace)  # TRL's code, unchanged
    return namespace


class TRL:
    """TRL's pieces, each taken once from the installed package's source."""

    def __init__(self) -> None:
        _, utils = _trl_source("trainer/utils.py")
        helpers = _run([_function(utils, "nanmin"), _function(utils, "nanmax")], {"torch": torch})
        _, grpo = _trl_source("trainer/grpo_trainer.py")
        self.globals = {"torch": torch, "math": math, "nanmin": helpers["nanmin"], "nanmax": helpers["nanmax"]}
        _run([_function(grpo, "_compute_loss"), _function(grpo, "get_off_policy_mask")], self.globals)
        generate = _function(grpo, "_generate_and_score_completions")
        blocks = [
            n
            for n in ast.walk(generate)
            if isinstance(n, ast.If)
            and ast.unparse(n.test) == "self.use_vllm and self.vllm_importance_sampling_correction"
        ]
        ratio = [b for b in blocks if "vllm_importance_sampling_ratio = torch.exp" in ast.unparse(b)]
        metrics = [b for b in blocks if "sampling/importance_sampling_ratio/mean" in ast.unparse(b)]
        if len(ratio) != 1 or len(metrics) != 1:
            pytest.fail(f"trl {trl.__version__}: its importance-sampling blocks moved; this test reads TRL 1.16's")
        self.ratio_block, self.metrics_block = ratio[0], metrics[0]

    def settings(self, mode: str, upper: float | None, lower: float | None, loss_type="grpo", threshold=None):
        """A stand-in ``self`` with TRL's settings (GRPOConfig's defaults otherwise) and one process."""
        accelerator = SimpleNamespace(
            num_processes=1, gather=lambda x: x.reshape(-1) if x.dim() == 0 else x, reduce=lambda x, reduction: x
        )
        return SimpleNamespace(
            use_vllm=True,
            vllm_importance_sampling_correction=True,
            vllm_importance_sampling_mode=mode,
            vllm_importance_sampling_clip_max=upper,
            vllm_importance_sampling_clip_min=lower,
            off_policy_mask_threshold=threshold,
            get_off_policy_mask=self.globals["get_off_policy_mask"],
            loss_type=loss_type,
            epsilon_low=0.2,
            epsilon_high=5.0 if loss_type == "cispo" else 0.2,
            importance_sampling_level="token",
            beta=0.0,
            top_entropy_quantile=1.0,
            aux_loss_enabled=False,
            _entropy_bonus_enabled=False,
            max_completion_length=T,
            current_gradient_accumulation_steps=1,
            model=SimpleNamespace(training=True),
            args=SimpleNamespace(delta=None, steps_per_generation=1, use_bias_correction_kl=False),
            accelerator=accelerator,
            _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        )

    def ratio(self, me, old, engine, mask) -> torch.Tensor:
        """TRL's ``vllm_importance_sampling_ratio``: [N, T] in token modes, [N, 1] in sequence modes."""
        space = {
            "self": me,
            "torch": torch,
            "math": math,
            "completion_mask": mask,
            "tool_mask": None,
            "old_per_token_logps": old,
            "sampling_per_token_logps": engine,
        }
        _run([self.ratio_block], space)
        self.last = space
        return space["vllm_importance_sampling_ratio"]

    def ratio_metrics(self, me) -> dict[str, float]:
        """TRL's ``sampling/...`` metrics of the last ``ratio`` call."""
        space = {**self.last, "mode": "train", "device": "cpu", **self.globals}
        _run([self.metrics_block], space)
        return {k: v[-1] for k, v in me._metrics["train"].items() if k.startswith("sampling/")}

    def loss(self, me, logp, old, engine, adv, mask) -> tuple[torch.Tensor, torch.Tensor]:
        """TRL's ``_compute_loss`` (its loss and the gradient d loss / d logp); ``logp`` stands for the model's
        per-token log-probs of the completions (the prompt is empty)."""
        leaf = logp.clone().requires_grad_(True)
        me._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, torch.zeros_like(leaf), None)
        inputs = trl_inputs(mask, adv, old, engine, importance_sampling_ratio=self.ratio(me, old, engine, mask))
        loss = self.globals["_compute_loss"](me, None, inputs)
        loss.backward()
        return loss.detach(), leaf.grad


def trl_inputs(mask, adv, old, engine=None, **extra) -> dict:
    """The ``inputs`` of TRL's ``_compute_loss`` for completions [n, T] from position 0 with an empty prompt;
    ``engine`` the sampling log-probs (None: none given), ``extra`` further keys (the ratio, the reference's)."""
    n, t = mask.shape
    inputs = {
        "prompt_ids": torch.zeros(n, 0, dtype=torch.long),
        "prompt_mask": torch.zeros(n, 0, dtype=torch.long),
        "completion_ids": torch.zeros(n, t, dtype=torch.long),
        "completion_mask": mask,
        "advantages": adv,
        "old_per_token_logps": old,
        "num_items_in_batch": mask.sum(),
        **extra,
    }
    if engine is not None:
        inputs["sampling_per_token_logps"] = engine
    return inputs


@pytest.fixture(scope="module")
def trl_code() -> TRL:
    return TRL()


def batch(seed: int):
    """float32, TRL's layout: each completion from position 0, right-padded; engine log-probs ~0.3 off."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, T + 1, (N,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(torch.float32)
    old = -torch.rand(N, T, generator=g) * 3
    engine = old + torch.randn(N, T, generator=g) * 0.3
    logp = old + torch.randn(N, T, generator=g) * 0.15
    adv = torch.randn(N, generator=g)
    return logp, old, engine, adv, mask


def band(mode: str, old, engine, mask) -> tuple[float, float]:
    """(upper, lower) strictly between this batch's ratios, so that each bound cuts some and keeps some."""
    log_r = (old - engine) * mask
    if mode.startswith("sequence"):
        values = torch.exp(log_r.sum(1)).sort().values
        return float((values[-2] * values[-3]).sqrt()), float((values[1] * values[2]).sqrt())
    values = torch.exp(log_r[mask.bool()]).sort().values
    k = len(values)
    return float(values[int(0.8 * k)] + values[int(0.8 * k) + 1]) / 2, float(values[k // 5] + values[k // 5 + 1]) / 2


def ours(mode, upper, lower, loss_type, threshold, logp, old, engine, adv, mask):
    """grpolab's loss and gradient: the grpo preset with TRL's aggregation, weight and bounds."""
    spec = PRESETS["grpo"].override(
        aggregation=LOSS_TYPES[loss_type],
        rollout_correction=mode,
        rollout_correction_upper=upper,
        rollout_correction_lower=lower,
        off_policy_mask_delta=threshold,
        **({"weight": "cispo", "eps_high": 4.0} if loss_type == "cispo" else {}),  # TRL's cap 5 = 1 + 4
    )
    leaf = logp.clone().requires_grad_(True)
    inp = PolicyLossInput(leaf, old, adv, mask, engine_logprobs=engine)
    loss, metrics = policy_loss(inp, spec, step_denominators(spec, mask, T))
    loss.backward()
    return loss.detach(), leaf.grad, metrics.means()


@pytest.mark.parametrize("two_sided", [False, True])
@pytest.mark.parametrize("mode", TRL_MODES)
def test_each_trl_mode_gives_our_weights(trl_code, mode, two_sided):
    _, old, engine, _, mask = batch(1)
    upper, lower = band(mode, old, engine, mask)
    lower = lower if two_sided else None
    theirs = trl_code.ratio(trl_code.settings(mode, upper, lower), old, engine, mask)
    got = rollout_correction(old - engine, mask, mode, upper, lower)
    on = mask.bool()
    torch.testing.assert_close(got.weight[on], theirs.expand(N, T)[on], rtol=RTOL, atol=0)
    cut = got.truncated if mode.endswith("truncate") else ~got.kept
    assert 0 < int((cut & on).sum()) < int(on.sum()), "the band cuts some tokens and keeps some"
    if mode.endswith("mask"):  # TRL's ratio is 0 exactly where ours drops
        assert torch.equal(theirs.expand(N, T)[on] == 0, ~got.kept[on])


@pytest.mark.parametrize("threshold", [None, 0.05])
@pytest.mark.parametrize("loss_type", list(LOSS_TYPES))
@pytest.mark.parametrize("mode", TRL_MODES)
def test_trl_loss_and_gradient_equal_ours(trl_code, mode, loss_type, threshold):
    logp, old, engine, adv, mask = batch(2)
    upper, lower = band(mode, old, engine, mask)
    want, want_grad = trl_code.loss(
        trl_code.settings(mode, upper, lower, loss_type, threshold), logp, old, engine, adv, mask
    )
    loss, grad, _ = ours(mode, upper, lower, loss_type, threshold, logp, old, engine, adv, mask)
    torch.testing.assert_close(loss, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, want_grad, rtol=RTOL, atol=ATOL)
    # the correction matters here: without it the loss is another number
    plain, _, _ = ours("none", upper, None, loss_type, threshold, logp, old, engine, adv, mask)
    assert not torch.allclose(plain, want, rtol=1e-3, atol=0)
    if threshold is not None:  # and the off-policy mask drops some sequences, not all
        kept = trl_code.globals["get_off_policy_mask"](adv[:, None], logp, engine, mask, threshold)
        assert 0 < int(kept.sum()) < N


def test_icepop_is_trl_token_mask_with_both_bounds(trl_code):
    logp, old, engine, adv, mask = batch(3)
    upper, lower = band("token_mask", old, engine, mask)
    want, want_grad = trl_code.loss(trl_code.settings("token_mask", upper, lower, "dapo"), logp, old, engine, adv, mask)
    loss, grad, _ = ours("icepop", upper, lower, "dapo", None, logp, old, engine, adv, mask)
    torch.testing.assert_close(loss, want, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(grad, want_grad, rtol=RTOL, atol=ATOL)


def test_trl_off_policy_mask_is_ours(trl_code):
    logp, old, engine, adv, mask = batch(4)
    current = logp - 0.2 * torch.rand(N, T, generator=torch.Generator().manual_seed(5))
    dropped = []
    for delta in (0.0, 0.05, 0.1, 0.3):
        theirs = trl_code.globals["get_off_policy_mask"](adv[:, None], current, engine, mask, delta)  # [N, 1]
        kept = off_policy_sequence_mask(engine, current, adv, mask, delta)
        assert [bool(x) for x in theirs[:, 0]] == [bool(kept[i][mask[i].bool()].all()) for i in range(N)]
        dropped.append(int((theirs == 0).sum()))
    assert max(dropped) > 0 and all(d < N for d in dropped), dropped


@pytest.mark.parametrize("mode", TRL_MODES)
def test_trl_ratio_metrics_against_ours(trl_code, mode):
    """Token modes: TRL's mean and max of the corrected ratio are rollout_is_weight_mean / _max. Sequence
    modes: TRL's mean is over sequences, ours over tokens (the max is the same)."""
    logp, old, engine, adv, mask = batch(6)
    upper, lower = band(mode, old, engine, mask)
    me = trl_code.settings(mode, upper, lower)
    ratio = trl_code.ratio(me, old, engine, mask)
    theirs = trl_code.ratio_metrics(me)
    _, _, m = ours(mode, upper, lower, "grpo", None, logp, old, engine, adv, mask)
    assert m["rollout_is_weight_max"] == pytest.approx(theirs["sampling/importance_sampling_ratio/max"], rel=RTOL)
    if mode.startswith("token"):
        assert m["rollout_is_weight_mean"] == pytest.approx(theirs["sampling/importance_sampling_ratio/mean"], rel=RTOL)
    else:
        per_token = float((ratio * mask).sum() / mask.sum())
        assert m["rollout_is_weight_mean"] == pytest.approx(per_token, rel=RTOL)
        assert theirs["sampling/importance_sampling_ratio/mean"] == pytest.approx(float(ratio.mean()), rel=RTOL)
        assert m["rollout_is_weight_mean"] != pytest.approx(theirs["sampling/importance_sampling_ratio/mean"], rel=1e-3)


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_a_ratio_exactly_at_a_bound_is_kept_by_both(trl_code, mode):
    _, old, engine, _, mask = batch(7)
    me = trl_code.settings(mode, math.inf, None)
    ratios = trl_code.ratio(me, old, engine, mask).expand(N, T)[mask.bool()]  # TRL's own ratios, unbounded
    upper, lower = float(ratios.max()), float(ratios.min())  # float32 values, exact in float64 too
    theirs = trl_code.ratio(trl_code.settings(mode, upper, lower), old, engine, mask).expand(N, T)[mask.bool()]
    got = rollout_correction(old - engine, mask, mode, upper, lower)
    assert (theirs > 0).all() and got.kept[mask.bool()].all()
    assert not rollout_correction(old - engine, mask, mode, upper * (1 - 1e-6), lower).kept[mask.bool()].all()
