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

Training in bf16 on a CPU attends through it too (``grpolab.learning.learner.BatchForward.attention``): torch's CPU
flash-attention backward is slower in bf16 than in float32 (SmolLM2-135M's training shapes, q [16, 9, 64, 64]
over 113 keys with a mask, one thread: 35 ms forward + backward in bf16 against 20 in float32, 2026-12-07, Intel
Xeon with AMX). With gradients on and bf16 inputs, ``Float32Backward`` keeps the bf16 forward (the same output,
bit for bit) and computes the backward in float32 from the same bf16 inputs: 21.7 against 40.5 ms with the
key/value copies of ``repeat_kv``, and a gradient closer to float64's (largest relative error 2-3e-3 against
4-5e-3 for the bf16 kernel's).
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
    [B, 1, Q, K] (bool, True = attend) -> (output [B, Q, H, D], None). With a mask on a CPU: with gradients in
    bf16 (autocast's or the inputs'), ``Float32Backward`` (grouped heads or not); else on grouped heads one
    ``F.scaled_dot_product_attention(..., enable_gqa=True)``; otherwise ``sdpa_attention_forward``."""
    grouped = getattr(module, "num_key_value_groups", 1) > 1
    dtype = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else query.dtype
    float32_backward = torch.is_grad_enabled() and dtype == torch.bfloat16 and dropout == 0.0
    if (
        attention_mask is None
        or not (grouped or float32_backward)
        or query.device.type != "cpu"
        or key.shape[-1] != value.shape[-1]
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if float32_backward:
        query, key, value = (t.to(dtype) for t in (query, key, value))  # the casts autocast would make
        with torch.autocast("cpu", enabled=False):
            out = Float32Backward.apply(query, key, value, attention_mask, scaling)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
        )
    return out.transpose(1, 2).contiguous(), None


class Float32Backward(torch.autograd.Function):
    """Grouped-head SDPA whose forward runs in the inputs' dtype and whose backward runs in float32 on the same
    values (module docstring). query [B, H, Q, D], key/value [B, H_kv, K, D], mask [B, 1, Q, K] bool (True =
    attend), scale (None: 1 / sqrt(D)) -> [B, H, Q, D] in the inputs' dtype; gradients in the inputs' dtypes."""

    @staticmethod
    def forward(ctx, query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scale: float | None) -> Tensor:
        ctx.save_for_backward(query, key, value, mask)
        ctx.scale = scale
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, scale=scale, enable_gqa=True
        )

    @staticmethod
    def backward(ctx, grad: Tensor):
        query, key, value, mask = ctx.saved_tensors
        with torch.enable_grad():
            wide = [t.detach().float().requires_grad_() for t in (query, key, value)]
            out = torch.nn.functional.scaled_dot_product_attention(
                *wide, attn_mask=mask, scale=ctx.scale, enable_gqa=True
            )
            grads = torch.autograd.grad(out, wide, grad.float())
        return *(g.to(t.dtype) for g, t in zip(grads, (query, key, value))), None, None


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
