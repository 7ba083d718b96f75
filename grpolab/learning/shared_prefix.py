"""Training log-probs with each prompt computed once for all the completions that share it.

A unit (``grpolab.learning.packing``) is a prompt and the batch rows that continue it. Shared, a micro-batch
takes two backbone passes with transformers' own key/value cache:
  1. the units' prompts [U, P] (right-padded), filling a ``DynamicCache``;
  2. the cache rows repeated for each completion (an index select, so autograd carries the gradient of
     all k completions back into the prompt's computation), then the completions [n, C] with the
     position ids they have after their prompt (``p, p+1, ...``) and a padding mask over prompt and
     completion.
Each completion token so sees exactly its own prompt and earlier tokens: the log-probs of the
unshared rows, while the prompt's layers run once per unit instead of once per row (PrefixGrouper's
saving in verl, without changing attention). Unshared, each row is one right-padded sequence.

Either way the output layer runs on completion tokens only: the prompt's predictions are never in a
loss. Sharing is exact only for some models (``grpolab.models.fidelity.forward_fidelity``: not with
sliding-window or non-attention layers, nor under gradient checkpointing, which drops the cache inside
checkpointed layers); the caller decides.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from grpolab.models.logprobs import TokenStats, backbone_and_head, head_chunk

__all__ = ["UnitLayout", "layout_units", "unit_logprobs"]


@dataclass
class UnitLayout:
    """The tensors of one micro-batch's forward.

    first_ids, first_mask, first_pos: LongTensor[A, P] pass 1: the units' prompts (shared) or the rows'
        whole sequences (unshared), right-padded.
    unit_of_row: LongTensor[n] the unit of each row (shared), else None.
    comp_ids, comp_mask, comp_pos: LongTensor[n, C] pass 2: the completions (shared), else None.
    source: LongTensor[M] index into the flattened hidden states of pass 1 then pass 2 of the state that
        predicts each of the M completion tokens; target: LongTensor[M] the token; out_row, out_col:
        LongTensor[M] its place in the [n, T] output (row in unit order, column of the batch).
    """

    first_ids: Tensor
    first_mask: Tensor
    first_pos: Tensor
    source: Tensor
    target: Tensor
    out_row: Tensor
    out_col: Tensor
    unit_of_row: Tensor | None = None
    comp_ids: Tensor | None = None
    comp_mask: Tensor | None = None
    comp_pos: Tensor | None = None
    first_completion: Tensor | None = None  # BoolTensor[A, P] unshared: the completion tokens of pass 1
    first_rows: Tensor | None = None  # LongTensor[A] the batch row of each pass-1 sequence (a unit's first)
    comp_rows: Tensor | None = None  # LongTensor[n] the batch row of each completion (shared)

    def token_places(self) -> list[tuple[Tensor, Tensor, Tensor]]:
        """(row, column, real) LongTensor, LongTensor, BoolTensor [tokens] of each backbone pass's tokens,
        flattened as its layers see them: where in the batch [N, T] each token is (a shared prompt's token at
        its unit's first row), and whether it is a real token (not padding)."""
        passes = [(self.first_rows, self.first_pos, self.first_mask)]
        if self.comp_ids is not None:
            passes.append((self.comp_rows, self.comp_pos, self.comp_mask))
        return [
            (rows.unsqueeze(1).expand_as(pos).flatten(), pos.flatten(), mask.flatten().bool())
            for rows, pos, mask in passes
        ]

    def completion_masks(self) -> list[Tensor]:
        """BoolTensor[A * P] (and [n * C]): the completion tokens of each backbone pass, flattened as its layers
        see them (where an MoE router's choices are counted: the same tokens shared or not)."""
        if self.comp_mask is None:
            return [self.first_completion.flatten()]
        return [torch.zeros_like(self.first_mask, dtype=torch.bool).flatten(), self.comp_mask.flatten().bool()]


def _right_padded(input_ids: Tensor, rows: list[int], starts: list[int], lengths: list[int]):
    """Tokens ``input_ids[row, start:start+length]`` of each row, right-padded to the longest ->
    (ids, mask, position ids = their columns), LongTensor[len(rows), max(lengths)] each. Padding takes
    column and position 0: a forward's longest position is a real token's (some rope types choose their
    frequencies by it)."""
    j = torch.arange(max(max(lengths), 1))
    mask = j < torch.tensor(lengths).unsqueeze(1)  # [R, W]
    positions = torch.where(mask, torch.tensor(starts).unsqueeze(1) + j, 0)
    device = input_ids.device
    ids = input_ids[torch.tensor(rows, device=device).unsqueeze(1), positions.to(device)]
    return ids, mask.long().to(device), positions.to(device)


def layout_units(
    input_ids: Tensor, prompt_lens: list[int], seq_lens: list[int], units: list[list[int]], shared: bool
) -> UnitLayout:
    """Lay out ``units`` (row indices into the right-padded ``input_ids`` [N, T]; the rows of a unit share
    their prompt) for ``unit_logprobs``; ``shared=False`` takes every row as a whole sequence."""
    rows = [r for unit in units for r in unit]
    comp = [seq_lens[r] - prompt_lens[r] for r in rows]
    out_row = [i for i, c in enumerate(comp) for _ in range(c)]
    out_col = [prompt_lens[r] + t for r, c in zip(rows, comp) for t in range(c)]
    device = input_ids.device
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    target = input_ids[as_long([rows[i] for i in out_row]), as_long(out_col)]
    if not shared:
        ids, mask, pos = _right_padded(input_ids, rows, [0] * len(rows), [seq_lens[r] for r in rows])
        width = ids.shape[1]
        source = [i * width + col - 1 for i, col in zip(out_row, out_col)]
        extra = {
            "first_completion": mask.bool() & (pos >= as_long([prompt_lens[r] for r in rows]).unsqueeze(1)),
            "first_rows": as_long(rows),
        }
    else:
        firsts = [unit[0] for unit in units]
        ids, mask, pos = _right_padded(input_ids, firsts, [0] * len(units), [prompt_lens[r] for r in firsts])
        unit_of_row = [u for u, unit in enumerate(units) for _ in unit]
        c_ids, c_mask, c_pos = _right_padded(input_ids, rows, [prompt_lens[r] for r in rows], comp)
        width, c_width, after = ids.shape[1], c_ids.shape[1], ids.numel()
        # token t of row i's completion: predicted by its prompt's last state (t = 0) or by completion token t - 1
        source = [
            unit_of_row[i] * width + prompt_lens[rows[i]] - 1
            if col == prompt_lens[rows[i]]
            else after + i * c_width + col - prompt_lens[rows[i]] - 1
            for i, col in zip(out_row, out_col)
        ]
        extra = dict(
            unit_of_row=as_long(unit_of_row),
            comp_ids=c_ids,
            comp_mask=c_mask,
            comp_pos=c_pos,
            first_rows=as_long(firsts),
            comp_rows=as_long(rows),
        )
    return UnitLayout(
        first_ids=ids,
        first_mask=mask,
        first_pos=pos,
        source=as_long(source),
        target=target,
        out_row=as_long(out_row),
        out_col=as_long(out_col),
        **extra,
    )


def _backbone_hidden(model: nn.Module, layout: UnitLayout) -> Tensor:
    """Hidden states [A * P (+ n * C), H] of pass 1 (and pass 2), flattened in that order."""
    backbone, _ = backbone_and_head(model)
    if layout.comp_ids is None:
        out = backbone(
            input_ids=layout.first_ids,
            attention_mask=layout.first_mask,
            position_ids=layout.first_pos,
            use_cache=False,
            return_dict=True,
        )
        return out.last_hidden_state.flatten(0, 1)
    cache = DynamicCache(config=model.config)
    first = backbone(
        input_ids=layout.first_ids,
        attention_mask=layout.first_mask,
        position_ids=layout.first_pos,
        past_key_values=cache,
        use_cache=True,
        return_dict=True,
    ).last_hidden_state
    cache.batch_select_indices(layout.unit_of_row)  # [U, ...] -> [n, ...], differentiable
    mask = torch.cat([layout.first_mask[layout.unit_of_row], layout.comp_mask], dim=1)  # [n, P + C]
    second = backbone(
        input_ids=layout.comp_ids,
        attention_mask=mask,
        position_ids=layout.comp_pos,
        past_key_values=cache,
        use_cache=True,
        return_dict=True,
    ).last_hidden_state
    return torch.cat([first.flatten(0, 1), second.flatten(0, 1)])


def unit_logprobs(
    model: nn.Module,
    layout: UnitLayout,
    n_rows: int,
    width: int,
    *,
    temperature: float = 1.0,
    chunk_tokens: int = 2048,
    with_entropy: bool = False,
) -> TokenStats:
    """Log-probs (and entropies) of every completion token of ``layout``, as float32 [n_rows, width] in
    the convention of ``grpolab.models.logprobs.token_logprobs`` (0 on prompt and padding columns).

    The output layer runs on ``chunk_tokens`` tokens at a time, each chunk checkpointed when grad is on,
    so no more than [chunk_tokens, vocab] logits exist at once. It runs at least once (on no token when
    the completions are empty), so that the result is in the graph of every parameter.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _, head = backbone_and_head(model)
    hidden = _backbone_hidden(model, layout).index_select(0, layout.source)  # [M, H]
    lp_chunks, ent_chunks = [], []
    for start in range(0, max(hidden.shape[0], 1), chunk_tokens):
        h = hidden[start : start + chunk_tokens].unsqueeze(0)  # [1, c, H]
        tgt = layout.target[start : start + chunk_tokens].unsqueeze(0)
        lp, ent = head_chunk(head, h, tgt, temperature, with_entropy)
        lp_chunks.append(lp.flatten())
        ent_chunks.append(ent.flatten())

    def scatter(values: list[Tensor]) -> Tensor:
        flat = torch.cat(values)
        return flat.new_zeros(n_rows, width).index_put((layout.out_row, layout.out_col), flat)

    return TokenStats(logprobs=scatter(lp_chunks), entropy=scatter(ent_chunks) if with_entropy else None)
