"""The policy's weights as an engine's weight sync takes them: one typed, versioned source.

Every engine's ``sync_weights`` takes a ``PolicyWeights``. Its ``kind`` says what it holds:

* ``full``: the whole weights of an unsharded policy, read from the training model itself (``ModelWeights``);
  an engine that shares the training model generates with ``model`` directly, sharded or not;
* ``gathered``: a sharded policy's whole weights, gathered from its shards on every rank and held on the CPU
  (``GatheredWeights``);
* ``merged``: a LoRA policy's weights as a plain model has them, base + scaled adapter product
  (``grpolab.models.lora.MergedWeights``);
* ``adapter``: a LoRA policy's adapter alone, for an engine with LoRA of its own
  (``grpolab.models.lora.AdapterWeights``).

``version`` is the policy's count of applied optimizer updates when the weights were taken (0: the start
policy), so an engine knows which policy it samples from.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import ClassVar, Literal

from torch import Tensor, nn

from grpolab.parallel.fsdp import full_state_dict

__all__ = ["GatheredWeights", "ModelWeights", "PolicyWeights", "WeightKind"]

WeightKind = Literal["full", "gathered", "merged", "adapter"]


class PolicyWeights:
    """A policy's weights for an engine: ``kind`` (see the module), ``version`` (updates applied) and
    ``model``, the Hugging Face model they are of. All kinds but ``adapter`` are read the way an engine's
    weight sync reads a model: ``named_parameters()`` (tied weights once) and ``parameters()``."""

    kind: ClassVar[WeightKind]
    model: nn.Module
    version: int

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        raise NotImplementedError(f"{self.kind} weights are not read by name")

    def parameters(self) -> Iterator[Tensor]:
        return (tensor for _, tensor in self.named_parameters())


class ModelWeights(PolicyWeights):
    """The training model's own weights (kind ``full``): read from ``model`` itself when an engine syncs, so
    nothing is copied until then."""

    kind = "full"

    def __init__(self, model: nn.Module, version: int = 0):
        self.model, self.version = model, version

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        return self.model.named_parameters()

    def parameters(self) -> Iterator[Tensor]:
        return self.model.parameters()


class GatheredWeights(PolicyWeights):
    """A sharded model's whole weights (kind ``gathered``), gathered on every rank (every rank builds it) and
    held on the CPU (so an engine syncs through its weight files, as it does from a CPU model)."""

    kind = "gathered"

    def __init__(self, model: nn.Module, version: int = 0):
        self.model, self.version = model, version
        self.weights = full_state_dict(model, on_every_rank=True)

    def named_parameters(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self.weights.items())

    def parameters(self) -> Iterator[Tensor]:
        return iter(self.weights.values())
