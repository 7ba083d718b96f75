"""A tiny, real Hugging Face causal LM for CPU demos: tokenizer, model and a cached warm start.

``warm_start_model(task)`` trains a byte-level BPE tokenizer (``tokenizers``) on the task's prompts
and solutions, builds a randomly initialised ~1M-parameter Llama, fine-tunes it briefly on worked
solutions (loss on completion tokens only) and saves both with ``save_pretrained``. The returned
folder loads with ``AutoTokenizer`` / ``AutoModelForCausalLM`` like any local model.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from grpolab.common.progress import Reporter
from grpolab.models.cached_folder import cached_folder
from grpolab.models.settings import MOE_FIELDS, WarmStartSettings
from grpolab.tasks.base import Task

TAGS = ("<think>", "</think>", "<answer>", "</answer>")
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
WARM_START_VERSION = 1  # bump when the recipe changes, to invalidate old caches


def build_tokenizer(
    corpus: Iterable[str], vocab_size: int = 512, max_token_length: int | None = None, tags: Iterable[str] = TAGS
) -> PreTrainedTokenizerFast:
    """Train a small byte-level BPE tokenizer on ``corpus``.

    Every byte is in the base alphabet, so any text encodes and decodes exactly. Digits are always
    split one per token; the ``tags`` (r1_zero's, and a tool task's call and response tags) are single
    (non-special) tokens, so decoding with
    ``skip_special_tokens=True`` keeps them; ``<|endoftext|>`` is EOS and ``<|pad|>`` is padding.
    Pre-tokenisation does not split on spaces, so the fixed prompt preamble merges into a few
    multi-word tokens (at most ``max_token_length`` characters each).
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (EOS_TOKEN, PAD_TOKEN)])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in dict.fromkeys(tags)])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=max_token_length,
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )


def model_config(
    vocab_size: int,
    arch: str,
    *,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    intermediate_size: int,
    tie_word_embeddings: bool,
    experts: dict[str, int] | None = None,
    **fields: Any,
) -> PretrainedConfig:
    """The transformers config of a tiny model of type ``arch`` (``experts``: an MoE arch's expert fields)."""
    return AutoConfig.for_model(
        arch,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        head_dim=hidden_size // num_heads,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        **(experts or {}),
        **fields,
    )


def build_model(
    tokenizer: PreTrainedTokenizerFast,
    arch: str = "llama",
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int = 512,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = True,
    experts: dict[str, int] | None = None,
) -> PreTrainedModel:
    """A randomly initialised causal LM of model type ``arch`` ("llama", "qwen3", an MoE arch with ``experts``:
    its expert-count fields, ...).

    Seed torch before calling for a reproducible initialisation. Note: with transformers 5,
    ``AutoTokenizer`` loads a folder whose model type is ``qwen2`` as ``Qwen2Tokenizer`` and swaps
    in Qwen's pre-tokenizer, so ``save_checked`` refuses that arch.
    """
    config = model_config(
        len(tokenizer),
        arch,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        intermediate_size=intermediate_size,
        tie_word_embeddings=tie_word_embeddings,
        experts=experts,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def warm_start_settings(task: Task, changes: dict[str, Any] | None = None) -> WarmStartSettings:
    """The demo's recipe with the task's ``warm_start_overrides``, then ``changes``."""
    return WarmStartSettings(**{**task.warm_start_overrides, **(changes or {})})


def settings_config(settings: WarmStartSettings) -> PretrainedConfig:
    """The transformers config of the warm-start model, its vocabulary taken as ``settings.vocab_size``
    (the trained tokenizer adds a few tokens): for timing and size estimates before the model exists."""
    return model_config(settings.vocab_size, settings.arch, **settings.shape())


def default_cache_root() -> Path:
    """``$GRPOLAB_CACHE/tiny`` if set, else ``~/.cache/grpolab/tiny``."""
    base = os.environ.get("GRPOLAB_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "grpolab") / "tiny"


def _tags(task: Task) -> tuple[str, ...]:
    return TAGS + (task.toolset.tags() if task.toolset is not None else ())


def _whole(text: str) -> list[tuple[str, bool]]:
    """A solution without tool observations: one segment, all trained on."""
    return [(text, False)]


def _segments(task: Task) -> Callable[[str], list[tuple[str, bool]]]:
    """Splits a solution into (text, is_observation): a tool task's observations are not trained on."""
    return task.toolset.segments if task.toolset is not None else _whole


def _solved(task: Task, settings: WarmStartSettings) -> list[tuple[str, str]]:
    pairs = [(task.prompt(e), e.solution) for e in task.train_examples() if e.solution]
    pairs = pairs[: settings.max_examples] if settings.max_examples is not None else pairs
    if not pairs:
        raise ValueError(f"task {task.name!r} has no training examples with solutions")
    return pairs


def warm_start_key(task: Task, settings: WarmStartSettings) -> str:
    """Short hash of the recipe version, the settings and the solved examples used."""
    h = hashlib.sha256()
    recipe = settings.model_dump(exclude=None if settings.num_experts else set(MOE_FIELDS))  # dense: keys as before
    h.update(json.dumps([WARM_START_VERSION, task.name, recipe], sort_keys=True).encode())
    for prompt, solution in _solved(task, settings):
        h.update(f"{len(prompt)}:{prompt}{len(solution)}:{solution}".encode())
    return h.hexdigest()[:12]


def _encode(
    tokenizer: PreTrainedTokenizerFast,
    pairs: list[tuple[str, str]],
    segments: Callable[[str], list[tuple[str, bool]]] = _whole,
) -> list[tuple[list[int], list[bool]]]:
    """Token ids of prompt + solution + EOS, and which of them the loss trains on: the solution's and
    EOS, except tool observations. Each segment of the solution is tokenised on its own, as a
    multi-turn rollout joins a turn's tokens and an observation's."""
    rows = []
    for prompt, solution in pairs:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        trained = [False] * len(ids)
        for text, observation in segments(solution):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids, trained = ids + piece, trained + [not observation] * len(piece)
        rows.append((ids + [tokenizer.eos_token_id], trained + [True]))
    return rows


def _batch(rows: list[tuple[list[int], list[bool]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (ids, trained) in enumerate(rows):
        row = torch.tensor(ids)
        input_ids[i, : len(ids)] = row
        labels[i, : len(ids)] = torch.where(torch.tensor(trained), row, -100)
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels}


def _lr_factor(step: int, settings: WarmStartSettings) -> float:
    """Linear warmup, then cosine decay to ``settings.final_lr_ratio`` at the last step."""
    if step < settings.warmup_steps:
        return (step + 1) / settings.warmup_steps
    span = max(1, settings.steps - 1 - settings.warmup_steps)
    progress = min(1.0, (step - settings.warmup_steps) / span)
    return settings.final_lr_ratio + (1 - settings.final_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def supervised_warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    pairs: list[tuple[str, str]],
    settings: WarmStartSettings,
    on_step: Callable[[float], None] | None = None,
    segments: Callable[[str], list[tuple[str, bool]]] = _whole,
) -> list[float]:
    """Fine-tune ``model`` in place on (prompt, solution) pairs; returns the loss per step.

    AdamW with warmup and cosine decay, random batches drawn epoch by epoch from a generator
    seeded with ``settings.seed``; cross-entropy on solution and EOS tokens only, tool observations
    excepted (``segments`` splits them out). ``on_step(loss)`` is called after every step.
    """
    rows = _encode(tokenizer, pairs, segments)
    gen = torch.Generator().manual_seed(settings.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: _lr_factor(step, settings))
    order: list[int] = []
    losses: list[float] = []
    model.train()
    for _ in range(settings.steps):
        if len(order) < settings.batch_size:
            order += torch.randperm(len(rows), generator=gen).tolist()
        picked, order = order[: settings.batch_size], order[settings.batch_size :]
        loss = model(**_batch([rows[i] for i in picked], tokenizer.pad_token_id)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(losses[-1])
    model.eval()
    return losses


def save_checked(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, folder: Path, probe: str) -> None:
    """``save_pretrained`` both, then check the Auto classes load back the same tokenizer.

    transformers maps some model types to their own tokenizer class on load (``qwen2`` gets
    ``Qwen2Tokenizer``, which replaces the pre-tokenizer); such an arch is refused here.
    """
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    loaded = AutoTokenizer.from_pretrained(folder)
    if loaded(probe)["input_ids"] != tokenizer(probe)["input_ids"]:
        raise ValueError(
            f"AutoTokenizer reloads a different tokenizer ({type(loaded).__name__}) for model type "
            f"{model.config.model_type!r}; use arch='llama' or 'qwen3'"
        )


def warm_start_model(
    task: Task,
    settings: WarmStartSettings | None = None,
    cache_dir: str | Path | None = None,
    reporter: Reporter | None = None,
) -> Path:
    """Path of a warm-started tiny model for ``task``, training and caching it on first use.

    The folder is ``<cache_dir or default_cache_root()>/<warm_start_key>``; it holds the
    ``save_pretrained`` output of model and tokenizer plus ``warm_start.json`` (settings, losses,
    seconds). Without ``settings``, the defaults with the task's ``warm_start_overrides`` (an optional
    member). It is written to a temporary folder and renamed into place, so a half-written cache is
    never returned. Deterministic for a given seed on CPU. ``reporter`` shows the steps, the loss
    and the time left.
    """
    settings = settings or warm_start_settings(task)
    root = Path(cache_dir) if cache_dir is not None else default_cache_root()
    target = root / warm_start_key(task, settings)

    def write(folder: Path) -> None:
        started = time.perf_counter()
        pairs = _solved(task, settings)
        tokenizer = build_tokenizer(
            (p + s for p, s in pairs), settings.vocab_size, settings.max_token_length, _tags(task)
        )
        torch.manual_seed(settings.seed)
        model = build_model(tokenizer, settings.arch, **settings.shape())
        if reporter is None:
            losses = supervised_warm_start(model, tokenizer, pairs, settings, segments=_segments(task))
        else:
            reporter.line(
                f"warm start: {settings.steps} supervised steps on {len(pairs)} worked solutions, "
                f"cached afterwards in {target}"
            )
            with reporter.phase(
                "warm start", total=settings.steps, unit="steps", every=max(1, settings.steps // 10)
            ) as phase:
                losses = supervised_warm_start(
                    model,
                    tokenizer,
                    pairs,
                    settings,
                    on_step=lambda loss: phase.advance(info=f"loss {loss:.3f}"),
                    segments=_segments(task),
                )
        save_checked(model, tokenizer, folder, probe=pairs[0][0] + pairs[0][1])
        info = {
            "task": task.name,
            "settings": settings.model_dump(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "examples": len(pairs),
            "losses": losses,
            "seconds": round(time.perf_counter() - started, 2),
        }
        (folder / "warm_start.json").write_text(json.dumps(info, indent=1))

    return cached_folder(target, "warm_start.json", write)
