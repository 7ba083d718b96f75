"""Tiny random reward models (``LlamaForSequenceClassification``, one label) saved like real ones, with
the character tokenizer of ``conftest`` (whose ``reward_model_dir`` fixture is one)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tiny_configs import tiny_llama
from transformers import LlamaForSequenceClassification

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
    config = tiny_llama(tokenizer, max_positions, num_labels=num_labels)
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
