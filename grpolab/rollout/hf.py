"""Rollout engine on the training model itself, with transformers ``model.generate``.

Sampling is fully specified here and never inherits from ``model.generation_config`` (a
checkpoint's ``generation_config.json`` may carry top_k=20, repetition penalties, ...): during
a call the model's generation config is swapped for a blank one and every sampling knob is
passed explicitly. Temperature / top-k / top-p are applied by transformers' own warpers, in
that order, after a recorder that keeps the log-prob of each sampled token under
``softmax(logits / temperature)`` (see ``grpolab.rollout.base`` for the convention). The
recorder holds one ``[B, vocab]`` step at a time, never the logits of the whole generation.

Shared prefill: the rows of a batch that repeat a prompt (its ``n`` samples) get its prefill once: the
backbone runs over the distinct prompts (all but their last token), transformers' ``DynamicCache`` rows
are repeated for each sample (``batch_select_indices``), and ``generate`` continues from that cache
with the position ids it would have computed itself, so only the prompts' last tokens are prefilled
per row.

Seeding: every batch seeds torch's RNG from ``params.seed`` and the global index of its first row
(``params.prompt_offset * n`` plus its position in the call; a call's first batch at offset 0 takes the
seed itself), inside ``torch.random.fork_rng``, so the caller's global RNG stream is left untouched.
Results for a seed depend on the batch's rows (prompts, ``n``, ``max_batch_size``): a rank whose share
starts on a batch boundary of the whole list samples exactly what one process samples for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence

import torch
from torch import Tensor, nn
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from grpolab.logprobs import backbone_and_head
from grpolab.rollout.base import (
    Completion,
    FinishReason,
    SamplingParams,
    collect_eos_ids,
)

__all__ = ["HFEngine", "trim_completion"]


class _LogprobRecorder(LogitsProcessor):
    """Records log p(sampled token) under softmax(raw_logits / temperature), per row and step.

    Called with the raw logits of step ``s`` (input length ``prompt_len + s``); the token
    sampled at step ``s`` is only known at the next call (or in ``finalize``).
    """

    def __init__(self, prompt_len: int, temperature: float, batch: int, max_new: int, device):
        self.prompt_len = prompt_len
        self.temperature = temperature
        self.out = torch.zeros(batch, max_new, dtype=torch.float32, device=device)  # [B, S]
        self._prev: Tensor | None = None  # [B, V] log-probs of the previous step
        self._prev_step = -1

    def _record(self, step: int, tokens: Tensor) -> None:
        if self._prev is not None and self._prev_step == step and step < self.out.shape[1]:
            self.out[:, step] = self._prev.gather(1, tokens.view(-1, 1)).squeeze(1)

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        step = input_ids.shape[1] - self.prompt_len
        if step > 0:
            self._record(step - 1, input_ids[:, -1])
        self._prev = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        self._prev_step = step
        return scores

    def finalize(self, sequences: Tensor) -> Tensor:
        """sequences: [B, P + S] -> FloatTensor[B, S] of sampled-token log-probs."""
        steps = sequences.shape[1] - self.prompt_len
        if steps > 0:
            self._record(steps - 1, sequences[:, -1])
        self._prev = None
        return self.out[:, :steps]


class _StopStringCriteria(StoppingCriteria):
    """Stops a row once its generated text contains a stop string; records where.

    Only generated tokens (columns >= prompt_len) are decoded, and only a tail window long
    enough to hold any stop string (a token decodes to at least one character; 4 tokens per
    character covers byte-level BPE).
    """

    def __init__(self, stop_strings: Sequence[str], decode: Callable[[list[int]], str],
                 prompt_len: int, batch: int):
        self.stop_strings = tuple(stop_strings)
        self.decode = decode
        self.prompt_len = prompt_len
        self.window = 4 * max(len(s) for s in self.stop_strings) + 8
        self.fired_at: list[int | None] = [None] * batch  # completion index of the stop token

    def __call__(self, input_ids: Tensor, scores: Tensor | None = None, **kwargs) -> Tensor:
        length = input_ids.shape[1]
        start = max(self.prompt_len, length - self.window)
        hits = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for row, ids in enumerate(input_ids[:, start:].tolist()):
            if self.fired_at[row] is not None:
                hits[row] = True
                continue
            text = self.decode(ids)
            if any(s in text for s in self.stop_strings):
                self.fired_at[row] = length - self.prompt_len - 1
                hits[row] = True
        return hits


def batch_seed(seed: int, first_row: int) -> int:
    """The seed of a generation batch whose first row has global index ``first_row`` (``seed`` itself at 0)."""
    return seed if first_row == 0 else (seed * 1_000_003 + first_row * 7_919) % 2**63


def trim_completion(
    tokens: Sequence[int], eos_ids: Iterable[int], stop_index: int | None = None
) -> tuple[list[int], FinishReason]:
    """Cut a raw generated row at its first stopping event.

    tokens: the generated tokens of one row (may be followed by padding).
    eos_ids: token ids that end generation; the first one is kept in the completion.
    stop_index: index of the token that completed a stop string, if any.
    Returns (completion tokens, finish_reason); "length" when nothing stopped the row.
    """
    eos = set(eos_ids)
    cut = next((i for i, t in enumerate(tokens) if t in eos), None)
    if stop_index is not None and (cut is None or stop_index < cut):
        cut = stop_index
    if cut is None:
        return list(tokens), "length"
    return list(tokens[: cut + 1]), "stop"


class HFEngine:
    """``RolloutEngine`` that samples from the (training) model with ``model.generate``.

    model: a transformers causal LM; generation runs in eval mode under ``torch.no_grad`` and
        the train/eval mode is restored afterwards.
    tokenizer: its tokenizer (decoding, EOS and pad ids).
    max_batch_size: most sequences (prompts x n) generated together.
    eos_token_ids: ids that end generation; default: the tokenizer's EOS plus the EOS ids of
        ``model.generation_config``.
    compute_context: a factory of the context generation runs in (the trainer's bf16 autocast
        when its weights are float32 masters), so that sampling and training forwards agree.
    shared_prefill: prefill each distinct prompt of a batch once (see the module docstring).
    synced: the model's forwards are collectives over data-parallel ranks (FSDP): transformers keeps
        decoding, with finished rows idle, until every rank's batch is done (``synced_gpus``).
    """

    def __init__(self, model: nn.Module, tokenizer, max_batch_size: int = 64,
                 eos_token_ids: Sequence[int] | None = None,
                 compute_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 shared_prefill: bool = True, synced: bool = False):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.compute_context = compute_context
        self.shared_prefill, self.synced = shared_prefill, synced
        self.eos_token_ids = list(eos_token_ids) if eos_token_ids is not None else collect_eos_ids(
            tokenizer, getattr(getattr(model, "generation_config", None), "eos_token_id", None))
        if not self.eos_token_ids:
            raise ValueError("no EOS token id: pass eos_token_ids")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else self.eos_token_ids[0]

    def sync_weights(self, model: nn.Module) -> None:
        """No-op for the model it was built with (it samples from the training model itself);
        given another model object, generates with that one from now on."""
        self.model = model

    def close(self) -> None:
        pass

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """``n`` completions per prompt, ``[len(prompts)][n]``, prompt order kept."""
        if n < 1:
            raise ValueError("n must be >= 1")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        flat = [list(p) for p in prompts for _ in range(n)]
        model = self.model
        was_training = model.training
        saved_config = model.generation_config
        device = next(model.parameters()).device
        out: list[Completion] = []
        try:
            model.eval()
            model.generation_config = GenerationConfig()  # inherit nothing from the checkpoint
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.no_grad())
                stack.enter_context(self.compute_context())
                if params.seed is not None:
                    stack.enter_context(torch.random.fork_rng(devices=[device] if device.type == "cuda" else []))
                for i in range(0, len(flat), self.max_batch_size):
                    if params.seed is not None:
                        torch.manual_seed(batch_seed(params.seed, params.prompt_offset * n + i))
                    out.extend(self._generate_batch(flat[i : i + self.max_batch_size], params, device))
        finally:
            model.generation_config = saved_config
            model.train(was_training)
        return [out[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _warpers(self, params: SamplingParams) -> list[LogitsProcessor]:
        if params.greedy:
            return []
        warpers: list[LogitsProcessor] = []
        if params.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(params.temperature))
        if params.top_k > 0:
            warpers.append(TopKLogitsWarper(top_k=params.top_k))
        if params.top_p < 1.0:
            warpers.append(TopPLogitsWarper(top_p=params.top_p))
        return warpers

    def _prefill(self, prompts: list[list[int]], input_ids: Tensor, attention_mask: Tensor) -> DynamicCache | None:
        """The cache of every row's left-padded prompt but its last column, each distinct prompt computed
        once; None when no prompt repeats (``generate`` prefills as usual)."""
        distinct: dict[tuple[int, ...], int] = {}
        row_of = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]
        if not self.shared_prefill or len(distinct) == len(prompts) or input_ids.shape[1] < 2:
            return None
        firsts = torch.tensor([row_of.index(u) for u in range(len(distinct))], device=input_ids.device)
        ids, mask = input_ids[firsts, :-1], attention_mask[firsts, :-1]
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # as generate computes them
        cache = DynamicCache(config=self.model.config)
        backbone_and_head(self.model)[0](input_ids=ids, attention_mask=mask, position_ids=positions,
                                         past_key_values=cache, use_cache=True)
        cache.batch_select_indices(torch.tensor(row_of, device=input_ids.device))
        return cache

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams, device) -> list[Completion]:
        batch, plen = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((batch, plen), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((batch, plen), dtype=torch.long)
        for row, p in enumerate(prompts):  # left padding
            input_ids[row, plen - len(p):] = torch.tensor(p, dtype=torch.long)
            attention_mask[row, plen - len(p):] = 1

        recorder = _LogprobRecorder(plen, params.logprob_temperature, batch, params.max_new_tokens, device)
        criteria = StoppingCriteriaList()
        stopper = None
        if params.stop_strings:
            stopper = _StopStringCriteria(
                params.stop_strings, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
                plen, batch)
            criteria.append(stopper)
        # the warpers below do temperature / top-k / top-p; neutral values here (greedy takes none)
        neutral = {} if params.greedy else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
        config = GenerationConfig(
            max_new_tokens=params.max_new_tokens,
            do_sample=not params.greedy,
            num_beams=1,
            **neutral,
            use_cache=True,
            pad_token_id=self.pad_token_id,
            eos_token_id=self.eos_token_ids,
        )
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        sequences = self.model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            past_key_values=self._prefill(prompts, input_ids, attention_mask),
            generation_config=config,
            logits_processor=LogitsProcessorList([recorder, *self._warpers(params)]),
            stopping_criteria=criteria,
            synced_gpus=self.synced,
        )
        logprobs = recorder.finalize(sequences).cpu()
        generated = sequences[:, plen:].cpu().tolist()

        completions = []
        for row in range(batch):
            stop_index = stopper.fired_at[row] if stopper is not None else None
            ids, reason = trim_completion(generated[row], self.eos_token_ids, stop_index)
            completions.append(Completion(
                prompt_ids=prompts[row],
                completion_ids=ids,
                logprobs=logprobs[row, : len(ids)].tolist(),
                finish_reason=reason,
                text=self.tokenizer.decode(ids, skip_special_tokens=True),
            ))
        return completions
