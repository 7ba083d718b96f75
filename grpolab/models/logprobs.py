"""Memory-lean per-token log-probabilities and entropies of a causal LM.

Convention used everywhere in grpolab: position ``t`` holds
``log p(input_ids[:, t] | input_ids[:, :t])``; column 0 has no context and is 0.

The decoder backbone is run once to get the final hidden states ``[N, L, H]``; the output
layer is then applied to chunks of ``chunk_size`` positions, each chunk wrapped in
``torch.utils.checkpoint`` so that neither the forward nor the backward pass ever holds the
full ``[N, L, vocab]`` logits (only ``[N, chunk_size, vocab]`` at a time).

The logits are produced by the output layer in the model's dtype, with the transforms the model's
own forward applies to them (``grpolab.models.fidelity.output_logits``: exactly what ``model.generate``
samples from), and everything after that (temperature, log-softmax, entropy) is computed in float32.

Inputs must be right-padded (or unpadded): the backbone uses default position ids
``0..L-1``, which are only correct when every row starts at column 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from grpolab.models.fidelity import output_logits

__all__ = ["TokenStats", "token_logprobs", "head_chunk", "enable_gradient_checkpointing", "backbone_and_head"]


@dataclass
class TokenStats:
    """Per-token statistics aligned with ``input_ids``.

    logprobs: FloatTensor[N, L], float32; ``logprobs[:, t] = log p(x_t | x_<t)``; 0 at column 0
        and wherever ``attention_mask`` is 0.
    entropy: FloatTensor[N, L] | None, float32; entropy (nats) of the distribution that
        predicted ``x_t``; same zeros as ``logprobs``. None unless requested.
    """

    logprobs: Tensor
    entropy: Tensor | None = None


def backbone_and_head(model: nn.Module) -> tuple[nn.Module, Callable[[Tensor], Tensor]]:
    """Return ``(decoder_backbone, output_layer)`` of a transformers causal LM.

    The backbone maps ``input_ids`` to final (already normed) hidden states [N, L, H]; the output
    layer maps hidden states [..., H] to the logits [..., V] of the model's own forward
    (``grpolab.models.fidelity.output_logits``).
    """
    backbone = None
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        backbone = get_decoder()
    if backbone is None or backbone is model:
        backbone = getattr(model, "base_model", None)
    if backbone is None or backbone is model:
        raise ValueError(f"cannot find the decoder backbone of {type(model).__name__}")
    return backbone, output_logits(model)


def _chunk_stats(
    head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    """hidden: [N, C, H]; targets: LongTensor[N, C] -> (logprobs [N, C], entropy [N, C] or empty)."""
    logits = head(hidden).float()  # [N, C, V]
    if temperature != 1.0:
        logits = logits / temperature
    logp_all = torch.log_softmax(logits, dim=-1)  # [N, C, V]
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [N, C]
    if with_entropy:
        ent = -(logp_all.exp() * logp_all).sum(-1)  # [N, C]
    else:
        ent = logp.new_zeros(0)
    return logp, ent


def head_chunk(
    head: Callable[[Tensor], Tensor], hidden: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    """``_chunk_stats`` of one chunk, checkpointed when grad is on (its [N, C, V] logits are recomputed in
    the backward pass instead of kept)."""
    if torch.is_grad_enabled():
        return checkpoint(_chunk_stats, head, hidden, targets, temperature, with_entropy, use_reentrant=False)
    return _chunk_stats(head, hidden, targets, temperature, with_entropy)


def token_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 64,
    with_entropy: bool = False,
) -> TokenStats:
    """Per-token log-probs (and optionally entropies) of ``input_ids`` under ``model``.

    Args:
        model: a transformers causal LM (Llama, Qwen2, Qwen3, OLMo-2, ...).
        input_ids: LongTensor[N, L], right-padded.
        attention_mask: LongTensor[N, L], 1 on real tokens.
        temperature: logits are divided by it before the softmax (must be > 0).
        chunk_size: number of sequence positions per output-layer chunk.
        with_entropy: also return the entropy of each predictive distribution.

    Returns:
        TokenStats with float32 ``logprobs`` [N, L] (and ``entropy`` [N, L]); differentiable
        w.r.t. the model parameters when grad is enabled.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if input_ids.shape != attention_mask.shape or input_ids.dim() != 2:
        raise ValueError(f"expected matching [N, L] tensors, got {input_ids.shape} and {attention_mask.shape}")
    backbone, head = backbone_and_head(model)
    n, length = input_ids.shape
    out = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=True)
    hidden = out.last_hidden_state  # [N, L, H]

    lp_chunks: list[Tensor] = [hidden.new_zeros(n, 1, dtype=torch.float32)]
    ent_chunks: list[Tensor] = [hidden.new_zeros(n, 1, dtype=torch.float32)]
    # hidden[:, s] predicts input_ids[:, s + 1]; positions 0..L-2 predict columns 1..L-1. At least one
    # (maybe empty) chunk: the output layer is in the graph of a backward even without any prediction.
    for start in range(0, max(length - 1, 1), chunk_size):
        end = min(start + chunk_size, length - 1)
        h = hidden[:, start:end]
        tgt = input_ids[:, start + 1 : end + 1]
        lp, ent = head_chunk(head, h, tgt, temperature, with_entropy)
        lp_chunks.append(lp)
        ent_chunks.append(ent)

    mask = attention_mask.to(torch.float32)
    logprobs = torch.cat(lp_chunks, dim=1)[:, :length] * mask
    entropy = torch.cat(ent_chunks, dim=1)[:, :length] * mask if with_entropy else None
    return TokenStats(logprobs=logprobs, entropy=entropy)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Checkpoint every decoder layer (non-reentrant) and disable the KV cache for training."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False
