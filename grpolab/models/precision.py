"""Training precision: in which dtype the weights live, in which the forward runs, which optimizer.

An update smaller than half a bf16 ulp of a weight rounds away: AdamW on bf16 weights at lr 1e-5
leaves most of them bit-identical, and a run barely trains. Three settings (``optim.precision``),
all for a bf16 compute dtype (``model.dtype``; with float32 compute everything is float32):

fp32_master       weights, gradients and AdamW state in float32; forward and backward under bf16
                  autocast (matmuls in bf16, log-prob math in float32). 16 bytes per parameter.
bf16_compensated  bf16 weights and state; torch-optimi's AdamW with Kahan summation keeps the part
                  of each update that bf16 rounding drops in a bf16 compensation buffer.
                  10 bytes per parameter.
bf16              bf16 weights and plain AdamW: small updates round away (allowed, with a warning).
                  8 bytes per parameter.

The rollout engine always samples in the compute dtype (``compute``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch

# bytes per parameter: weights + gradients + optimizer state (+ compensation)
BYTES_PER_PARAMETER: dict[str, dict[str, int]] = {
    "fp32_master": {"weights": 4, "gradients": 4, "optimizer_state": 8},
    "bf16_compensated": {"weights": 2, "gradients": 2, "optimizer_state": 4 + 2},
    "bf16": {"weights": 2, "gradients": 2, "optimizer_state": 4},
}

BF16_WARNING = (
    "optim.precision 'bf16': AdamW updates bf16 weights directly, and an update smaller than "
    "half a bf16 ulp of a weight rounds away (at lr 1e-5 most weights never move); use "
    "'fp32_master' or 'bf16_compensated'"
)


@dataclass(frozen=True)
class TrainingPrecision:
    """storage: dtype of the parameters; compute: dtype of the forward pass (autocast when they differ)."""

    name: str  # "float32" when compute is float32, else the optim.precision setting
    storage: torch.dtype
    compute: torch.dtype

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The context every forward of the policy (training, log-probs, hf generation) runs in."""
        if self.storage == self.compute:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.compute)

    def optimizer_state_bytes(self, trained: int) -> int:
        """Bytes of the optimizer's state for ``trained`` parameters (AdamW's two moments, plus Kahan's
        compensation for bf16_compensated), as ``BYTES_PER_PARAMETER`` counts them."""
        return BYTES_PER_PARAMETER.get(self.name, BYTES_PER_PARAMETER["fp32_master"])["optimizer_state"] * trained

    def optimizer(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        eps: float = 1e-8,
    ) -> torch.optim.Optimizer:
        """AdamW (torch's), or torch-optimi's AdamW with Kahan summation for bf16_compensated."""
        if self.name == "bf16_compensated":
            from optimi import AdamW

            # decoupled weight decay as torch's AdamW (decouple_lr=False); the triton kernel is off:
            # the foreach path is the one tested on CPU
            return AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps, kahan_sum=True, triton=False)
        return torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay, eps=eps)


def resolve_precision(setting: str, compute: torch.dtype, warn: bool = True) -> TrainingPrecision:
    """The precision of a run whose forward runs in ``compute`` (torch.float32 or torch.bfloat16)."""
    if compute == torch.float32:
        return TrainingPrecision("float32", torch.float32, torch.float32)
    if setting == "fp32_master":
        return TrainingPrecision(setting, torch.float32, compute)
    if setting == "bf16" and warn:
        warnings.warn(BF16_WARNING, stacklevel=2)
    if setting in ("bf16", "bf16_compensated"):
        return TrainingPrecision(setting, compute, compute)
    raise ValueError(f"unknown optim.precision {setting!r}")


def memory_table(n_parameters: int) -> dict[str, dict[str, int]]:
    """Bytes of weights, gradients and optimizer state under every bf16 setting (for the probe)."""
    return {
        name: {**{k: v * n_parameters for k, v in per.items()}, "total": sum(per.values()) * n_parameters}
        for name, per in BYTES_PER_PARAMETER.items()
    }
