"""One optimizer step's token selection (80/20, Clip-Cov, KL-Cov), decided over the whole step.

TRL and verl select per micro-batch (a quantile or a covariance of the micro-batch's tokens), so their update
depends on how the step is split. Here a no-grad pass over every row of the step (all its micro-batches; each
data-parallel rank its rows, gathered) computes the current policy's log-probs and entropies first; the
selection over all the step's tokens (``grpolab.objectives.token_selection.select_flat``) then goes to every
micro-batch. In the step the policy has not moved yet (the gradient only accumulates), so the pass gives exactly
the values the training forwards compute. Cost: one forward without gradients over the step's rows (about a
third of a forward + backward); the rows it covers need no second no-grad forward for their metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from grpolab.objectives.algorithms import AlgorithmSpec
from grpolab.objectives.losses import PolicyLossInput
from grpolab.objectives.token_selection import select_flat


@dataclass
class StepSelection:
    """The selection of one step over this rank's data rows [N, T] (rows outside the step: all True / False),
    the pass's log-probs and entropies [N, T] (detached, valid at ``covered`` rows) and the step's bonus tokens
    (the count over all ranks)."""

    keep: Tensor
    penalise: Tensor | None
    bonus: Tensor
    bonus_tokens: float
    logprobs: Tensor
    entropy: Tensor

    def loss_input(
        self, inp: PolicyLossInput, rows: Tensor, entropy: Tensor | None, coef: float | None
    ) -> PolicyLossInput:
        """``inp`` of the rows ``rows`` with the selection's fields, and the entropy bonus with ``coef`` (None: off)."""
        inp.keep = self.keep[rows]
        inp.penalise = None if self.penalise is None else self.penalise[rows]
        inp.entropy = entropy
        inp.bonus = None if coef is None else (coef, self.bonus_tokens, self.bonus[rows])
        return inp


def step_selection(
    spec: AlgorithmSpec,
    data: Any,
    indices: Tensor,
    policy_logprobs: Callable,
    split: Callable[[Tensor], list[Tensor]],
    dp: Any = None,
    generator: torch.Generator | None = None,
    record: Callable[[Tensor, Tensor], None] | None = None,
) -> StepSelection:
    """The no-grad pass over the step's rows ``indices`` (this rank's, split as the step's micro-batches), then
    the selection over the whole step's tokens (gathered from every rank of ``dp``, in global row order).
    ``data``: the update's ``UpdateData``; ``dp``: its ``DataParallelShare`` or None (update.py's types, untyped
    here: update.py imports this module).
    ``record(rows, logprobs)`` sees each forward's log-probs (the first step's sync check). Clip-Cov draws on
    ``generator`` (a run's: its mini-batch generator, saved in checkpoints); None: a generator seeded 0 for this
    step, so that a call is deterministic (never torch's global generator)."""
    mask = data.response_mask
    logprobs = entropy = None  # [N, T] in the forward's dtype, allocated at the first forward
    micros = split(indices) if len(indices) else []
    n_pass = len(micros)
    if dp is not None:
        _, n_pass = dp.forwards(0, n_pass, False)  # FSDP: as many forwards as the busiest rank
    filler = torch.zeros(1, dtype=torch.long, device=indices.device)
    with torch.no_grad():
        for i in range(n_pass):
            if i >= len(micros):
                (dp.filler_logprobs or policy_logprobs)(filler)
                continue
            lp, ent, *_ = policy_logprobs(micros[i])
            if ent is None:
                raise ValueError("token selection by entropy needs the policy's entropies; this forward computes none")
            if logprobs is None:
                logprobs = torch.zeros(mask.shape, dtype=lp.dtype, device=mask.device)
                entropy = torch.zeros(mask.shape, dtype=ent.dtype, device=mask.device)
            logprobs[micros[i]], entropy[micros[i]] = lp, ent
            if record is not None:
                record(micros[i], lp)

    if logprobs is None:  # no row of the step on this rank
        logprobs = entropy = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    rows = indices.sort().values  # canonical order: rows by index, then positions
    valid = mask[rows] > 0
    old = logprobs if data.old_logprobs is None else data.old_logprobs
    flat = [
        entropy[rows][valid].double(),
        logprobs[rows][valid].double(),
        old[rows][valid].double(),
        data.advantages[rows].double()[:, None].expand_as(valid)[valid],
    ]
    own = flat[0].numel()
    start = 0
    if dp is not None and dp.ranks.parallel:  # ranks hold consecutive blocks of rows, in rank order
        parts = dp.ranks.gather([t.cpu() for t in flat])
        start = sum(p[0].numel() for p in parts[: dp.ranks.rank])
        flat = [torch.cat([p[j] for p in parts]) for j in range(len(flat))]
    sel = select_flat(spec, *flat, generator=generator if generator is not None else torch.Generator().manual_seed(0))

    def scatter(values: Tensor | None, fill: bool) -> Tensor | None:
        if values is None:
            return None
        out = torch.full(mask.shape, fill, dtype=torch.bool, device=mask.device)
        block = torch.full(valid.shape, fill, dtype=torch.bool, device=mask.device)
        block[valid] = values[start : start + own].to(mask.device)
        out[rows] = block
        return out

    return StepSelection(
        keep=scatter(sel.keep, True),
        penalise=scatter(sel.penalise, False),
        bonus=scatter(sel.bonus, False),
        bonus_tokens=float(sel.bonus.sum()),
        logprobs=logprobs,
        entropy=entropy,
    )
