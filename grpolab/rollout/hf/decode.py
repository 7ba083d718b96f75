"""Sampling from a transformers causal LM, one token a step over its KV cache, finished rows dropped.

``decode`` is the hf engine's generation loop. Each step runs the model's own forward (``model(...)``
with ``logits_to_keep=1``: the family's logit transforms included, and under FSDP the forward that
gathers the weights) on the rows still generating, then ``sample_step`` draws one token per row. A
row ends at an EOS id, at a stop string, or at ``max_new_tokens``, and leaves the batch (its cache rows
too), so that the rest stop paying for it. ``model.generate`` instead keeps every row to the end and
samples with ``torch.multinomial``, whose exponential draws over the vocabulary cost as much as a tenth
of a step on a 49k vocabulary.
Each step draws one uniform for every row of the batch, live or not, so a row's tokens do not depend on
when the other rows end or leave.

Positions are those ``generate`` computes for left-padded rows (the count of real tokens before each
column), so the tokens and the recorded log-probs are those the trainer's forward scores.

``synced`` (ranks whose forwards are collectives, FSDP): every rank keeps stepping, a finished row idle
in its batch when it has no live row left, until every rank's rows have ended (one all-reduce a step),
as ``generate(synced_gpus=True)`` does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from transformers import Cache, TopKLogitsWarper, TopPLogitsWarper

from grpolab.rollout.hf.kv_cache import reserved_cache

__all__ = ["Decoded", "compaction", "decode", "left_padded_positions", "sample_step", "sequence_places"]


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
    """

    tokens: list[list[int]]
    logprobs: list[list[float]]
    stopped: list[bool]


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
) -> Decoded:
    """Sample up to ``max_new_tokens`` tokens for each left-padded row of ``input_ids`` [B, P].

    attention_mask: [B, P], 0 on the left padding.
    cache: the rows' cache over all but the last prompt column (a shared prefill), or None to prefill here
        (into a ``grpolab.rollout.hf.kv_cache.reserved_cache`` with room for the whole generation).
    eos_token_ids: ids that end a row (kept as its last token).
    stop_strings, decode_ids: strings that end a row once its generated text holds one; the token decoder.
    drop_fraction: ended rows leave the batch once they are more than this share of the rows computed
        (0: at every step where a row ends; a reserved cache then copies only the rows that move, see
        ``compaction``).
    on_forward: told before each forward the batch rows it computes and each token's place in its row's
        sequence [A, C] (its position id; -1 on padding), e.g. to record an MoE model's routing.
    """
    device, batch = input_ids.device, input_ids.shape[0]
    eos = torch.tensor(sorted(set(eos_token_ids)), device=device)
    stops = _StopStrings(stop_strings, decode_ids) if stop_strings else None
    positions = left_padded_positions(attention_mask)
    announce = on_forward or (lambda rows, places: None)
    if cache is None:
        cache = reserved_cache(model.config, input_ids.shape[1] + max_new_tokens)
        announce(list(range(batch)), sequence_places(attention_mask, positions))
        logits = _forward(model, input_ids, attention_mask, positions, cache)
    else:
        announce(list(range(batch)), sequence_places(attention_mask[:, -1:], positions[:, -1:]))
        logits = _forward(model, input_ids[:, -1:], attention_mask, positions[:, -1:], cache)
    rows = list(range(batch))  # the batch row of each row computed
    row_index = torch.arange(batch, device=device)  # the same, as a tensor
    live = [True] * batch  # per row computed: it has not ended
    last_position = positions[:, -1]
    tokens: list[list[int]] = [[] for _ in range(batch)]
    logprobs: list[list[float]] = [[] for _ in range(batch)]
    stopped = [False] * batch
    for step in range(max_new_tokens):
        draws = None if temperature == 0 else torch.rand(batch, dtype=torch.float64, device=device)
        new, logp = sample_step(logits, None if draws is None else draws[row_index], temperature, top_k, top_p)
        for i, (token, lp, at_eos) in enumerate(zip(new.tolist(), logp.tolist(), torch.isin(new, eos).tolist())):
            if live[i]:
                row = rows[i]
                tokens[row].append(token)
                logprobs[row].append(lp)
                stopped[row] = at_eos or (stops is not None and stops(tokens[row]))
                live[i] = not stopped[row]
        if step == max_new_tokens - 1 or not _any_live(any(live), synced, device):
            break
        if len(rows) > 1 and live.count(False) > drop_fraction * len(rows):
            keep = compaction(live)
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            attention_mask, last_position, new = attention_mask[index], last_position[index], new[index]
            rows, live, row_index = [rows[i] for i in keep], [live[i] for i in keep], row_index[index]
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(len(rows), 1)], dim=1)
        last_position = last_position + 1
        announce(rows, last_position[:, None])
        logits = _forward(model, new[:, None], attention_mask, last_position[:, None], cache)
    return Decoded(tokens, logprobs, stopped)


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
