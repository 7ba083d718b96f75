"""Which sequences go through the training forward together (pure planning, no model).

A *unit* is one row of the training forward: a prompt followed by the completions of the batch rows
that share it (``grpolab.learning.shared_prefix``), or a single sequence when prompts are not shared. A
*micro-batch* is a list of units padded to the longest of them; its cost is ``units x longest unit``
token positions (what the backbone computes).

Planning never changes the numbers: the loss denominators are those of the whole optimizer step, so
any partition of its rows into micro-batches gives the same gradient (up to float summation order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["MicroBatchPlanner", "prompt_keys"]


def prompt_keys(input_ids: Tensor, prompt_lens: Tensor) -> list[int]:
    """One id per row [N]: rows with identical prompt tokens get the same id (numbered by first appearance)."""
    ids: dict[tuple[int, ...], int] = {}
    rows = input_ids.cpu().tolist()
    return [ids.setdefault(tuple(row[:p]), len(ids)) for row, p in zip(rows, prompt_lens.cpu().tolist())]


@dataclass(frozen=True)
class MicroBatchPlanner:
    """Splits the rows of an optimizer step into micro-batches of units.

    keys: prompt id per row [N] (``prompt_keys``); prompt_lens, seq_lens: tokens per row [N].
    share: rows with the same prompt form one unit (its prompt computed once), else one row per unit.
    max_sequences: most rows per micro-batch when ``max_tokens`` is None.
    max_tokens: most padded token positions per micro-batch (a unit longer than that goes alone).
    """

    keys: list[int]
    prompt_lens: list[int]
    seq_lens: list[int]
    share: bool
    max_sequences: int
    max_tokens: int | None = None

    def cost(self, unit: list[int]) -> int:
        """Token positions of one unit: the prompt once plus every completion (the sequence unshared)."""
        if len(unit) == 1:
            return self.seq_lens[unit[0]]
        return self.prompt_lens[unit[0]] + sum(self.seq_lens[r] - self.prompt_lens[r] for r in unit)

    def _fits(self, rows: int, tokens: int) -> bool:
        return tokens <= self.max_tokens if self.max_tokens is not None else rows <= self.max_sequences

    def units(self, rows: list[int]) -> list[list[int]]:
        """Rows grouped by prompt (longest first), each group cut where it would exceed the limits."""
        if not self.share:
            return [[r] for r in rows]
        groups: dict[int, list[int]] = {}
        for r in rows:
            groups.setdefault(self.keys[r], []).append(r)
        units = []
        for group in groups.values():
            unit: list[int] = []
            for r in sorted(group, key=lambda r: -self.seq_lens[r]):
                if unit and not self._fits(len(unit) + 1, self.cost(unit + [r])):
                    units.append(unit)
                    unit = []
                unit.append(r)
            units.append(unit)
        return units

    def plan(self, rows: Tensor) -> list[Tensor]:
        """Index tensors (on the device of ``rows``) of the micro-batches, each the concatenation of its units.

        Without sharing and without a token budget: consecutive slices of ``max_sequences`` rows, in
        order. Otherwise units are sorted by cost, longest first, and each micro-batch takes units while
        ``units x longest <= max_tokens`` (or its rows stay within ``max_sequences``).
        """
        if not self.share and self.max_tokens is None:
            return list(rows.split(self.max_sequences))
        units = sorted(self.units(rows.tolist()), key=lambda u: -self.cost(u))
        micro_batches: list[list[list[int]]] = []
        for unit in units:
            current = micro_batches[-1] if micro_batches else None
            if current is not None:
                longest = self.cost(current[0])  # sorted: the first unit is the longest
                n_rows = sum(map(len, current)) + len(unit)
                if self._fits(n_rows, longest * (len(current) + 1)):
                    current.append(unit)
                    continue
            micro_batches.append([unit])
        return [torch.tensor([r for u in mb for r in u], dtype=torch.long, device=rows.device) for mb in micro_batches]

    def runs(self, rows: list[int]) -> list[list[int]]:
        """The units of one planned micro-batch: its runs of consecutive rows with the same prompt
        (one row each without sharing)."""
        if not self.share:
            return [[r] for r in rows]
        out: list[list[int]] = []
        for r in rows:
            if out and self.keys[out[-1][-1]] == self.keys[r]:
                out[-1].append(r)
            else:
                out.append([r])
        return out
