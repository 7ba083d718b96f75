"""The policy a run trains, full weights or a LoRA adapter on a frozen base, sharded by FSDP or not.

A ``Policy`` owns what is one job for every kind of policy: loading it (``load_run_policy``), its frozen
reference (``add_reference``: a frozen copy of the start policy, or the policy with its adapter switched off
within ``reference_context``), what a checkpoint saves (``saved``, ``saved_state``), the weights it hands an
engine (``weights``, of a kind the engine selects, ``grpolab.models.weights``) and the files such an engine
starts from (``start_files``). The run's assembly asks it and never which kind it is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpolab.models.loading import frozen_copy, load_policy
from grpolab.models.lora import Adapter, AdapterWeights, MergedWeights, adapter_base, add_adapter, is_adapter_folder
from grpolab.models.precision import TrainingPrecision
from grpolab.models.weights import GatheredWeights, ModelWeights, PolicyWeights, WeightKind
from grpolab.parallel.fsdp import shard_fsdp

__all__ = ["FullPolicy", "LoraPolicy", "Policy", "load_run_policy", "policy_start"]


class Policy:
    """The policy being trained, with its tokenizer and, once added, its frozen reference.

    model_dir: the start model's folder (a LoRA policy's base); weights_dir: the folder its weights were
    loaded from (a checkpoint resumed, else ``model_dir``); started_from: another LoRA run's checkpoint whose
    adapter this run continues (None otherwise); device: where its weights live.
    """

    def __init__(
        self,
        model_dir: Path,
        weights_dir: Path,
        precision: TrainingPrecision,
        model: nn.Module,
        tokenizer: Any,
        device: torch.device,
        started_from: Path | None = None,
    ):
        self.model_dir, self.weights_dir, self.precision = model_dir, weights_dir, precision
        self.model, self.tokenizer, self.device, self.started_from = model, tokenizer, device, started_from
        self.reference: nn.Module | None = None
        self.sharded = False

    # ---- training ----
    def trainable(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def describe(self) -> str:
        """Its size and where it lives, for the load's progress line."""
        return f"{sum(p.numel() for p in self.model.parameters()) / 1e6:.1f}M parameters on {self.device}"

    # ---- the reference ----
    def add_reference(self) -> None:
        """The frozen reference: the start policy, which the KL term and frozen log-probs read."""
        raise NotImplementedError

    def reference_context(self) -> contextlib.AbstractContextManager:
        """The context in which ``reference`` computes as the start policy."""
        return contextlib.nullcontext()

    def shard(self, forward_methods: dict[str, Callable[..., Any]]) -> None:
        """Shard the policy and its reference (one model when they are one) with FSDP, before the optimizer is
        made (it must hold the shards); ``forward_methods`` as ``shard_fsdp`` takes them."""
        for m in {id(m): m for m in (self.model, self.reference) if m is not None}.values():
            shard_fsdp(m, forward_methods)
        self.sharded = True

    # ---- checkpoints ----
    @property
    def saved(self):
        """What a checkpoint saves with ``save_pretrained``."""
        return self.model

    def saved_state(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The ``state_dict`` that ``saved.save_pretrained`` takes, from the policy's gathered ``weights``."""
        return weights

    # ---- engines ----
    @property
    def copy_kinds(self) -> tuple[WeightKind, ...]:
        """The kinds of weights it can hand an engine that holds a copy of its own, the first the default."""
        return ("gathered",) if self.sharded else ("full",)

    @property
    def adapter_rank(self) -> int | None:
        """The rank of the adapter it can hand alone (kind ``adapter``); None when it has none."""
        return None

    @property
    def start_files(self) -> Path:
        """The folder of weight files an engine holding its own weights starts from."""
        return self.weights_dir

    @property
    def files_are_policy(self) -> bool:
        """Whether ``start_files`` hold the policy itself; if not, an engine starting from them is synced at
        once."""
        return True

    def weights(self, kind: WeightKind, version: int) -> PolicyWeights:
        """Its current weights of ``kind`` (``grpolab.models.weights``); ``version``: updates applied so far.
        Kind ``gathered`` gathers the shards: every rank calls it."""
        if kind == "full":
            return ModelWeights(self.model, version)
        if kind == "gathered":
            return GatheredWeights(self.model, version)
        raise ValueError(f"a {type(self).__name__} has no {kind} weights")


class FullPolicy(Policy):
    """A policy whose weights all train; its reference is a frozen copy of the start policy."""

    def add_reference(self) -> None:
        """A frozen copy of the start policy (reloaded when the policy resumed from a checkpoint), kept in the
        compute dtype (no master copy needed)."""
        start = (
            load_policy(self.model_dir, self.precision.storage, self.device)[0]
            if self.weights_dir != self.model_dir
            else self.model
        )
        self.reference = frozen_copy(start).to(self.precision.compute)


class LoraPolicy(Policy):
    """A LoRA adapter on a base that never changes: the reference is the policy with its adapter off, a
    checkpoint holds the adapter (peft's format, with the record of its base), and an engine of its own starts
    from the base's files, then takes the merged weights or the adapter alone."""

    def __init__(self, *args, adapter: Adapter, rank: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.adapter, self.rank = adapter, rank

    def describe(self) -> str:
        trained = sum(p.numel() for p in self.trainable())
        return f"{super().describe()}, {trained / 1e6:.2f}M of them trained (LoRA rank {self.rank})"

    def add_reference(self) -> None:
        """The start policy: the base, the policy itself with its adapter off (``reference_context``)."""
        self.reference = self.model

    def reference_context(self) -> contextlib.AbstractContextManager:
        return self.adapter.disabled()

    @property
    def saved(self):
        """The adapter in peft's format with the record of its base."""
        return self.adapter

    def saved_state(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.adapter.peft_state(weights)

    @property
    def copy_kinds(self) -> tuple[WeightKind, ...]:
        return ("merged", "adapter")

    @property
    def adapter_rank(self) -> int | None:
        return self.rank

    @property
    def start_files(self) -> Path:
        """The base's: a checkpoint holds only the adapter."""
        return self.model_dir

    @property
    def files_are_policy(self) -> bool:
        return False

    def weights(self, kind: WeightKind, version: int) -> PolicyWeights:
        if kind == "merged":
            return MergedWeights(self.model, version)
        if kind == "adapter":
            return AdapterWeights(self.adapter, version)
        return super().weights(kind, version)


def policy_start(model_dir: Path, lora, needs_reference: bool) -> tuple[Path, Path | None]:
    """(the start model's folder, the LoRA checkpoint the policy starts from or None): ``model_dir`` itself,
    or for another LoRA run's checkpoint (a suite's ``init_from``) its base and the checkpoint, refused in one
    line without ``lora`` settings (``[model.lora]``) or when the run ``needs_reference`` (the base is not this
    run's start policy)."""
    if not is_adapter_folder(model_dir):
        return model_dir, None
    started_from, model_dir = model_dir, adapter_base(model_dir)
    if lora is None:
        raise ValueError(
            f"model.path {started_from} is a LoRA checkpoint: set [model.lora] (its rank and "
            "targets) to continue its adapter, or `grpolab export` it into a full model first"
        )
    if needs_reference:
        raise ValueError(
            f"model.path {started_from} is a LoRA checkpoint: its adapter switched off is its "
            "base, not this run's start policy, so a KL term or frozen reference cannot start from it"
        )
    return model_dir, started_from


def load_run_policy(
    model_dir: Path,
    weights_dir: Path,
    precision: TrainingPrecision,
    device: torch.device,
    *,
    lora,
    seed: int,
    sharded: bool,
    started_from: Path | None = None,
) -> Policy:
    """The policy in ``weights_dir``; with ``lora`` settings (a ``LoraSettings``) the base in ``model_dir`` (a
    checkpoint holds only the adapter) with its adapter: fresh from ``seed``, or the adapter of the checkpoint
    resumed (``weights_dir``) or started from (``started_from``). The adapter is float32 (peft casts it); the
    base, which never changes, is kept in the compute dtype (no master copy to round into), except when it
    will be ``sharded``: FSDP's units gather one dtype."""
    if lora is None:
        model, tokenizer = load_policy(weights_dir, precision.storage, device)
        return FullPolicy(model_dir, weights_dir, precision, model, tokenizer, device)
    model, tokenizer = load_policy(model_dir, precision.storage if sharded else precision.compute, device)
    adapter = add_adapter(model, lora, seed, model_dir)
    if weights_dir != model_dir or started_from is not None:
        adapter.load(weights_dir if weights_dir != model_dir else started_from)
    return LoraPolicy(
        model_dir,
        weights_dir,
        precision,
        adapter.model,
        tokenizer,
        device,
        started_from,
        adapter=adapter,
        rank=lora.rank,
    )
