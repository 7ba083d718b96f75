"""``like:NAME`` models: the real shapes of the reference models, with random weights, no download.

``model.path = "like:qwen3-0.6b"`` lets ``grpolab probe`` / ``grpolab bench`` measure memory and
speed at a reference model's true width, depth and vocabulary before anything is downloaded.
``like_model_dir`` writes a folder holding that model's published ``config.json`` (optionally with
fewer layers or a shorter context) and a tokenizer of exactly the same vocabulary size, but no
weights: ``grpolab.models.loading.load_policy`` builds the model with ``from_config`` under a fixed seed.

The tokenizer is a byte-level BPE trained in seconds on the task's own text (so prompt lengths
are realistic for that text), padded with filler entries up to the model's vocabulary size; its EOS
and pad tokens sit at the config's EOS and pad ids, so config and tokenizer agree.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerFast

from grpolab.models.cached_folder import cached_folder
from grpolab.models.tinymodel import default_cache_root
from grpolab.tasks.base import Task

LIKE_PREFIX = "like:"
MARKER = "grpolab_like.json"
LIKE_VERSION = 1  # bump when the recipe changes, to invalidate old caches
BPE_VOCAB = 4096  # 256 bytes + ~3,800 merges: trains in seconds
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
OVERRIDABLE = ("num_hidden_layers", "max_position_embeddings")  # keep width and vocabulary real

_QWEN3 = {  # shared by Qwen3-0.6B and Qwen3-1.7B
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000,
    "rope_scaling": None,
    "rms_norm_eps": 1e-06,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "hidden_act": "silu",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "max_window_layers": 28,
    "sliding_window": None,
    "use_sliding_window": False,
    "use_cache": True,
}

# The published config.json fields (minus torch_dtype / transformers_version), checked against
# copies quoted in public code: Qwen3-0.6B against several verbatim copies of its config.json (e.g. a
# Rust test constant "QWEN3_06B_CONFIG" and comments citing huggingface.co/Qwen/Qwen3-0.6B/raw/main/
# config.json); Qwen3-1.7B against a re-saved copy of its config.json (2048 / 6144 / 28 layers, 16/8
# heads, head_dim 128, same ids and rope) and a Qwen3-1.7B checkpoint-inspection test; OLMo-2-0425-1B
# against Megatron-Bridge's test fixture "Mirror of allenai/OLMo-2-0425-1B/config.json" plus
# fairseq2's OLMO2Config for it (eos 100257, pad 100277, no bos); Llama-3.2-1B against
# thunder_model_blocks' LLAMA_3_2_1B_CFG (with _commit_hash) and other copies of its config.json.
LIKE_CONFIGS: dict[str, dict] = {
    "qwen3-0.6b": {**_QWEN3, "hidden_size": 1024, "intermediate_size": 3072},
    "qwen3-1.7b": {**_QWEN3, "hidden_size": 2048, "intermediate_size": 6144},
    "olmo2-1b": {
        "architectures": ["Olmo2ForCausalLM"],
        "model_type": "olmo2",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "vocab_size": 100352,
        "max_position_embeddings": 4096,
        "rope_theta": 500000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": 100257,
        "pad_token_id": 100277,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    },
    # Mixture-of-Experts (``like:`` shapes for probe and bench; override num_hidden_layers to fit): Qwen3-30B-A3B
    # against its config.json quoted in public tests (48 layers, 128 experts of 768, top 8, 32/4 heads) and
    # its card's 30.5B total / 3.3B active parameters; OLMoE-1B-7B-0924 against copies of its config.json
    # (64 experts of 1024, top 8, no top-k renormalisation, eos 50279, pad 1) and its 6.9B / 1.3B.
    "qwen3-30b-a3b": {
        **_QWEN3,
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "max_window_layers": 48,
        "tie_word_embeddings": False,
    },
    "olmoe-1b-7b": {
        "architectures": ["OlmoeForCausalLM"],
        "model_type": "olmoe",
        "hidden_size": 2048,
        "intermediate_size": 1024,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_experts": 64,
        "num_experts_per_tok": 8,
        "norm_topk_prob": False,
        "vocab_size": 50304,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": False,
        "clip_qkv": None,
        "bos_token_id": None,
        "eos_token_id": 50279,
        "pad_token_id": 1,
        "hidden_act": "silu",
        "router_aux_loss_coef": 0.01,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    },
    "llama3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "rms_norm_eps": 1e-05,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
    },
}


def like_fields(name: str, overrides: dict[str, int] | None = None) -> dict:
    """The published fields of ``name`` with the allowed size ``overrides`` applied."""
    if name not in LIKE_CONFIGS:
        raise ValueError(f"unknown like: model {name!r}; known: {', '.join(sorted(LIKE_CONFIGS))}")
    overrides = dict(overrides or {})
    bad = sorted(set(overrides) - set(OVERRIDABLE))
    if bad:
        raise ValueError(f"like: overrides may only set {', '.join(OVERRIDABLE)} (got {', '.join(bad)})")
    for key, value in overrides.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"like: override {key} must be a positive integer, got {value!r}")
    return {**LIKE_CONFIGS[name], **overrides}


def like_config(name: str, overrides: dict[str, int] | None = None) -> PretrainedConfig:
    """The transformers config of ``name``; transformers 5 takes RoPE settings as ``rope_parameters``."""
    fields = like_fields(name, overrides)
    rope = {"rope_type": "default", **(fields.pop("rope_scaling") or {}), "rope_theta": fields.pop("rope_theta")}
    return AutoConfig.for_model(fields.pop("model_type"), rope_parameters=rope, **fields)


def _special_id(token_id: int | list[int] | None, vocab_size: int) -> int | None:
    """A config's (first) token id, or None when it is unset or outside the vocabulary."""
    token_id = token_id[0] if isinstance(token_id, list) else token_id
    return token_id if token_id is not None and 0 <= token_id < vocab_size else None


def build_like_tokenizer(texts: list[str], config: PretrainedConfig) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``texts``, padded with fillers to ``config.vocab_size`` entries.

    EOS and pad take the config's ids (pad falls back to the last id when the config has none or
    it equals EOS). Fillers ``<|filler_N|>`` live in the BPE model's vocabulary, not as added tokens
    (150k added tokens would make loading slow), and no merge ever produces them.
    """
    bpe = Tokenizer(models.BPE())
    pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.pre_tokenizer = pre_tokenizer
    bpe.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=BPE_VOCAB,
            min_frequency=2,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    learned = json.loads(bpe.to_str())["model"]
    size = config.vocab_size
    eos_id = _special_id(config.eos_token_id, size)
    eos_id = size - 1 if eos_id is None else eos_id
    pad_id = _special_id(config.pad_token_id, size)
    pad_id = (size - 1 if eos_id != size - 1 else size - 2) if pad_id in (None, eos_id) else pad_id
    free = (i for i in range(size) if i not in (eos_id, pad_id))
    vocab = {token: next(free) for token, _ in sorted(learned["vocab"].items(), key=lambda kv: kv[1])}
    vocab |= {EOS_TOKEN: eos_id, PAD_TOKEN: pad_id} | {f"<|filler_{i}|>": i for i in free}
    if len(vocab) != size:
        raise ValueError(f"cannot fit a {len(learned['vocab'])}-token BPE into a vocabulary of {size}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m) for m in learned["merges"]]))
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (EOS_TOKEN, PAD_TOKEN)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=config.max_position_embeddings,
    )


def task_texts(task: Task) -> list[str]:
    """The tokenizer's training text: every train and validation prompt, solution and gold answer."""
    return [
        task.prompt(e) + (e.solution or "") + " " + e.answer for e in task.train_examples() + task.validation_examples()
    ]


def like_model_dir(
    spec: str, task: Task, overrides: dict[str, int] | None = None, cache_dir: Path | None = None
) -> Path:
    """The folder of ``like:<spec>`` for ``task``: config.json, tokenizer files and a marker, no weights.

    Built once and cached under ``<cache_dir or $GRPOLAB_CACHE or ~/.cache/grpolab>/like`` by name,
    overrides, the recipe and a hash of the task text; written to a temporary folder and renamed
    into place, so a half-written folder is never returned.
    """
    config = like_config(spec, overrides)  # validates name and overrides first
    texts = task_texts(task)
    key = hashlib.sha256(json.dumps([LIKE_VERSION, BPE_VOCAB, like_fields(spec, overrides)], sort_keys=True).encode())
    for text in texts:
        key.update(f"{len(text)}:{text}".encode())
    root = Path(cache_dir) if cache_dir is not None else default_cache_root().parent / "like"
    target = root / f"{spec}-{key.hexdigest()[:12]}"

    def write(folder: Path) -> None:
        tokenizer = build_like_tokenizer(texts, config)
        config.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        probe = texts[0]
        if AutoTokenizer.from_pretrained(folder)(probe)["input_ids"] != tokenizer(probe)["input_ids"]:
            raise ValueError(f"AutoTokenizer reloads a different tokenizer for model type {config.model_type!r}")
        marker = {"like": spec, "overrides": dict(overrides or {}), "task": task.name, "note": "random weights"}
        (folder / MARKER).write_text(json.dumps(marker, indent=1))

    return cached_folder(target, MARKER, write)


def is_like_dir(path: str | Path) -> bool:
    """Whether ``path`` is a ``like:`` model folder (config and tokenizer only, random weights)."""
    return (Path(path) / MARKER).is_file()
