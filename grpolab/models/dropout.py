"""The policy's own dropout, switched off for the whole run.

Policy-gradient objectives compare the policy that sampled (the engine, and the old log-probs frozen in
eval mode) with the policy being updated. A model whose config has dropout (GPT-2, OPT, Phi-2: 0.1; any
``attention_dropout``) would compute another, random policy in the update's train-mode forwards: the
first optimizer step's ratio would not be 1, and the sync check (eval mode) could not see it. Like TRL's
``disable_dropout``, every dropout of the model is set to 0; the model stays in train mode for its update
(gradient checkpointing needs it). Unlike it, the float settings modules copy from the config (Qwen2's
``attention_dropout``, OPT's ``layerdrop``, Mixtral's router ``jitter_noise``) and the config fields some
families read inside their forward (Falcon, GPT-Neo) are zeroed too: nn.Dropout alone misses them.

A LoRA adapter's own dropout (``model.lora.dropout``) is a user setting, applied after this.
"""

from __future__ import annotations

from torch import nn

# names of float settings that make a train-mode forward random: dropout, attn_pdrop, layerdrop, jitter_noise
_STOCHASTIC = ("drop", "jitter")


def _stochastic(name: str, value) -> bool:
    return any(s in name.lower() for s in _STOCHASTIC) and isinstance(value, float) and value > 0


def _zero_config(config, prefix: str = "config.") -> list[str]:
    """Zero the stochastic float fields of a transformers config (and of its sub-configs)."""
    switched = []
    for name, value in list(vars(config).items()):
        if _stochastic(name, value):
            setattr(config, name, 0.0)
            switched.append(f"{prefix}{name}")
        elif hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config (text_config, ...)
            switched += _zero_config(value, f"{prefix}{name}.")
    return switched


def disable_dropout(model: nn.Module) -> list[str]:
    """Switch off every dropout of ``model`` in place: nn.Dropout modules' ``p``, the stochastic float
    attributes of its modules and of its config. Returns the settings that were not 0 (sorted, deduplicated:
    ``"nn.Dropout"``, ``"config.attention_dropout"``, ``"attention_dropout"``, ...)."""
    switched: set[str] = set()
    config = getattr(model, "config", None)
    if config is not None:
        switched.update(_zero_config(config))
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            if module.p > 0:
                module.p = 0.0
                switched.add("nn.Dropout")
            continue
        for name, value in list(vars(module).items()):
            if not name.startswith("_") and _stochastic(name, value):
                setattr(module, name, 0.0)
                switched.add(name)
    return sorted(switched)
