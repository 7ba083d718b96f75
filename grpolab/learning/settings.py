"""``[optim]``: the optimizer and how the update batches its sequences (read by ``grpolab.learning``)."""

from __future__ import annotations

from typing import Protocol

from pydantic import Field

from grpolab.common.settings import Section
from grpolab.models.settings import PrecisionName
from grpolab.rollout.settings import RunSettings


class OptimConfig(Section):
    lr: float = Field(1e-4, gt=0, description="AdamW's learning rate (constant)")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's (beta1, beta2)")
    weight_decay: float = Field(0.0, ge=0, description="AdamW's decoupled weight decay")
    max_grad_norm: float = Field(1.0, gt=0, description="gradients are clipped to this global norm per optimizer step")
    micro_batch_size: int = Field(32, ge=1, description="sequences per micro-batch (unless micro_batch_tokens)")
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="token budget per micro-batch instead of a count: sequences (or shared-prompt "
        "units) sorted by length, each micro-batch padded to its longest holds at most this many positions; "
        "the gradient is unchanged (denominators are those of the whole optimizer step)",
    )
    shared_prompts: bool = Field(
        True,
        description="compute each prompt once for the completions that share it "
        "in the training forward (same log-probs and gradients); off or unsupported by "
        "the model's attention: every sequence on its own",
    )
    precision: PrecisionName = Field(
        "fp32_master",
        description="with bf16 compute (model.dtype): fp32_master = fp32 weights and AdamW "
        "under bf16 autocast; bf16_compensated = bf16 weights, AdamW with Kahan summation (torch-optimi); "
        "bf16 = plain AdamW on bf16 weights (small updates round away; warns)",
    )
    full_metrics: bool = Field(
        True,
        description="a no-grad forward of the sequences that need no gradient "
        "(pruned zero-advantage rows, skipped steps) so entropy, KL and ratio metrics "
        "cover every response token; False saves that forward",
    )


class LearnerSettings(RunSettings, Protocol):
    """What the learner reads of a whole run's config (``grpolab.config.RunConfig`` is one, assembled a layer
    above): the rollout layer's sections, the optimizer's, and the RL reward's terms and weights."""

    optim: OptimConfig

    def reward_weights(self) -> dict[str, float] | None: ...
