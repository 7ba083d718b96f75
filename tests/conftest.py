"""Fixtures: a character-level tokenizer and tiny random causal LMs, built and saved locally.

Nothing is downloaded. Models are saved with ``save_pretrained`` into a session tmp dir and
loaded back with ``AutoModelForCausalLM`` / ``AutoTokenizer``, like real checkpoints.
"""

from __future__ import annotations

import os
import string
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from reward_model_fixtures import save_reward_model
from tiny_configs import VLLM_SIZES, tiny_fields, tiny_llama
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    Olmo2Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from grpolab.config import RunConfig, load_config
from grpolab.models.tinymodel import WarmStartSettings, warm_start_model
from grpolab.run.rundir import read_metrics
from grpolab.tasks import ArithmeticTask

GSM8K_DIR = Path(__file__).resolve().parents[1] / "data" / "gsm8k"
SPECIAL_TOKENS = ["<pad>", "<unk>", "<eos>"]
TAG_TOKENS = ["<think>", "</think>", "<answer>", "</answer>"]
ARCHS = ("llama", "qwen2", "qwen3", "olmo2")

# Tiny models run fastest on one thread, and several threads on a busy 2-core machine can be
# ~100x slower (OpenMP oversubscription). Override with GRPOLAB_TEST_THREADS.
torch.set_num_threads(int(os.environ.get("GRPOLAB_TEST_THREADS", "1")))


# The unit tier (`pytest -m unit`, under 2 minutes on 2 cores): the modules whose tests run in this process in
# seconds (formulas against float64 references, tasks and graders, the engine contract on tiny models, configs,
# layers and lint); the default tier adds the runs, engines, processes and suites. tests/README.md: the tiers.
UNIT_MODULES = frozenset(
    """
    test_advantages test_sequential test_failed_samples test_algorithms test_answers test_architectures test_batching test_calculator test_engine_weights
    test_chat_arithmetic test_chat_prompts test_checkpoint_load test_dataset_task test_decode test_dropout
    test_dynamic_sampling test_engine_capabilities test_engine_config test_eval_records test_gguf test_gpu_check
    test_grouped_attention test_gsm8k test_help test_kv_cache test_layers test_lint test_logprobs test_losses test_maxrl_rewards
    test_packed_linear test_policy test_policy_mask test_precision test_prompt_tokens test_provenance test_report_reward_models
    test_health test_refill test_report_stats test_reward_model test_rollout_hf test_sandbox test_score_norm test_shaping test_shared_prefix
    test_sync_check test_task_members test_tasks test_tinymodel test_tool_protocol test_update test_verifiers test_rollout_correction
    test_rollout_correction_trl test_trl_loss_types test_objectives_trl test_reasoning_gym
    test_verl_losses test_advantage_variants test_token_selection test_token_selection_trl test_distillation
    test_endpoint test_cli_imports test_trl_names test_tracker_registry test_surrogate_registry
""".split()
)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.path.stem in UNIT_MODULES:
            item.add_marker(pytest.mark.unit)


def pytest_runtest_logreport(report) -> None:
    """With ``GRPOLAB_TEST_TIMES=FILE``: one line per test phase (node id, phase, seconds) appended as it ends, so
    a profile of the suite survives an interrupted run (``tests/README.md``: keeping the tiers in budget)."""
    path = os.environ.get("GRPOLAB_TEST_TIMES")
    if path:
        with open(path, "a") as out:
            out.write(f"{report.nodeid}\t{report.when}\t{report.duration:.3f}\n")


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Char-level WordLevel tokenizer: printable ASCII + the 4 tags as single tokens (107 ids)."""
    chars = list(dict.fromkeys(string.printable))
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def _config(arch: str, vocab_size: int, pad_id: int, eos_id: int, max_positions: int = 256):
    common = tiny_fields(vocab_size, pad_id, eos_id, max_position_embeddings=max_positions)
    if arch == "llama":
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        return Qwen3Config(**{**common, "head_dim": 8, "tie_word_embeddings": True})
    if arch == "olmo2":
        return Olmo2Config(**common)
    raise ValueError(f"unknown arch {arch!r}")


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("char_tokenizer")
    build_char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def save_tiny_models(tmp_path_factory, tokenizer, max_positions: int) -> dict[str, Path]:
    """One saved tiny random checkpoint (model + tokenizer) per architecture."""
    dirs = {}
    for i, arch in enumerate(ARCHS):
        torch.manual_seed(1234 + i)
        config = _config(arch, len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, max_positions)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        path = tmp_path_factory.mktemp(f"tiny_{arch}_{max_positions}")
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    return save_tiny_models(tmp_path_factory, tokenizer, max_positions=256)


@pytest.fixture(scope="session")
def long_context_model_dirs(tmp_path_factory, tokenizer) -> dict[str, Path]:
    """Tiny random models whose context holds a character-level GSM8K prompt plus 512 new tokens."""
    return save_tiny_models(tmp_path_factory, tokenizer, max_positions=2048)


@pytest.fixture(scope="session")
def vllm_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A tiny float32 Llama vLLM's CPU attention takes (head_dim 32; the conftest models' 8 it does not),
    with tied embeddings like the demo's model (the harder case for the CPU weight reload)."""
    config = tiny_llama(tokenizer, 256, **VLLM_SIZES, tie_word_embeddings=True)
    torch.manual_seed(1)
    path = tmp_path_factory.mktemp("tiny_llama_hd32")
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def make_tiny_model(tiny_model_dirs) -> Callable[[str], torch.nn.Module]:
    """``make_tiny_model(arch)`` -> a fresh float32 tiny model in eval mode, loaded from disk."""

    def make(arch: str) -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch], dtype=torch.float32)
        return model.eval()

    return make


def assert_engine_contract(out, prompts, tokenizer, max_new_tokens: int) -> None:
    """The rollout-engine contract (grpolab.rollout.base) on ``out`` = engine.generate(prompts, n, ...)."""
    for prompt, group in zip(prompts, out):
        for c in group:
            assert c.prompt_ids == prompt
            assert 1 <= len(c.completion_ids) <= max_new_tokens and len(c.logprobs) == len(c.completion_ids)
            assert all(lp <= 0 for lp in c.logprobs)
            ends_on_eos = c.completion_ids[-1] == tokenizer.eos_token_id
            assert c.finish_reason == ("stop" if ends_on_eos else "length")
            if c.finish_reason == "length":
                assert len(c.completion_ids) == max_new_tokens
            assert tokenizer.eos_token_id not in c.completion_ids[:-1]
            assert c.text == tokenizer.decode(c.completion_ids, skip_special_tokens=True)


def descendants(root: int | None = None) -> set[int]:
    """Live descendants of ``root`` (default: this process), from /proc; multiprocessing's resource
    tracker excepted (it outlives its users by design and exits with the interpreter)."""
    parent: dict[int, int] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except (OSError, ValueError):
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z":
            parent[int(entry)] = int(ppid)
    found, frontier = set(), {root or os.getpid()}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return {pid for pid in found if b"resource_tracker" not in _cmdline(pid)}


def live_processes() -> dict[int, list[str]]:
    """Every running process (zombies, which only wait to be reaped, excepted): pid -> the fields of its
    /proc stat after the name (state, ppid, pgrp, session, ...)."""
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z":
            found[int(entry)] = fields
    return found


def group_members(pgid: int) -> set[int]:
    """Live processes of process group ``pgid`` (orphans re-parented to init included)."""
    return {pid for pid, fields in live_processes().items() if int(fields[2]) == pgid}


def session_members(sid: int) -> set[int]:
    """Live processes of session ``sid`` (orphans re-parented to init included)."""
    return {pid for pid, fields in live_processes().items() if int(fields[3]) == sid}


def wait_until_gone(members: Callable[[], set[int]], seconds: float = 15.0) -> set[int]:
    """``members()`` once it is empty, or after ``seconds``."""
    deadline = time.monotonic() + seconds
    while members() and time.monotonic() < deadline:
        time.sleep(0.2)
    return members()


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# ---- a briefly warm-started demo model for RL-loop tests ---------------------------------------
TASK = {"n_train": 60, "n_val": 16, "digits": 1}  # one-digit sums: a few seconds of warm start give ~30% reward
QUICK_WARM_START = WarmStartSettings(
    steps=150,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    intermediate_size=128,
    batch_size=32,
    lr=5e-3,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="session")
def warm_model_dir(tmp_path_factory):
    """A briefly warm-started tiny model: some samples right, some wrong (so advantages are non-zero)."""
    return warm_start_model(ArithmeticTask(**TASK), QUICK_WARM_START, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def warm_teacher_dir(tmp_path_factory):
    """On-policy distillation's teacher: the same tokenizer as ``warm_model_dir`` (built from the same task), a
    model warm-started as long from another seed (so it differs from the student everywhere)."""
    settings = QUICK_WARM_START.model_copy(update={"seed": 1})
    return warm_start_model(ArithmeticTask(**TASK), settings, cache_dir=tmp_path_factory.mktemp("teacher_cache"))


@pytest.fixture(scope="session")
def warm_moe_dir(tmp_path_factory):
    """The same warm start as a Qwen3-MoE (4 experts of 64 per layer, top 2)."""
    settings = QUICK_WARM_START.model_copy(
        update={"arch": "qwen3_moe", "num_experts": 4, "experts_per_token": 2, "moe_intermediate_size": 64}
    )
    return warm_start_model(ArithmeticTask(**TASK), settings, cache_dir=tmp_path_factory.mktemp("moe_cache"))


def float64_norms(model) -> None:
    """transformers' RMSNorm computes in float32 (a downcast of float64 activations), which would bury a
    finite difference in rounding: the same formula in the activations' dtype instead."""

    def forward(norm, x):
        return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))

    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = forward.__get__(module)


TASK_SETTINGS = {f"task.{k}": v for k, v in TASK.items()}  # TASK as settings (``--task.digits=1`` ...)


def cli_pairs(settings: dict) -> list[str]:
    """``settings`` as a command line gives them: ``--key value`` each (as ``grpolab train`` reads overrides)."""
    return [arg for key, value in settings.items() for arg in (f"--{key}", str(value))]


def bench_args(kind: str, engines: str, report: Path, model_dir: Path) -> list[str]:
    """``grpolab bench KIND``'s command line: ``engines`` timed once each with the model in ``model_dir`` on TASK
    (4 prompts a step, 24 new tokens, one thread), the figures written to ``report``."""
    settings = {**TASK_SETTINGS, "rollout.prompts_per_step": 4, "rollout.max_new_tokens": 24, "threads": 1}
    head = ["bench", kind, "--engines", engines, "--repeats", "1", "--json", str(report), "--model", str(model_dir)]
    return [*head, *cli_pairs(settings)]


def quick_settings(model_dir, out) -> dict:
    """The settings of a quick run (``quick_config``), as ``--key=value`` overrides name them."""
    return {
        "model.path": str(model_dir),
        "output_dir": str(out),
        "steps": 2,
        **TASK_SETTINGS,
        "rollout.prompts_per_step": 4,
        "rollout.group_size": 8,
        "rollout.max_new_tokens": 40,
        "optim.micro_batch_size": 16,
        "optim.lr": 1e-3,
        "eval.every": 2,
        "checkpoint.every": 2,
    }


def quick_config(model_dir, out, **overrides) -> RunConfig:
    return load_config(None, {**quick_settings(model_dir, out), **overrides})


def first_update_of_gspo(model_dir, out, **overrides) -> dict:
    """Step 1 of a quick GSPO run (four optimizer steps on one batch, sync check on, micro-batches of 8) with
    ``overrides``: its record, checked to have ratios of exactly 1 in its first update."""
    from grpolab.run.trainer import Trainer

    settings = {"rollout.sync_check": True, "optim.micro_batch_size": 8, **overrides}
    trainer = Trainer(quick_config(model_dir, out, algo="gspo", **settings))
    try:
        record = trainer.train_step(1)
    finally:
        trainer.close()
    assert record["attempted_updates"] == 4 and record["actual_updates"] >= 1
    assert record["first_update/ratio_min"] == 1.0 and record["first_update/ratio_max"] == 1.0
    return record


def quick_run(tmp_path_factory, model_dir, name: str, **overrides) -> Path:
    """A finished quick run (``quick_config`` with ``overrides``) of the model in ``model_dir``, in a new folder
    ``name``: the reference a module's tests compare their runs with."""
    from grpolab.run.trainer import train

    run = tmp_path_factory.mktemp(name) / "run"
    train(quick_config(model_dir, run, **overrides))
    return run


def run_config(model_dir, out, settings: dict) -> RunConfig:
    """The config of a run of the model in ``model_dir`` writing to ``out``: ``settings`` (named as ``--key=value``
    overrides name them) over the defaults."""
    return load_config(None, {"model.path": str(model_dir), "output_dir": str(out), **settings})


def train_until(cfg, stop_at: int, *args) -> None:
    """``train(cfg, *args)`` interrupted (KeyboardInterrupt: a kill, in process) as step ``stop_at`` begins: after
    step ``stop_at - 1``'s records, before step ``stop_at``'s."""
    from grpolab.run.trainer import Trainer, train

    original = Trainer.train_step

    def die(self, step, *step_args):
        if step == stop_at:
            raise KeyboardInterrupt
        return original(self, step, *step_args)

    Trainer.train_step = die
    try:
        with pytest.raises(KeyboardInterrupt):
            train(cfg, *args)
    finally:
        Trainer.train_step = original


def untimed(records: list[dict]) -> list[dict]:
    """Metrics records without their timings (``time/*``, ``tokens_per_s``): what two runs of one config share."""
    return [{k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"} for r in records]


def run_numbers(run_dir: Path) -> list[dict]:
    """The untimed records of the run in ``run_dir`` (its metrics.jsonl): what an exact resume must reproduce."""
    return untimed(read_metrics(Path(run_dir) / "metrics.jsonl"))


def params_of(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.fixture(scope="session")
def reward_model_dir(tmp_path_factory, tokenizer) -> Path:
    """A random one-label reward model with the character tokenizer (pad token ``<pad>``, no chat template)."""
    return save_reward_model(tmp_path_factory.mktemp("reward_model"), tokenizer, max_positions=512)
