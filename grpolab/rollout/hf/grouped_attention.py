"""SDPA over grouped key/value heads as they are, for generation on a CPU.

transformers' ``sdpa`` attention repeats each key/value head ``num_key_value_groups`` times (a copy of
the layer's whole cache, ``repeat_kv``) whenever it is given a mask, because CUDA's SDPA kernels fall back
to the math kernel for grouped heads with a mask. A decoding batch of prompts of different lengths
always has a mask (its left padding), so on a model with grouped heads (SmolLM2: 9 query heads over 3
key/value heads) every decoding step copied every layer's cache threefold. torch's CPU kernels take
grouped heads with a mask (``enable_gqa=True``) and compute the same products without the copy
(measured here: 0.56 against 4.9 ms a layer at 64 rows x 100 positions; identical outputs).

``grouped_kv_attention(model)`` switches a CPU model from ``sdpa`` to ``SDPA_GROUPED`` (registered with
transformers' attention and mask interfaces) for the length of a generation call, and back. Everything
``SDPA_GROUPED`` does not handle itself (no mask, ungrouped heads, a paged cache, a position bias,
another device) goes to transformers' own ``sdpa_attention_forward``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

__all__ = ["SDPA_GROUPED", "grouped_kv_attention", "sdpa_grouped_attention"]

SDPA_GROUPED = "grpolab_sdpa_grouped"


def sdpa_grouped_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function contract: query [B, H, Q, D], key/value [B, H_kv, K, D], mask
    [B, 1, Q, K] (bool, True = attend) -> (output [B, Q, H, D], None). With a mask on grouped CPU heads,
    one ``F.scaled_dot_product_attention(..., enable_gqa=True)``; otherwise ``sdpa_attention_forward``."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    if (
        attention_mask is None
        or not grouped
        or query.device.type != "cpu"
        or key.shape[-1] != value.shape[-1]
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
    )
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(SDPA_GROUPED, sdpa_grouped_attention)
AttentionMaskInterface.register(SDPA_GROUPED, sdpa_mask)


def _configs(config) -> list:
    """``config`` and its sub-configs (a multimodal model's text config, ...), recursively."""
    subs = [getattr(config, key, None) for key in getattr(config, "sub_configs", {})]
    return [config] + [c for sub in subs if sub is not None for c in _configs(sub)]


@contextlib.contextmanager
def grouped_kv_attention(model: nn.Module) -> Iterator[bool]:
    """Within it, a CPU ``model`` whose attention is ``sdpa`` (and its sub-configs') attends through
    ``SDPA_GROUPED``; yields whether it switched (False, nothing changed, elsewhere)."""
    configs = _configs(model.config)
    parameter = next(model.parameters(), None)
    if (
        parameter is None
        or parameter.device.type != "cpu"
        or any(getattr(c, "_attn_implementation", None) != "sdpa" for c in configs)
    ):
        yield False
        return
    model.config._attn_implementation = SDPA_GROUPED  # transformers sets it on the sub-configs too
    try:
        yield True
    finally:
        model.config._attn_implementation = "sdpa"
