"""Completions -> right-padded training tensors.

Row ``i`` is ``prompt_ids + completion_ids`` starting at column 0, padded on the right. The
log-prob convention matches ``grpolab.models.logprobs.token_logprobs``: column ``t`` holds
``log p(token t | tokens before t)``, so ``engine_logprobs`` and ``token_logprobs(...).logprobs``
line up element-wise and ``response_mask`` selects the policy's own tokens in both: 1 on the tokens
it sampled, 0 on the prompt, padding and tool observations (``Completion.policy_mask``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from grpolab.rollout.base import Completion

__all__ = ["TrainBatch", "collate"]


@dataclass
class TrainBatch:
    """Tensors for the trainer (N rows, L columns, right padding).

    input_ids: LongTensor[N, L] prompt + completion, ``pad_id`` after.
    attention_mask: LongTensor[N, L] 1 on prompt and completion tokens.
    response_mask: FloatTensor[N, L] 1 exactly on the completion tokens the policy sampled (EOS
        included), 0 on tool observations.
    engine_logprobs: FloatTensor[N, L] the engine's log-prob of each completion token at its
        column, 0 elsewhere.
    prompt_lens: LongTensor[N] prompt length per row.
    completion_lens: LongTensor[N] completion length per row (observations included).

    Every tensor field is either per-token ``[N, L]`` (2-D) or per-row ``[N]`` (1-D); ``select``
    and ``to`` rely on that (subclasses may add fields following the same rule).
    """

    input_ids: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    engine_logprobs: Tensor
    prompt_lens: Tensor
    completion_lens: Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_response_tokens(self) -> int:
        """Tokens the policy sampled (the loss's tokens)."""
        return int(self.response_mask.sum())

    def token_counts(self) -> dict[str, int]:
        """Every token position of the batch, by why it is or is not in the loss:
        ``tokens/policy`` (trained on), ``tokens/masked_observation`` (tool output),
        ``tokens/masked_prompt`` and ``tokens/masked_padding``."""
        policy, prompt = self.num_response_tokens, int(self.prompt_lens.sum())
        real = int(self.attention_mask.sum())
        return {
            "tokens/policy": policy,
            "tokens/masked_observation": real - prompt - policy,
            "tokens/masked_prompt": prompt,
            "tokens/masked_padding": self.attention_mask.numel() - real,
        }

    def _map(self, fn) -> TrainBatch:
        changes = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                changes[f.name] = fn(value)
        return dataclasses.replace(self, **changes)

    def select(self, indices: Sequence[int] | Tensor) -> TrainBatch:
        """Sub-batch of the given rows (in that order), trimmed to its longest row."""
        idx = torch.as_tensor(indices, dtype=torch.long, device=self.input_ids.device)
        if idx.numel() == 0:
            raise ValueError("select() needs at least one index")
        width = int(self.attention_mask.index_select(0, idx).sum(1).max())

        def pick(t: Tensor) -> Tensor:
            t = t.index_select(0, idx.to(t.device))
            return t[:, :width] if t.dim() >= 2 else t

        return self._map(pick)

    def to(self, device: torch.device | str) -> TrainBatch:
        return self._map(lambda t: t.to(device))


def collate(completions: Sequence[Completion], pad_id: int) -> TrainBatch:
    """Stack completions into a right-padded ``TrainBatch`` (row order kept)."""
    if len(completions) == 0:
        raise ValueError("collate() needs at least one completion")
    n = len(completions)
    prompt_lens = [len(c.prompt_ids) for c in completions]
    comp_lens = [len(c.completion_ids) for c in completions]
    width = max(p + c for p, c in zip(prompt_lens, comp_lens))

    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((n, width), dtype=torch.long)
    response_mask = torch.zeros((n, width), dtype=torch.float32)
    engine_logprobs = torch.zeros((n, width), dtype=torch.float32)
    for row, c in enumerate(completions):
        p, k = prompt_lens[row], comp_lens[row]
        if len(c.logprobs) != k:
            raise ValueError(f"row {row}: {len(c.logprobs)} logprobs for {k} completion tokens")
        input_ids[row, :p] = torch.tensor(c.prompt_ids, dtype=torch.long)
        if k:
            input_ids[row, p : p + k] = torch.tensor(c.completion_ids, dtype=torch.long)
            mask = torch.tensor(c.mask, dtype=torch.float32)
            response_mask[row, p : p + k] = mask
            engine_logprobs[row, p : p + k] = torch.tensor(c.logprobs, dtype=torch.float32) * mask
        attention_mask[row, : p + k] = 1
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        engine_logprobs=engine_logprobs,
        prompt_lens=torch.tensor(prompt_lens, dtype=torch.long),
        completion_lens=torch.tensor(comp_lens, dtype=torch.long),
    )
