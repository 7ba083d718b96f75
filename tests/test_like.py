"""``like:NAME`` models: published shapes, a tokenizer of the same vocabulary, caching, seeded loading."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import GSM8K_DIR
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from grpolab.models.like import LIKE_CONFIGS, MARKER, is_like_dir, like_config, like_model_dir
from grpolab.models.loading import load_policy
from grpolab.models.routing import routers
from grpolab.models.sources import FolderRequest, resolve_model_dir
from grpolab.tasks import ArithmeticTask, GSM8KTask

ONE_LAYER = {"num_hidden_layers": 1}
# vocab, hidden, heads, kv heads, intermediate, tied, eos, pad: the published config.json values
PUBLISHED = {
    "qwen3-0.6b": (151936, 1024, 16, 8, 3072, True, 151645, None),
    "qwen3-1.7b": (151936, 2048, 16, 8, 6144, True, 151645, None),
    "olmo2-1b": (100352, 2048, 16, 16, 8192, False, 100257, 100277),
    "llama3.2-1b": (128256, 2048, 32, 8, 8192, True, 128001, None),
    "qwen3-30b-a3b": (151936, 2048, 32, 4, 6144, False, 151645, None),
    "olmoe-1b-7b": (50304, 2048, 16, 16, 1024, False, 50279, 1),
}
# total and active parameters (billions, as the model cards give them) of the MoE shapes
MOE_PARAMETERS = {"qwen3-30b-a3b": (30.5, 3.3), "olmoe-1b-7b": (6.9, 1.3)}


@pytest.fixture(scope="module")
def task() -> ArithmeticTask:
    return ArithmeticTask(n_train=50, n_val=10)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("like_cache")


@pytest.fixture(scope="module")
def like_dirs(task, cache) -> dict[str, Path]:
    """One one-layer folder per reference model, built once for the module."""
    return {name: like_model_dir(name, task, ONE_LAYER, cache_dir=cache) for name in LIKE_CONFIGS}


def test_the_reference_models_are_known() -> None:
    assert set(LIKE_CONFIGS) == set(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_config_and_tokenizer_match_the_published_shapes(like_dirs, name) -> None:
    path = like_dirs[name]
    config, tokenizer = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    vocab, hidden, heads, kv_heads, intermediate, tied, eos, pad = PUBLISHED[name]
    shape = (
        config.vocab_size,
        config.hidden_size,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
        config.tie_word_embeddings,
    )
    assert shape == (vocab, hidden, heads, kv_heads, intermediate, tied)
    assert config.num_hidden_layers == 1 and config.model_type == LIKE_CONFIGS[name]["model_type"]
    assert len(tokenizer) == vocab
    assert config.eos_token_id == tokenizer.eos_token_id == eos
    assert config.pad_token_id == pad
    if pad is None:  # no published pad id: a pad token of its own, distinct from EOS
        assert tokenizer.pad_token_id is not None and tokenizer.pad_token_id not in (eos, config.bos_token_id)
    else:
        assert tokenizer.pad_token_id == pad
    assert tokenizer.pad_token_id < vocab
    assert is_like_dir(path) and not list(path.glob("*.safetensors")) and not list(path.glob("*.bin"))
    assert json.loads((path / MARKER).read_text())["note"] == "random weights"


@pytest.mark.parametrize("name", sorted(MOE_PARAMETERS))
def test_the_moe_shapes_have_their_published_total_and_active_parameters(name) -> None:
    config = like_config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * config.num_experts_per_tok // config.num_experts
    # the cards round: Qwen3-30B-A3B's 3.35B active is "3.3B", OLMoE's 1.28B "1.3B"
    assert (total / 1e9, active / 1e9) == pytest.approx(MOE_PARAMETERS[name], abs=0.06)
    assert len(routers(model)) == config.num_hidden_layers


def test_llama_keeps_its_llama3_rope_scaling(like_dirs) -> None:
    rope = AutoConfig.from_pretrained(like_dirs["llama3.2-1b"]).rope_parameters
    assert rope == {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert AutoConfig.from_pretrained(like_dirs["qwen3-0.6b"]).rope_parameters["rope_theta"] == 1000000


def test_overrides_change_only_depth_and_context(task, cache, like_dirs) -> None:
    config = AutoConfig.from_pretrained(like_dirs["qwen3-0.6b"])
    assert config.num_hidden_layers == 1 and config.max_position_embeddings == 40960
    with pytest.raises(ValueError, match="num_hidden_layers, max_position_embeddings"):
        like_model_dir("qwen3-0.6b", task, {"hidden_size": 64}, cache_dir=cache)
    with pytest.raises(ValueError, match="only set"):
        like_model_dir("qwen3-0.6b", task, {"vocab_size": 1000, "num_hidden_layers": 1}, cache_dir=cache)
    with pytest.raises(ValueError, match="positive integer"):
        like_model_dir("qwen3-0.6b", task, {"num_hidden_layers": 0}, cache_dir=cache)


def test_unknown_name_is_refused_with_the_known_names(task, cache) -> None:
    with pytest.raises(ValueError, match="llama3.2-1b, olmo2-1b, olmoe-1b-7b, qwen3-0.6b, qwen3-1.7b, qwen3-30b-a3b"):
        like_model_dir("gpt2", task, None, cache_dir=cache)


def test_the_cache_is_reused(task, cache, like_dirs) -> None:
    path = like_dirs["olmo2-1b"]
    mtimes = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert like_model_dir("olmo2-1b", task, ONE_LAYER, cache_dir=cache) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == mtimes
    other_task = ArithmeticTask(n_train=40, n_val=10)  # different text: a different folder
    assert like_model_dir("olmo2-1b", other_task, ONE_LAYER, cache_dir=cache) != path


def test_resolve_model_dir_routes_like_paths_and_refuses_stray_overrides(task, cache, monkeypatch) -> None:
    monkeypatch.setenv("GRPOLAB_CACHE", str(cache.parent / "grpolab_cache"))
    path = resolve_model_dir("like:llama3.2-1b", FolderRequest(task, ONE_LAYER))
    assert path.parent == cache.parent / "grpolab_cache" / "like" and is_like_dir(path)
    with pytest.raises(ValueError, match="model.like_overrides applies only to like: models"):
        resolve_model_dir(str(path), FolderRequest(task, ONE_LAYER))
    with pytest.raises(ValueError, match="only to like: models"):
        resolve_model_dir(None, FolderRequest(task, ONE_LAYER))


def test_load_policy_is_seeded_and_leaves_the_global_rng_alone(like_dirs) -> None:
    torch.manual_seed(123)
    state = torch.get_rng_state()
    first, tokenizer = load_policy(like_dirs["qwen3-0.6b"], torch.float32)
    assert torch.equal(torch.get_rng_state(), state)
    second, _ = load_policy(like_dirs["qwen3-0.6b"], torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    assert first.get_input_embeddings().weight.shape == (151936, 1024)
    assert first.get_input_embeddings().weight.std() > 0


def test_a_gsm8k_like_model_runs_a_realistic_prompt(cache) -> None:
    gsm8k = GSM8KTask(train_path=GSM8K_DIR / "train.jsonl", test_path=GSM8K_DIR / "test.jsonl", n_train=1000, n_val=100)
    model, tokenizer = load_policy(like_model_dir("qwen3-0.6b", gsm8k, ONE_LAYER, cache_dir=cache))
    prompt = gsm8k.prompt(gsm8k.validation_examples()[0])
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    assert len(prompt) / 6 < ids.shape[1] < len(prompt) / 3  # English BPE: ~4 characters per token
    assert tokenizer.decode(ids[0]) == prompt
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], 151936) and torch.isfinite(logits).all()
