"""Sampling from a transformers causal LM, one token a step over its KV cache, finished rows dropped.

``decode`` is the hf engine's generation loop. Each step runs the model's own forward (``model(...)``
with ``logits_to_keep=1``: the family's logit transforms included, and under FSDP the forward that
gathers the weights) on the rows still generating, then ``sample_step`` draws one token per row. A
row ends at an EOS id, at a stop string, or at ``max_new_tokens``, and leaves the batch (its cache rows
too), so that the rest stop paying for it. ``model.generate`` instead keeps every row to the end and
samples with ``torch.multinomial``, whose exponential draws over the vocabulary cost as much as a tenth
of a step on a 49k vocabulary.
Row r's t-th token is drawn with ``grpolab.rollout.hf.draws.uniforms(seed, first_row + r, t)``, a function of
those integers alone, so a row's tokens do not depend on the other rows, on when they end or leave, or on
the batch it is decoded in.

Refill (``waiting``): rows of the call that did not fit the first batch join it as rows end. Their prompts are
prefilled but for the last column (``Waiting.take``), their cache rows join the running cache, left-padded to
its width (``grpolab.rollout.hf.kv_cache.join_rows``; columns that are padding in every running row are dropped
first), and their last prompt column is computed in the next step's forward together with the running rows'
sampled tokens: one forward a step, whatever joined.

Positions are those ``generate`` computes for left-padded rows (the count of real tokens before each
column), so the tokens and the recorded log-probs are those the trainer's forward scores.

``synced`` (ranks whose forwards are collectives, FSDP): every rank keeps stepping, a finished row idle
in its batch when it has no live row left, until every rank's rows have ended (one all-reduce a step),
as ``generate(synced_gpus=True)`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import Cache, TopKLogitsWarper, TopPLogitsWarper

from grpolab.rollout.hf.draws import uniforms
from grpolab.rollout.hf.kv_cache import join_rows, reserved_cache

__all__ = ["Decoded", "Waiting", "compaction", "decode", "left_padded_positions", "sample_step", "sequence_places"]


def sample_step(
    logits: Tensor, uniform: Tensor | None, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> tuple[Tensor, Tensor]:
    """One token per row, and its log-prob under ``softmax(logits / temperature)``.

    logits: [A, V] float32 (divided by the temperature in place when it is not 1).
    uniform: [A] float64 draws in [0, 1), one per row; unused (may be None) when greedy.
    temperature: 0 = greedy (argmax; the log-prob at temperature 1).
    top_k, top_p: truncation of the sampling distribution (transformers' warpers, top-k then top-p),
        never of the returned log-prob (pass@k evaluation only: training refuses them, its samples must
        come from the policy whose log-probs it scores).
    Returns (tokens LongTensor[A], logprobs FloatTensor[A]).

    Sampling is by inverse CDF: row a takes the first token whose float64 cumulative probability exceeds
    ``uniform[a]`` times the row's total, exact to float64 rounding; each row's token depends on its own
    logits and draw alone.
    """
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1)
    if temperature != 1.0:
        logits.div_(temperature)
    logp = torch.log_softmax(logits, -1)  # [A, V]
    if top_k > 0 or top_p < 1.0:
        warped = logits
        if top_k > 0:
            warped = TopKLogitsWarper(top_k=top_k)(None, warped)
        if top_p < 1.0:
            warped = TopPLogitsWarper(top_p=top_p)(None, warped)
        probs = torch.softmax(warped, -1)
    else:
        probs = logp.exp()
    cdf = probs.double().cumsum_(-1)  # [A, V]
    tokens = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:], right=True).squeeze(1)
    tokens.clamp_(max=cdf.shape[1] - 1)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


@dataclass
class Decoded:
    """What ``decode`` generated, per row of its batch.

    tokens: each row's tokens, ending with the token that stopped it (EOS id or a stop string's last).
    logprobs: the log-prob of each of those tokens (see ``sample_step``).
    stopped: True where a row stopped (EOS or stop string), False where it reached ``max_new_tokens``.
    step_rows: the live rows each forward computed (the first: the prefill's last column), e.g. to see that
        refill keeps the batch full.
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    stopped: list[bool]
    step_rows: list[int] = field(default_factory=list)


class _StopStrings:
    """Whether a row's generated text holds a stop string, decoding only a tail window long enough to hold
    any of them (a token decodes to at least one character; 4 tokens a character covers byte-level BPE)."""

    def __init__(self, stop_strings: Sequence[str], decode_ids: Callable[[list[int]], str]):
        self.stop_strings, self.decode_ids = tuple(stop_strings), decode_ids
        self.window = 4 * max(len(s) for s in self.stop_strings) + 8

    def __call__(self, generated: list[int]) -> bool:
        text = self.decode_ids(generated[-self.window :])
        return any(s in text for s in self.stop_strings)


def left_padded_positions(attention_mask: Tensor) -> Tensor:
    """[B, P] mask of left-padded rows -> [B, P] position ids: each column's count of real tokens before
    it (1 on the padding, as ``generate`` sets it)."""
    return (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)


def sequence_places(attention_mask: Tensor, positions: Tensor) -> Tensor:
    """[A, C] the place of each column's token in its row's sequence (its position id), -1 on padding."""
    return positions.masked_fill(attention_mask == 0, -1)


def _forward(model: nn.Module, ids: Tensor, mask: Tensor, positions: Tensor, cache: Cache) -> Tensor:
    """The model's own forward over ``ids`` [A, C] with the cache; the last column's logits [A, V] float32."""
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1].float()


class Waiting(Protocol):
    """Rows of a call waiting to join the decoding batch (``decode``'s refill), in row order."""

    def __len__(self) -> int:
        """How many rows still wait."""
        ...

    def take(self, count: int) -> tuple[Tensor, Tensor, Cache | None]:
        """The next ``count`` rows: left-padded input ids and attention mask [count, W] (on the batch's device),
        and their cache over all columns but the last (``grpolab.rollout.hf.prefill.shared_prefill``), None
        where W = 1."""
        ...


def decode(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    *,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    top_p: float,
    eos_token_ids: Sequence[int],
    cache: Cache | None = None,
    stop_strings: Sequence[str] = (),
    decode_ids: Callable[[list[int]], str] | None = None,
    synced: bool = False,
    drop_fraction: float = 0.0,
    on_forward: Callable[[list[int], Tensor], None] | None = None,
    seed: int | None = None,
    first_row: int | Sequence[int] = 0,
    waiting: Waiting | None = None,
    max_rows: int | None = None,
    refill_at: int = 1,
) -> Decoded:
    """Sample up to ``max_new_tokens`` tokens for each left-padded row of ``input_ids`` [B, P], and for each row
    ``waiting`` holds, which joins the batch as rows end.

    attention_mask: [B, P], 0 on the left padding.
    cache: the rows' cache over all but the last prompt column (a shared prefill), or None to prefill here
        (into a ``grpolab.rollout.hf.kv_cache.reserved_cache`` with room for the whole generation).
    eos_token_ids: ids that end a row (kept as its last token).
    stop_strings, decode_ids: strings that end a row once its generated text holds one; the token decoder.
    drop_fraction: ended rows leave the batch once they are more than this share of the rows computed
        (0: at every step where a row ends; a reserved cache then copies only the rows that move, see
        ``compaction``).
    on_forward: told before each forward the rows it computes and each token's place in its row's
        sequence [A, C] (its position id; -1 on padding), e.g. to record an MoE model's routing.
    seed, first_row: row r's t-th token is sampled with ``grpolab.rollout.hf.draws.uniforms(seed, first_row + r,
        t)`` (``first_row[r]`` where it is a sequence: each row's global index); seed None: one drawn from torch's
        global RNG.
    waiting: rows B, B + 1, ... (refill; not with ``synced``). Once ``max_rows`` (default B) less the live rows
        leaves ``refill_at`` free places (or room for every row still waiting), the ended rows leave, the next
        waiting rows join (``Waiting.take``, ``grpolab.rollout.hf.kv_cache.join_rows``), and their prompts' last
        column is computed in the same forward as the other rows' next token.
    Returns every row's completion, the ``waiting`` rows' after the first B.
    """
    device, batch = input_ids.device, input_ids.shape[0]
    if waiting is not None and synced:
        raise ValueError("refill (waiting rows) cannot run synced: a rank's extra prefill would be a lone collective")
    eos = torch.tensor(sorted(set(eos_token_ids)), device=device)
    stops = _StopStrings(stop_strings, decode_ids) if stop_strings else None
    if seed is None and temperature != 0:
        seed = int(torch.empty((), dtype=torch.int64).random_())
    global_row = (lambda r: first_row + r) if isinstance(first_row, int) else first_row.__getitem__
    max_rows = max_rows or batch
    positions = left_padded_positions(attention_mask)
    announce = on_forward or (lambda rows, places: None)
    if cache is None:
        cache = reserved_cache(model.config, input_ids.shape[1] + max_new_tokens)
        announce(list(range(batch)), sequence_places(attention_mask, positions))
        logits = _forward(model, input_ids, attention_mask, positions, cache)
    else:
        announce(list(range(batch)), sequence_places(attention_mask[:, -1:], positions[:, -1:]))
        logits = _forward(model, input_ids[:, -1:], attention_mask, positions[:, -1:], cache)
    total = batch + (len(waiting) if waiting is not None else 0)
    rows = list(range(batch))  # the call row of each row computed
    live = [True] * batch  # per row computed: it has not ended
    last_position = positions[:, -1]
    tokens: list[list[int]] = [[] for _ in range(total)]
    logprobs: list[list[float]] = [[] for _ in range(total)]
    stopped = [False] * total
    step_rows = [batch]
    while True:
        draws = None
        if temperature != 0:
            draws = uniforms(seed, [global_row(row) for row in rows], [len(tokens[row]) for row in rows], device)
        new, logp = sample_step(logits, draws, temperature, top_k, top_p)
        for i, (token, lp, at_eos) in enumerate(zip(new.tolist(), logp.tolist(), torch.isin(new, eos).tolist())):
            if live[i]:
                row = rows[i]
                tokens[row].append(token)
                logprobs[row].append(lp)
                stopped[row] = at_eos or (stops is not None and stops(tokens[row]))
                live[i] = not stopped[row] and len(tokens[row]) < max_new_tokens
        left = len(waiting) if waiting is not None else 0
        refill = bool(left) and max_rows - live.count(True) >= min(refill_at, left)
        if not _any_live(any(live) or refill, synced, device):
            break
        keep = None
        if refill:
            keep = compaction(live) if any(live) else []
        elif len(rows) > 1 and live.count(False) > drop_fraction * len(rows):
            keep = compaction(live)
        if keep is not None and keep != list(range(len(rows))):
            index = torch.tensor(keep, dtype=torch.long, device=device)
            cache.batch_select_indices(index)
            attention_mask, last_position, new = attention_mask[index], last_position[index], new[index]
            rows, live = [rows[i] for i in keep], [live[i] for i in keep]
        if refill:
            count = min(left, max_rows - len(rows))
            ids, mask, joining = waiting.take(count)
            real = attention_mask.any(0).nonzero()
            trim = int(real[0]) if len(real) else attention_mask.shape[1]
            width = join_rows(cache, joining, count, trim, max_new_tokens + 1)
            attention_mask = torch.cat(
                [_left_pad(attention_mask[:, trim:], width), _left_pad(mask[:, :-1], width)], dim=0
            )
            last_position = torch.cat([last_position, left_padded_positions(mask)[:, -1] - 1])
            new = torch.cat([new, ids[:, -1]])
            rows += range(total - left, total - left + count)
            live += [True] * count
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
        last_position = last_position + 1
        announce(rows, last_position[:, None])
        step_rows.append(live.count(True))
        logits = _forward(model, new[:, None], attention_mask, last_position[:, None], cache)
    return Decoded(tokens, logprobs, stopped, step_rows)


def _left_pad(mask: Tensor, width: int) -> Tensor:
    """[R, w] attention mask -> [R, width] with zeros at the left (width >= w)."""
    return torch.cat([mask.new_zeros(mask.shape[0], width - mask.shape[1]), mask], dim=1)


def compaction(live: list[bool]) -> list[int]:
    """The rows to keep of a batch whose rows are ``live`` or ended, in the order that moves fewest of them:
    with k live rows, each live row among the first k stays in place and the live rows past k fill the ended
    rows' places (``grpolab.rollout.hf.kv_cache`` then copies only those). No live row (synced): row 0 stays,
    idle."""
    k = max(sum(live), 1)
    tail = [i for i in range(k, len(live)) if live[i]]
    return [i if live[i] or not tail else tail.pop() for i in range(k)]


def _any_live(here: bool, synced: bool, device: torch.device) -> bool:
    """Whether a row here (``synced``: on any rank) still generates."""
    if not synced:
        return here
    flag = torch.tensor([float(here)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())
