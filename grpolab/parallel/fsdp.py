"""FSDP2 sharding (``dist.strategy = "fsdp"``): a model's weights, gradients and optimizer state split over
the ranks with ``fully_shard``, and the whole weights and optimizer state gathered for checkpoints."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "drop_stale_weights",
    "full_optimizer_state",
    "full_state_dict",
    "is_sharded",
    "load_optimizer_state",
    "shard_fsdp",
    "whole",
]


# Before torch 2.13 the root's pre-backward gather does not cover a checkpointed output-layer chunk that
# the backward recomputes (``aten.mm got mixed torch.Tensor and DTensor``): there the root keeps its whole
# weights from forward to backward, and ``drop_stale_weights`` reshards it after each optimizer step.
ROOT_RESHARDS_AFTER_FORWARD = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)


def drop_stale_weights(model: nn.Module) -> None:
    """After an optimizer step on a sharded ``model``: free any whole weights a forward left gathered, so
    that the next forward gathers the updated shards (a no-op where the root reshards after every forward)."""
    if not ROOT_RESHARDS_AFTER_FORWARD and is_sharded(model):
        model.reshard()


def shard_fsdp(model: nn.Module, forward_methods: dict[str, Callable[..., Any]]) -> nn.Module:
    """Shard ``model`` in place with FSDP2: each decoder layer (transformers' ``_no_split_modules``) is
    one unit, the root the rest (embedding, tied output layer, final norm). Gradients are summed over
    the ranks, not averaged (the loss divides by the global denominators; gloo has no pre-scaled sum).
    The root reshards after every forward too, so that a no-grad forward (metrics, generation) between
    a step's last backward and the optimizer step cannot leave a stale unsharded copy of its weights.

    ``forward_methods`` (name -> function(model, ...)) become methods of ``model`` that gather its
    weights like ``forward`` does (``register_fsdp_forward_method``): the training forward calls the
    backbone and the output layer apart, which the root's hooks would not see."""
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"dist.strategy 'fsdp': cannot find the decoder layers of {type(model).__name__}")
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    model.set_reshard_after_forward(ROOT_RESHARDS_AFTER_FORWARD, recurse=False)
    for module in model.modules():
        if isinstance(module, FSDPModule):  # neither setter recurses
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
    for name, fn in forward_methods.items():
        setattr(model, name, types.MethodType(fn, model))
        register_fsdp_forward_method(model, name)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def whole(tensor: Tensor) -> Tensor:
    """A sharded parameter (a DTensor) gathered whole on every rank (every rank calls it, in the same order);
    any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def full_state_dict(model: nn.Module, on_every_rank: bool = False) -> dict[str, Tensor]:
    """The whole weights of a sharded ``model`` on CPU: on rank 0 ({} elsewhere), or ``on_every_rank``;
    every rank calls it. A tied weight (output layer = embedding) appears once, under its first name, as
    ``save_pretrained`` writes it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=not on_every_rank))
    return {k: v.cpu() for k, v in weights.items() if k not in tied}


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state of a sharded ``model``, whole and keyed by parameter name, on rank 0; every
    rank calls it. Before the first update (empty state) the plain ``state_dict``: torch's conversion
    would initialise an empty state with a zero-learning-rate step, which counts as a step for AdamW."""
    if not optimizer.state:
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a saved optimizer state: a plain ``state_dict`` (keyed by position) or a whole one keyed by
    parameter name (``full_optimizer_state``), into a sharded or a plain ``model``'s optimizer."""
    by_name = any(isinstance(p, str) for group in state["param_groups"] for p in group["params"])
    if not by_name:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))
