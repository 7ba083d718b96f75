"""The rollout-engine contract shared by every engine (transformers, vLLM, ...).

Token conventions:

* ``Completion.completion_ids`` holds exactly the tokens the policy generated: it includes the
  EOS token when generation stopped on EOS (EOS is a policy action and is trained on), ends with
  the last token of the stop string when generation stopped on a stop string, and never holds
  anything after that.
* ``Completion.logprobs[i]`` is the engine's log-probability of ``completion_ids[i]`` given the
  prompt and the previous completion tokens, under ``softmax(logits / temperature)`` at the
  *sampling temperature* (temperature 1 for greedy, ``temperature == 0``). top-k / top-p
  truncation is *not* applied to these log-probs, so they are directly comparable with
  ``grpolab.models.logprobs.token_logprobs(..., temperature=params.temperature)``.
* A multi-turn (tool-using) completion also holds the tool observations inserted between the
  policy's turns: ``policy_mask[i]`` is 1 on tokens the policy sampled and 0 on observation
  tokens, whose ``logprobs`` entries are 0 (nothing sampled them). Single-turn completions have no
  observations (``policy_mask`` None = all 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from grpolab.tasks.base import Grade

if TYPE_CHECKING:  # annotations only: the contract (and the engines' capabilities) load without torch
    from torch import Tensor

    from grpolab.models.weights import PolicyWeights

__all__ = [
    "SamplingParams",
    "Completion",
    "EngineCapabilities",
    "RolloutEngine",
    "FinishReason",
    "collect_eos_ids",
    "let_an_interrupt_land",
]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample completions.

    max_new_tokens: hard cap on completion length (finish_reason "length" when reached
        without stopping).
    temperature: 0 means greedy decoding; otherwise logits are divided by it.
    top_p: nucleus sampling mass (1.0 disables).
    top_k: keep the k most likely tokens (0 disables).
    stop_strings: generation stops once the completion text contains any of these; the
        completion is cut right after the token that completed the first occurrence.
    seed: seeds the engine's sampler for this call (see each engine for its scope).
    prompt_offset: the index of the call's first prompt in a larger list the caller split (a
        data-parallel rank's share of a step): engines seed by that global position, so the rows a
        rank samples are those one process sampling the whole list would draw (see each engine).
    rows: each prompt's global index, in place of ``prompt_offset`` plus its place in the call (requests that
        each belong to a trajectory of their own, batched as they arrive: ``grpolab.rollout.endpoint``); None:
        ``prompt_offset`` plus the place.
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None
    prompt_offset: int = 0
    rows: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        if isinstance(self.stop_strings, str) or any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must be a tuple of non-empty strings")

    def prompt_index(self, place: int) -> int:
        """The global index of the call's prompt at ``place`` (``rows``, or ``prompt_offset`` plus the place)."""
        return self.rows[place] if self.rows is not None else self.prompt_offset + place

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """Temperature at which engines report ``Completion.logprobs`` (1.0 when greedy)."""
        return 1.0 if self.greedy else self.temperature


@dataclass
class Completion:
    """One sampled completion of one prompt.

    prompt_ids: the prompt tokens as given to the engine.
    completion_ids: generated tokens (EOS / stop-string tokens included, nothing after).
    logprobs: one float per completion token, see the module docstring.
    finish_reason: "stop" (EOS or stop string) or "length" (hit max_new_tokens; for a multi-turn
        completion: its token budget).
    text: decoded completion (special tokens such as EOS skipped), observations included.
    policy_mask: one 0/1 per completion token, 0 on tool observations; None = all 1.
    tool_calls: one record per tool call of a multi-turn completion (``grpolab.tools.ToolCall``
        as a dict: call text, name, arguments, error, observation and its token span).
    turns: generation turns (1 for a single-turn completion).
    routed_experts: an MoE policy's routing where the engine computed it: int16 [P + C, L, k], the experts each
        of its L routers chose for each prompt and completion token (-1: a token the engine never fed, such as
        the last); None when the engine records none.
    grade: the grade an environment gave the trajectory it drove (``grpolab.tasks.environment``); None: the
        task grades it.
    policy_version: the policy that sampled it, as the steps trained into its weights (0: the start policy);
        set by the rollout pipeline (``grpolab.rollout.pipeline``), None where nothing recorded it.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    text: str
    policy_mask: list[int] | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 1
    routed_experts: Tensor | None = None
    policy_version: int | None = None
    grade: Grade | None = None

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.completion_ids)} completion tokens")
        if self.policy_mask is not None and len(self.policy_mask) != len(self.completion_ids):
            raise ValueError(
                f"{len(self.policy_mask)} policy-mask entries for {len(self.completion_ids)} completion tokens"
            )

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def mask(self) -> list[int]:
        """The policy mask, all 1 for a single-turn completion."""
        return [1] * len(self.completion_ids) if self.policy_mask is None else self.policy_mask

    @property
    def num_policy_tokens(self) -> int:
        return len(self.completion_ids) if self.policy_mask is None else sum(self.policy_mask)


@dataclass(frozen=True)
class EngineCapabilities:
    """What an engine can do, declared by its class (``capabilities``) and looked up by the config's engine
    choice (``grpolab.rollout.engines.capabilities``): code outside ``rollout/`` asks these, never an
    engine's name.

    shares_training_model: it samples from the training model object itself (sharded too, then in lockstep
        over the ranks); otherwise it holds weights of its own, loaded from weight files and synced by copy.
    max_temperature: the highest sampling temperature it takes (None: no limit).
    truncated_sampling: it samples with top_p < 1 or top_k > 0 and still reports the contract's untruncated
        log-probs (evaluation's pass@k sampling).
    graceful_stop: it outlives the terminal's Ctrl-C, so a signal may let the run finish its step and save a
        checkpoint (an engine whose processes die of the same signal is stopped at once).
    records_routing: an MoE policy's completions carry the experts its routers chose (``routed_experts``).
    serves_adapters: it can serve a LoRA adapter of its own, synced alone (``PolicyWeights`` kind ``adapter``).
    batch_refill: it starts new sequences as others finish, within one call.
    bounded_batch: it generates at most ``rollout.max_batch_size`` sequences at once (its KV cache holds as
        many rows); otherwise the whole call's.
    runs_apart: it can be built in a process of its own beside the learner (async rollouts), where the learner
        publishes its weights by version (``grpolab.rollout.engine_process``; the registry's ``apart``).
    """

    shares_training_model: bool
    max_temperature: float | None = None
    truncated_sampling: bool = True
    graceful_stop: bool = True
    records_routing: bool = False
    serves_adapters: bool = False
    batch_refill: bool = False
    bounded_batch: bool = False
    runs_apart: bool = False


@runtime_checkable
class RolloutEngine(Protocol):
    """A sampler of completions from the current policy. An engine class also declares what it can do as
    ``capabilities`` (an ``EngineCapabilities``)."""

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """``n`` completions for each prompt; outer list in prompt order, inner of length n."""
        ...

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Make the engine sample from the policy ``weights`` hold (of the kind its capabilities select)."""
        ...

    def close(self) -> None:
        """Release the engine's resources."""
        ...


def collect_eos_ids(tokenizer, generation_eos: int | list[int] | None) -> list[int]:
    """The ids that end generation: the tokenizer's EOS, then the generation config's (an id or a
    list, as ``GenerationConfig.eos_token_id``), without duplicates."""
    ids: list[int] = []
    for source in (getattr(tokenizer, "eos_token_id", None), generation_eos):
        for i in source if isinstance(source, (list, tuple)) else [source]:
            if i is not None and int(i) not in ids:
                ids.append(int(i))
    return ids


def let_an_interrupt_land(seconds: float = 1.0) -> None:
    """Call before raising an engine failure. Engine processes share the terminal's process group:
    on Ctrl-C they abort their requests or die a moment before the trainer's own KeyboardInterrupt
    arrives. Waiting briefly lets that interrupt land first, so Ctrl-C is reported as an interrupt
    (exit 130, clean shutdown), not as an engine failure."""
    time.sleep(seconds)
