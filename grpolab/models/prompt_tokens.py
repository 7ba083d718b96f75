"""Prompt strings -> token ids, with the tokenizer's BOS exactly once.

A tokenizer that adds special tokens in front of a text (Llama-3 base, Mistral and Gemma add BOS)
expects the model to see them: a prompt without its BOS is out of distribution. A chat template
often writes that BOS into the prompt text itself, so tokenising the rendered chat with special tokens
on would give it twice. Here the prompt is tokenised without special tokens and the tokenizer's own
leading special tokens are put in front unless the text already begins with them. Special tokens a
tokenizer appends (some add EOS) never go on a prompt: the model would read the prompt as finished.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["leading_special_ids", "tokenize_prompts"]


def leading_special_ids(tokenizer) -> list[int]:
    """The ids ``tokenizer`` puts in front of any text when adding special tokens (e.g. ``[bos]``), or []."""
    probe = "a"
    plain = tokenizer(probe, add_special_tokens=False)["input_ids"]
    full = tokenizer(probe, add_special_tokens=True)["input_ids"]
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return list(full[:start])
    return []


def tokenize_prompts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each prompt in ``texts``: its tokens, after the tokenizer's leading special tokens
    unless the text already starts with them (a chat template that wrote BOS)."""
    prefix = leading_special_ids(tokenizer)
    ids = tokenizer(list(texts), add_special_tokens=False)["input_ids"] if texts else []
    return [list(p) if not prefix or list(p[: len(prefix)]) == prefix else prefix + list(p) for p in ids]
