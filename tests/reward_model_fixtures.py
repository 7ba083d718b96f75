"""Tiny random reward models (``LlamaForSequenceClassification``, one label) saved like real ones, with
the character tokenizer of ``conftest`` (whose ``reward_model_dir`` fixture is one)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def save_reward_model(
    path: Path,
    tokenizer,
    *,
    chat_template: str | None = None,
    num_labels: int = 1,
    pad: bool = True,
    max_positions: int = 256,
    seed: int = 0,
) -> Path:
    """A random reward model and its tokenizer in ``path`` (``pad=False``: a tokenizer without a pad token)."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        initializer_range=0.3,
        num_labels=num_labels,
    )
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    settings_file = path / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    if chat_template is not None:
        settings["chat_template"] = chat_template
    if not pad:
        settings.pop("pad_token", None)
    settings_file.write_text(json.dumps(settings))
    if chat_template is not None:
        (path / "chat_template.jinja").unlink(missing_ok=True)
    return path
