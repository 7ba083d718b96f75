"""The sizes of the tests' tiny random models, in one place (``conftest``, the reward models, the chat models
and the architecture tests build theirs from these)."""

from __future__ import annotations

from transformers import LlamaConfig

# hidden 32, intermediate 64, 2 layers of 4 attention heads sharing 2 key/value heads (head_dim 8)
TINY_SIZES = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
)
# head_dim 32, which vLLM's CPU attention takes (the 8 of TINY_SIZES it does not)
VLLM_SIZES = dict(hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32)


def tiny_sizes(**changes) -> dict:
    """TINY_SIZES with ``changes`` on top: the layer sizes of a tiny model with no tokenizer of its own."""
    return {**TINY_SIZES, **changes}


def tiny_fields(vocab_size: int, pad_token_id: int | None, eos_token_id: int | None, **changes) -> dict:
    """The config fields of a tiny random causal LM: TINY_SIZES, the vocabulary and the pad and EOS tokens given
    (no BOS), weights drawn wider than the 0.02 default (initializer_range 0.3, so that distributions are far
    from uniform), untied embeddings; ``changes`` on top."""
    tokens = dict(vocab_size=vocab_size, pad_token_id=pad_token_id, eos_token_id=eos_token_id, bos_token_id=None)
    return {**TINY_SIZES, **tokens, "initializer_range": 0.3, "tie_word_embeddings": False, **changes}


def tiny_llama(tokenizer, max_positions: int, **changes) -> LlamaConfig:
    """A tiny random Llama's config for ``tokenizer`` (its vocabulary, pad and EOS tokens; ``tiny_fields``) with
    ``max_positions`` positions, ``changes`` on top."""
    fields = tiny_fields(len(tokenizer), tokenizer.pad_token_id, tokenizer.eos_token_id, **changes)
    return LlamaConfig(**fields, max_position_embeddings=max_positions)
