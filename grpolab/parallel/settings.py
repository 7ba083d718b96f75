"""``[dist]``: how a run under torchrun spreads over its ranks (read by ``grpolab.parallel.ranks`` and
``grpolab.parallel.fsdp``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from grpolab.common.settings import Section


class DistConfig(Section):
    """Data parallelism under ``torchrun --nproc_per_node N`` (ignored in one process)."""

    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp",
        description="ddp: every rank holds the whole model, gradients all-reduced by DistributedDataParallel; "
        "fsdp: weights, gradients and optimizer state sharded over the ranks by FSDP2 (fully_shard), for models "
        "that do not fit on one device (with the hf engine: no tools)",
    )
    timeout_minutes: int = Field(
        30,
        ge=1,
        description="how long a collective waits for a rank before the run "
        "fails (torchrun ends the others at once when a rank exits)",
    )
