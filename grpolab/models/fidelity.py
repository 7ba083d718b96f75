"""Which parts of a model's own forward the training forward reproduces: decided here, per model.

The training forward (``grpolab.models.logprobs``, ``grpolab.learning.shared_prefix``) does not call ``model(...)``: it runs
the decoder backbone, then the output layer on completion tokens only; with shared prompts the backbone
runs twice, the prompts into a ``DynamicCache`` and then their completions. Three things decide whether
its log-probs are the model's own (and those ``generate`` sampled from):

- the logits: some families transform the output layer's logits in their ``...ForCausalLM.forward``;
  ``output_logits`` applies the same operations, in the model's dtype, before any temperature (as
  ``generate`` does). A family with a logit attribute this module does not know is refused.
- sharing a prompt: exact only when every layer is full attention. A sliding-window layer's cache keeps
  the last window columns of the right-padded prompts, and its mask measures the window in cache columns,
  which are not the positions of a shorter prompt's completion; other layer types have no key/value
  cache to share. Gradient checkpointing drops the cache inside checkpointed layers.
- the length: rope types whose frequencies follow each forward's longest position (longrope switches
  from short to long factors past ``original_max_position_embeddings``, dynamic NTK rescales past
  ``max_position_embeddings``) give a sequence different rotations in a padded batch, in a prompt's and
  its completion's passes, and in ``generate`` (whose cached keys kept the prompt's). Runs whose longest
  sequence can pass that limit are refused.

The attention kernel matters too: soft-capped attention logits (Gemma-2) are computed by the eager kernel
only, so such models load with it (``attention_implementation``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = [
    "ForwardFidelity",
    "forward_fidelity",
    "check_trainable",
    "output_logits",
    "attention_implementation",
    "OUTPUT_TRANSFORMS",
]

# model_type -> (operation, config attribute) its ...ForCausalLM applies to the output layer's logits, as
# transformers' modeling files do it; "softcap" is tanh(logits / c) * c
OUTPUT_TRANSFORMS: dict[str, tuple[str, str]] = {
    **dict.fromkeys(
        ("granite", "granite_swa", "granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared"),
        ("divide", "logits_scaling"),
    ),
    "hyperclovax": ("multiply", "logits_scaling"),
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe"), ("multiply", "logit_scale")),
    "falcon_h1": ("multiply", "lm_head_multiplier"),
    **dict.fromkeys(
        ("gemma2", "gemma3_text", "gemma3n_text", "gemma4_text", "vaultgemma", "nanochat"),
        ("softcap", "final_logit_softcapping"),
    ),
}
# config attributes by which some family changes its logits around the output layer: set on a family
# not in OUTPUT_TRANSFORMS, the training forward would miss it
LOGIT_ATTRIBUTES = ("logits_scaling", "logit_scale", "final_logit_softcapping", "logits_soft_cap", "lm_head_multiplier")
# rope types whose frequencies depend on the longest position of each forward -> the config field (rope
# parameters first, then the config) past which they change
LENGTH_DEPENDENT_ROPE = {"longrope": "original_max_position_embeddings", "dynamic": "max_position_embeddings"}


@dataclass(frozen=True)
class ForwardFidelity:
    """What the training forward reproduces of one model's own forward.

    share_blocker: why a prompt cannot be computed once for its completions (one line), None when it can.
    unsupported: why the model cannot be trained at all (one line), None when it can.
    exact_up_to: the longest sequence (prompt + completion tokens) whose log-probs training, the model's
        own forward and ``generate`` agree on; None: no limit. length_reason: what changes past it.
    """

    share_blocker: str | None = None
    unsupported: str | None = None
    exact_up_to: int | None = None
    length_reason: str = ""

    def refusal(self, max_total_len: int) -> str | None:
        """Why a run whose sequences reach ``max_total_len`` tokens cannot be trained (one line), or None."""
        if self.unsupported is not None:
            return self.unsupported
        if self.exact_up_to is not None and max_total_len > self.exact_up_to:
            return (
                f"sequences of up to {max_total_len} tokens (longest prompt + max_new_tokens) pass the "
                f"{self.exact_up_to} tokens within which this model's forward is the same in generation and "
                f"training ({self.length_reason}); shorten the prompts or max_new_tokens"
            )
        return None


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _logit_steps(config) -> tuple[list[tuple[str, float]], str | None]:
    """The (operation, value) steps after the output layer, and why the model is refused (or None)."""
    model_type = getattr(config, "model_type", "")
    known = OUTPUT_TRANSFORMS.get(model_type)
    if known is not None:
        op, attribute = known
        value = getattr(config, attribute, None)
        return ([] if value is None else [(op, float(value))]), None
    unknown = [a for a in LOGIT_ATTRIBUTES if getattr(config, a, None) not in (None, 1, 1.0)]
    if unknown:
        return [], (
            f"{model_type}: config.{unknown[0]} changes the logits in a way the training forward does not "
            "reproduce (grpolab.models.fidelity.OUTPUT_TRANSFORMS lists the families it does)"
        )
    return [], None


def output_logits(model: nn.Module) -> Callable[[Tensor], Tensor]:
    """The model's output layer as its own forward applies it: hidden [..., H] -> logits [..., V] in the
    model's dtype (``lm_head``, then the family's transform, operation by operation as transformers does)."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings")
    steps, _ = _logit_steps(_text_config(model))
    if not steps:
        return head

    def logits(hidden: Tensor) -> Tensor:
        out = head(hidden)
        for op, value in steps:
            if op == "divide":
                out = out / value
            elif op == "multiply":
                out = out * value
            else:  # softcap
                out = torch.tanh(out / value) * value
        return out

    return logits


def _other_layer_types(config) -> list[str]:
    """The layer types other than full attention over the whole sequence, as transformers decides them for
    the cache (``layer_types``, else ``sliding_window`` / ``attention_chunk_size``) and the masks."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        layer_types = [
            "sliding_attention"
            if window is not None
            else "chunked_attention"
            if getattr(config, "attention_chunk_size", None) is not None
            else "full_attention"
        ] * getattr(config, "num_hidden_layers", 1)
    other = sorted(set(layer_types) - {"full_attention"})
    if getattr(config, "use_sliding_window", False) and "sliding_attention" not in other:
        other.append("sliding_attention")
    return other


def _length_limit(config) -> tuple[int | None, str]:
    """The longest exact sequence for length-dependent rope (None: none such) and a note on why."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    per_layer_type = params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]
    limits = []
    for p in per_layer_type:
        rope_type = p.get("rope_type", p.get("type", "default"))
        field = next((f for t, f in LENGTH_DEPENDENT_ROPE.items() if t in rope_type), None)
        if field is not None:
            limit = p.get(field) or getattr(config, field, None) or config.max_position_embeddings
            limits.append((int(limit), f"{rope_type} rope, whose frequencies change past {field} {limit}"))
    return min(limits) if limits else (None, "")


def forward_fidelity(model: nn.Module) -> ForwardFidelity:
    """What the training forward reproduces of ``model`` (a transformers causal LM), as it is now (gradient
    checkpointing on or off)."""
    config = _text_config(model)
    _, unsupported = _logit_steps(config)
    exact_up_to, length_reason = _length_limit(config)
    blocker = None
    other = _other_layer_types(config)
    if getattr(model, "is_gradient_checkpointing", False):
        blocker = "gradient checkpointing recomputes each layer without the prompt's key/value cache"
    elif "sliding_attention" in other or "chunked_attention" in other:
        window = getattr(config, "sliding_window", None) or getattr(config, "attention_chunk_size", None)
        blocker = (
            f"the model has sliding-window attention (window {window}), which a cache of right-padded "
            "prompts does not reproduce"
        )
    elif other:
        blocker = f"the model has layers other than full attention ({', '.join(other)})"
    return ForwardFidelity(
        share_blocker=blocker, unsupported=unsupported, exact_up_to=exact_up_to, length_reason=length_reason
    )


def attention_implementation(config, requested: str = "sdpa") -> str:
    """The attention kernel that computes ``config``'s model as designed: eager when its attention logits
    are soft-capped (Gemma-2; transformers' sdpa and flash kernels skip ``attn_logit_softcapping``)."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return "eager" if getattr(text, "attn_logit_softcapping", None) is not None else requested


def check_trainable(model: nn.Module, max_total_len: int) -> None:
    """Raise ValueError (one line) when the training forward cannot reproduce ``model``'s own forward on
    sequences of up to ``max_total_len`` tokens (prompt + completion)."""
    refusal = forward_fidelity(model).refusal(max_total_len)
    if refusal is not None:
        raise ValueError(refusal)
