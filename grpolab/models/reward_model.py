"""A learned reward model: a local ``AutoModelForSequenceClassification`` with one output, frozen, on
the trainer's device, scoring ``prompt + completion`` texts in batches.

Rendering: with a chat template of its own the reward model sees the prompt's chat messages and the
completion as the assistant's reply, rendered by *its* template (the policy's may differ), tokenized
without adding special tokens (the template has them); without one, the policy's prompt text and the
completion concatenated, tokenized as ``tokenizer(text)`` would. The score of a text is the model's
own ``logits[:, 0]`` at the rightmost token that is not the pad token (transformers' pooling);
batches are padded on the tokenizer's side with position ids that count real tokens only, so a
text's score does not depend on what it is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from grpolab.models.loading import resolve_dtype
from grpolab.tasks.reward_model_spec import RewardModelSpec, check_reward_model_dir


def padded_batch(
    rows: Sequence[Sequence[int]], pad_id: int, side: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token rows -> (input_ids [N, T], attention_mask [N, T], position_ids [N, T]), padded on ``side``
    ("left" or "right") to the longest row T; positions count the real tokens of each row from 0."""
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(width - len(row), width) if side == "left" else slice(0, len(row))
        ids[i, span] = torch.tensor(list(row), dtype=torch.long)
        mask[i, span] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


class RewardModel:
    """A loaded reward model; ``score(texts)`` gives one float32 score per text. Build with ``load``."""

    def __init__(
        self, spec: RewardModelSpec, model: torch.nn.Module, tokenizer: Any, device: torch.device, max_length: int
    ):
        self.spec, self.model, self.tokenizer, self.device, self.max_length = spec, model, tokenizer, device, max_length
        self.has_template = bool(getattr(tokenizer, "chat_template", None))

    @classmethod
    def load(cls, spec: RewardModelSpec, device: torch.device) -> RewardModel:
        """The model in ``spec.options.dtype`` on ``device``, frozen; one ``ValueError`` line when its tokenizer
        cannot pad."""
        config = check_reward_model_dir(spec.path)
        options = spec.options
        tokenizer = AutoTokenizer.from_pretrained(spec.path)
        if options.pad_token is not None:
            if options.pad_token not in tokenizer.get_vocab():
                raise ValueError(
                    f"reward model {spec.path!r}: pad_token {options.pad_token!r} is not one of its tokenizer's tokens"
                )
            tokenizer.pad_token = options.pad_token
        if tokenizer.pad_token_id is None:
            raise ValueError(
                f"reward model {spec.path!r}: its tokenizer has no pad token; set options.pad_token "
                f"(e.g. its EOS token {tokenizer.eos_token!r})"
            )
        dtype = resolve_dtype(options.dtype, device)
        model = AutoModelForSequenceClassification.from_pretrained(Path(spec.path), dtype=dtype).to(device).eval()
        model.requires_grad_(False)
        model.config.pad_token_id = tokenizer.pad_token_id  # transformers pools the rightmost non-pad token
        context = config.get("max_position_embeddings") or getattr(model.config, "max_position_embeddings", None)
        max_length = options.max_length or context
        if max_length is None:
            raise ValueError(f"reward model {spec.path!r}: its config names no context length; set options.max_length")
        return cls(spec, model, tokenizer, device, max_length)

    def render(self, messages: list[dict[str, str]], prompt: str, completion: str) -> str:
        """The text scored for one completion: ``messages`` + the completion through the reward model's chat
        template when it has one, else ``prompt + completion``."""
        if not self.has_template:
            return prompt + completion
        return self.tokenizer.apply_chat_template(
            messages + [{"role": "assistant", "content": completion}], tokenize=False
        )

    def encode(self, text: str) -> list[int]:
        """All tokens of one rendered text."""
        return self.tokenizer(text, add_special_tokens=not self.has_template)["input_ids"]

    def token_ids(self, text: str) -> list[int]:
        """The tokens of one rendered text, ``max_length`` enforced (an error unless truncate = "left")."""
        ids = self.encode(text)
        if len(ids) > self.max_length:
            if self.spec.options.truncate != "left":
                raise ValueError(
                    f"reward model {self.spec.name!r}: a text of {len(ids)} tokens is longer than "
                    f'max_length {self.max_length}; set options.truncate = "left" to keep its end'
                )
            ids = ids[-self.max_length :]
        return ids

    @torch.no_grad()
    def score(self, texts: Sequence[str]) -> list[float]:
        """One score per text, in order; ``batch_size`` texts per forward, similar lengths together."""
        rows = [self.token_ids(t) for t in texts]
        order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
        scores = [0.0] * len(rows)
        size = self.spec.options.batch_size
        for start in range(0, len(order), size):
            chosen = order[start : start + size]
            ids, mask, positions = padded_batch(
                [rows[i] for i in chosen], self.tokenizer.pad_token_id, self.tokenizer.padding_side
            )
            logits = self.model(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                position_ids=positions.to(self.device),
            ).logits
            for i, value in zip(chosen, logits[:, 0].float().tolist()):
                scores[i] = value
        return scores

    def memory_bytes(self) -> int:
        """Bytes its weights and buffers take on the device."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)
