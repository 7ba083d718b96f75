"""The hf engine's prefill: each distinct prompt once for its samples, and the prefix every prompt shares once.

A rollout batch repeats each prompt for its ``n`` samples, and its prompts usually open with the same
tokens (the system prompt, the chat template's header, an instruction). ``shared_prefill`` computes the
KV cache of every row's prompt but its last token with neither repeated: the backbone runs over the
shared prefix once (one row), its cache rows are repeated for each distinct prompt, the backbone runs
over the distinct prompts' remainders on that cache, and those cache rows are repeated for each sample
(transformers' ``DynamicCache.batch_select_indices``). ``decode`` then continues from the last column.

Layout (``prompt_layout``): a row is ``[shared prefix | left padding | rest of its prompt]``, 0 in the
attention mask on the padding. Position ids count the real tokens before each column
(``left_padded_positions``), so every token has the position, and attends to the tokens, that it has in
the trainer's unpadded forward: the log-probs agree with the trainer's to float32 rounding.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from grpolab.rollout.hf.decode import left_padded_positions, sequence_places
from grpolab.rollout.hf.kv_cache import reserved_cache

__all__ = ["MIN_SAVED_TOKENS", "prompt_layout", "shared_prefill"]

MIN_SAVED_TOKENS = 16
"""A common prefix is prefilled apart only when that saves at least this many token positions (the
distinct prompts but one, times its length): below it the extra forward costs more than it saves."""


def prompt_layout(prompts: list[list[int]], pad_id: int, prefix: int = 0) -> tuple[Tensor, Tensor]:
    """[B, W] input ids and attention mask: each row's first ``prefix`` tokens (the same in every row) at
    the left, then padding, then the rest of its prompt at the right. ``prefix = 0``: plain left padding.
    W = prefix + the longest rest."""
    width = prefix + max(len(p) - prefix for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        rest = len(p) - prefix
        input_ids[row, :prefix], input_ids[row, width - rest :] = torch.tensor(p[:prefix]), torch.tensor(p[prefix:])
        attention_mask[row, :prefix] = attention_mask[row, width - rest :] = 1
    return input_ids, attention_mask


def shared_prefill(
    backbone: nn.Module,
    config,
    prompts: list[list[int]],
    pad_id: int,
    device: torch.device,
    max_new_tokens: int,
    on_forward: Callable[[list[list[int]], Tensor], None] | None = None,
    *,
    share: bool = True,
    always: bool = False,
) -> tuple[Tensor, Tensor, DynamicCache | None]:
    """Input ids and attention mask [B, W] of ``prompts`` (``prompt_layout``, on ``device``) and the cache of
    all their columns but the last, each distinct prompt and the prefix they all share computed once; the
    cache is None when no prompt repeats and no prefix is worth sharing (``decode`` prefills every row).

    backbone: the decoder without its output layer (``grpolab.models.logprobs.backbone_and_head``); config: the
    model's config (the cache's layer types); max_new_tokens: the cache keeps room for them
    (``grpolab.rollout.hf.kv_cache``). ``on_forward``: told before each forward the batch rows each of its rows
    stands for and each token's place in their sequences [A, C] (-1 on padding), e.g. to record an MoE's routing.
    share: False prefills every row on its own (no prompt or prefix computed once). always: the cache even where
    nothing is shared (rows joining a running batch, ``grpolab.rollout.hf.decode``'s refill); None only where every
    prompt is one token."""
    distinct: dict[tuple[int, ...], int] = {}
    row_of = [distinct.setdefault(tuple(p), len(distinct)) if share else row for row, p in enumerate(prompts)]
    distinct_prompts = list(distinct) if share else [tuple(p) for p in prompts]
    prefix = min(len(os.path.commonprefix(distinct_prompts)), min(map(len, prompts)) - 1)
    if not share or (len(distinct_prompts) - 1) * prefix < MIN_SAVED_TOKENS:
        prefix = 0
    input_ids, attention_mask = (t.to(device) for t in prompt_layout(prompts, pad_id, prefix))
    if (len(distinct_prompts) == len(prompts) and not prefix and not always) or input_ids.shape[1] < 2:
        return input_ids, attention_mask, None
    cache = reserved_cache(config, input_ids.shape[1] + max_new_tokens)
    announce = on_forward or (lambda members, places: None)
    if prefix:
        announce([list(range(len(prompts)))], torch.arange(prefix, device=device)[None])
        backbone(
            input_ids=input_ids[:1, :prefix],
            attention_mask=attention_mask[:1, :prefix],
            position_ids=torch.arange(prefix, device=device)[None],
            past_key_values=cache,
            use_cache=True,
        )
        cache.batch_select_indices(torch.zeros(len(distinct_prompts), dtype=torch.long, device=device))
    firsts = [row_of.index(u) for u in range(len(distinct_prompts))]
    ids, mask = input_ids[firsts, :-1], attention_mask[firsts, :-1]
    if ids.shape[1] > prefix:
        positions = left_padded_positions(mask)[:, prefix:]
        announce(
            [[r for r, u in enumerate(row_of) if u == unit] for unit in range(len(distinct_prompts))],
            sequence_places(mask[:, prefix:], positions),
        )
        backbone(
            input_ids=ids[:, prefix:],
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
        )
    cache.batch_select_indices(torch.tensor(row_of, device=device))
    return input_ids, attention_mask, cache
