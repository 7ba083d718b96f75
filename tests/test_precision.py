"""Training precision: bf16 weights must still move like the fp32 reference; bf16 runs track fp32 runs."""

from __future__ import annotations

import contextlib
import copy
import statistics
import warnings

import pytest
import torch
from conftest import first_update_of_gspo, quick_config
from rich.console import Console
from tiny_configs import tiny_sizes
from transformers import AutoModelForCausalLM, LlamaConfig

from grpolab.models.logprobs import token_logprobs
from grpolab.models.precision import BYTES_PER_PARAMETER, memory_table, resolve_precision
from grpolab.run.rundir import read_metrics
from grpolab.run.trainer import Trainer

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def bf16_model():
    """A small random Llama whose weights are exactly representable in bf16 (a bf16 checkpoint)."""
    torch.manual_seed(0)
    sizes = tiny_sizes(vocab_size=512, hidden_size=64, intermediate_size=256, num_key_value_heads=4)
    config = LlamaConfig(**sizes, max_position_embeddings=128, tie_word_embeddings=False)
    return AutoModelForCausalLM.from_config(config).to(torch.bfloat16).float().eval()


def accumulated_change(base, setting: str, steps: int = 20, lr: float = 1e-5) -> torch.Tensor:
    """Flat fp32 change of every weight after ``steps`` AdamW steps of a fixed policy-gradient loss.

    ``setting`` "reference" = float32 weights, float32 compute, torch AdamW. For bf16_compensated the
    change is that of the optimizer's effective weights (bf16 weight + Kahan compensation).
    """
    compute = torch.float32 if setting == "reference" else torch.bfloat16
    precision = resolve_precision("fp32_master" if setting == "reference" else setting, compute, warn=False)
    model = copy.deepcopy(base).to(precision.storage)
    optimizer = precision.optimizer(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (16, 64), generator=g)
    advantages = torch.randn(16, 1, generator=g)
    start = [p.detach().float().clone() for p in model.parameters()]
    for _ in range(steps):
        optimizer.zero_grad()
        with precision.autocast(CPU):
            logprobs = token_logprobs(model, ids, torch.ones_like(ids)).logprobs
        (-(advantages * logprobs).mean()).backward()
        optimizer.step()

    def effective(p):
        comp = optimizer.state[p].get("kahan_comp") if setting == "bf16_compensated" else None
        return p.detach().float() + (comp.float() if comp is not None else 0.0)

    return torch.cat([(effective(p) - s).flatten() for p, s in zip(model.parameters(), start)])


def test_bf16_settings_move_the_weights_like_the_fp32_reference(bf16_model):
    reference = accumulated_change(bf16_model, "reference")
    error = {
        s: float((accumulated_change(bf16_model, s) - reference).norm() / reference.norm())
        for s in ("fp32_master", "bf16_compensated", "bf16")
    }
    assert error["fp32_master"] < 0.05, error
    assert error["bf16_compensated"] < 0.05, error
    assert error["bf16"] > 0.5, error  # plain bf16 AdamW: most updates round away


def test_plain_bf16_leaves_most_weights_bit_identical_and_warns(bf16_model):
    with pytest.warns(UserWarning, match="rounds away"):
        resolve_precision("bf16", torch.bfloat16)
    change = accumulated_change(bf16_model, "bf16", steps=1)
    master = accumulated_change(bf16_model, "fp32_master", steps=1)
    assert (change == 0).float().mean() > 0.5 and (master == 0).float().mean() < 0.05


def test_precision_settings_and_memory_table():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for setting in ("fp32_master", "bf16_compensated", "bf16"):
            p = resolve_precision(setting, torch.float32)
            assert (p.name, p.storage, p.compute) == ("float32", torch.float32, torch.float32)
    master = resolve_precision("fp32_master", torch.bfloat16)
    assert (master.storage, master.compute) == (torch.float32, torch.bfloat16)
    with master.autocast(CPU):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    compensated = resolve_precision("bf16_compensated", torch.bfloat16)
    assert compensated.storage == torch.bfloat16
    optimizer = compensated.optimizer(
        [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))], lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0
    )
    assert type(optimizer).__module__.startswith("optimi")
    table = memory_table(1000)
    assert table["fp32_master"]["total"] == 16000 and table["bf16_compensated"]["total"] == 10000
    assert table["bf16"]["total"] == 8000 and set(table) == set(BYTES_PER_PARAMETER)


def run_rewards(model_dir, out, **overrides) -> tuple[list[float], list[float]]:
    cfg = quick_config(
        model_dir,
        out,
        **{"steps": 8, "eval.every": 100, "checkpoint.every": 100, "rollout.prompts_per_step": 8, **overrides},
    )
    trainer = Trainer(cfg, Console(quiet=True))
    try:
        trainer.run()
    finally:
        trainer.close()
    steps = [m for m in read_metrics(out / "metrics.jsonl") if "reward_mean" in m]
    return [m["reward_mean"] for m in steps], [m["grad_norm"] for m in steps if "grad_norm" in m]


def test_short_bf16_run_tracks_the_fp32_run(warm_model_dir, tmp_path):
    fp32_rewards, fp32_norms = run_rewards(warm_model_dir, tmp_path / "fp32", **{"model.dtype": "float32"})
    bf16_rewards, bf16_norms = run_rewards(warm_model_dir, tmp_path / "bf16", **{"model.dtype": "bfloat16"})
    # 64 samples a step: the standard error of a step's mean reward is <= 0.0625; of the 8-step mean <= 0.022
    assert abs(statistics.mean(fp32_rewards) - statistics.mean(bf16_rewards)) < 0.1, (fp32_rewards, bf16_rewards)
    # it does not drift away: the last four steps too (at lr 3e-3 both runs collapse within 2 steps, which
    # would make this vacuous; at 1e-3 both stay near the start)
    assert abs(statistics.mean(fp32_rewards[4:]) - statistics.mean(bf16_rewards[4:])) < 0.1, (
        fp32_rewards,
        bf16_rewards,
    )
    assert all(0 < n < 10 * max(fp32_norms) for n in bf16_norms)


def test_the_engine_receives_weights_in_its_compute_dtype(bf16_model, tmp_path):
    from safetensors.torch import load_file

    from grpolab.rollout.vllm.engine import save_weights

    tensors = load_file(save_weights(bf16_model, tmp_path, "bfloat16"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    name, weight = next(iter(bf16_model.named_parameters()))
    assert torch.equal(tensors[name], weight.detach().bfloat16())
    assert {t.dtype for t in load_file(save_weights(bf16_model, tmp_path)).values()} == {torch.float32}


def _two_bf16_steps(model_dir, out, algo: str):
    """(the weights after two RL steps of ``algo`` in a bf16 run on float32 masters, with 8 prompts x 8 per step in
    micro-batches of 8, and the count of casts (``aten::_to_copy``) made meanwhile)."""
    from grpolab.common.progress import Reporter
    from grpolab.run.parts import assemble
    from grpolab.run.step import rl_step

    cfg = quick_config(
        model_dir,
        out,
        algo=algo,
        **{"model.dtype": "bfloat16", "rollout.prompts_per_step": 8, "optim.micro_batch_size": 8},
    )
    parts = assemble(cfg, lambda ranks: Reporter(Console(quiet=True)))
    try:
        with torch.profiler.profile() as prof:
            for step in (1, 2):
                rl_step(parts, step)
        casts = sum(e.count for e in prof.key_averages() if e.key == "aten::_to_copy")
        return {k: v.detach().clone() for k, v in parts.model.state_dict().items()}, casts
    finally:
        parts.close()


@pytest.mark.parametrize("algo", ["grpo", "gspo"])  # gspo: four optimizer steps a batch, a fresh cast each
def test_one_weight_cast_per_optimizer_step_trains_exactly_as_a_cast_per_micro_batch(
    warm_model_dir, tmp_path, monkeypatch, algo
):
    """With float32 masters each weight is cast to bf16 once per optimizer step (one autocast context over the
    step's micro-batches, the backward outside autocast) and once per frozen pass, not in every micro-batch's
    forward: the same gradients, so the same weights after two steps, with fewer casts."""
    from grpolab.learning.learner import BatchForward

    scoped, scoped_casts = _two_bf16_steps(warm_model_dir, tmp_path / "scoped", algo)
    monkeypatch.setattr(BatchForward, "cast_scope", lambda self, model: contextlib.nullcontext())
    per_forward, per_forward_casts = _two_bf16_steps(warm_model_dir, tmp_path / "per_forward", algo)
    assert scoped.keys() == per_forward.keys()
    # every weight bit for bit but the tied embedding / output layer, the one weight with two gradients, which
    # differs in its last bits (float32 rounding)
    tied = {"model.embed_tokens.weight", "lm_head.weight"}
    assert all(torch.equal(scoped[k], per_forward[k]) for k in scoped.keys() - tied)
    assert all(torch.allclose(scoped[k], per_forward[k], rtol=0, atol=1e-7) for k in tied)
    assert scoped_casts < per_forward_casts


def test_the_first_update_of_a_bf16_multi_update_step_has_ratios_of_exactly_one(warm_model_dir, tmp_path):
    """bf16 on float32 masters, one GSPO batch (four optimizer steps): the old log-probs (a frozen pass, one cast
    per weight) and the first update's forwards (one cast per weight for the step, attention with a float32
    backward) compute the same numbers, so the first update's ratios are exactly 1."""
    first_update_of_gspo(warm_model_dir, tmp_path / "run", **{"model.dtype": "bfloat16"})
