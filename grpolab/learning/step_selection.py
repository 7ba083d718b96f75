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
from functools import partial
from typing import Any

import torch
from torch import Tensor

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


def step_selection(step: Any, policy_logprobs: Callable) -> StepSelection:
    """The no-grad pass over the step's rows (this rank's, split as the step's micro-batches), then the selection
    over the whole step's tokens (gathered from every rank, in global row order). ``step``: the update's
    ``StepContext`` (update.py's type, untyped here: update.py imports this module); its ``remember(rows,
    logprobs)`` sees each forward's log-probs (the first step's sync check). Clip-Cov draws on the schedule's
    ``generator`` (a run's: its mini-batch generator, saved in checkpoints); None: a generator seeded 0 for this
    step, so that a call is deterministic (never torch's global generator)."""
    logprobs, entropy = _selection_pass(step, policy_logprobs)
    mask = step.data.response_mask
    rows = step.indices.sort().values  # canonical order: rows by index, then positions
    valid = mask[rows] > 0
    flat, mine = _step_tokens(step, rows, valid, logprobs, entropy)
    generator = step.schedule.generator if step.schedule.generator is not None else torch.Generator().manual_seed(0)
    chosen = select_flat(step.spec, *flat, generator=generator)
    scatter = partial(_scatter, mask.shape, rows, valid, mine)
    return StepSelection(
        keep=scatter(chosen.keep, True),
        penalise=scatter(chosen.penalise, False),
        bonus=scatter(chosen.bonus, False),
        bonus_tokens=float(chosen.bonus.sum()),
        logprobs=logprobs,
        entropy=entropy,
    )


def _selection_pass(step: Any, policy_logprobs: Callable) -> tuple[Tensor, Tensor]:
    """Log-probs and entropies [N, T] of this rank's rows of the step, without gradients, in the forward's dtype
    (zeros at the other rows; float64 zeros when the rank has no row of the step). Under FSDP the rank runs as
    many forwards as the busiest rank, the extra ones on a filler row."""
    mask, share, indices = step.data.response_mask, step.share, step.indices
    logprobs = entropy = None  # [N, T] in the forward's dtype, allocated at the first forward
    micros = step.schedule.split(indices) if len(indices) else []
    _, n_pass = share.forwards(0, len(micros), False)
    with torch.no_grad():
        for i in range(n_pass):
            if i >= len(micros):
                (share.filler_logprobs or policy_logprobs)(torch.zeros(1, dtype=torch.long, device=indices.device))
                continue
            lp, ent, *_ = policy_logprobs(micros[i])
            if ent is None:
                raise ValueError("token selection by entropy needs the policy's entropies; this forward computes none")
            if logprobs is None:
                logprobs = torch.zeros(mask.shape, dtype=lp.dtype, device=mask.device)
                entropy = torch.zeros(mask.shape, dtype=ent.dtype, device=mask.device)
            logprobs[micros[i]], entropy[micros[i]] = lp, ent
            step.remember(micros[i], lp)
    if logprobs is None:  # no row of the step on this rank
        logprobs = entropy = torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    return logprobs, entropy


def _step_tokens(
    step: Any, rows: Tensor, valid: Tensor, logprobs: Tensor, entropy: Tensor
) -> tuple[list[Tensor], slice]:
    """The step's response tokens over every rank, flat in canonical order (``rows`` [n] sorted, ``valid`` [n, T]
    their response tokens): entropy, log-prob, old log-prob and advantage, float64 [K]; and where this rank's
    tokens are among them (ranks hold consecutive blocks of rows, in rank order)."""
    data, ranks = step.data, step.share.ranks
    old = logprobs if data.old_logprobs is None else data.old_logprobs
    flat = [
        entropy[rows][valid].double(),
        logprobs[rows][valid].double(),
        old[rows][valid].double(),
        data.advantages[rows].double()[:, None].expand_as(valid)[valid],
    ]
    own, start = flat[0].numel(), 0
    if ranks.parallel:
        parts = ranks.gather([t.cpu() for t in flat])
        start = sum(p[0].numel() for p in parts[: ranks.rank])
        flat = [torch.cat([p[j] for p in parts]) for j in range(len(flat))]
    return flat, slice(start, start + own)


def _scatter(
    shape: torch.Size, rows: Tensor, valid: Tensor, mine: slice, values: Tensor | None, fill: bool
) -> Tensor | None:
    """This rank's part ``mine`` of a flat token choice ``values`` [K] back to its data's rows: bool ``shape``
    [N, T], ``fill`` outside the step's response tokens (None: ``values`` is None)."""
    if values is None:
        return None
    out = torch.full(shape, fill, dtype=torch.bool, device=valid.device)
    block = torch.full(valid.shape, fill, dtype=torch.bool, device=valid.device)
    block[valid] = values[mine].to(valid.device)
    out[rows] = block
    return out
