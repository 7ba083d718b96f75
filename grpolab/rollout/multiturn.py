"""Multi-turn rollouts with tools on top of any single-turn engine (hf, vLLM, vLLM in its own process).

A turn is one engine call over every trajectory still active: generation stops at EOS, at a stop
string, at the budget, or at the tool call's closing tag. A trajectory that stopped on a call gets
the executed call's observation tokens appended to its context, and the next turn continues it
from exactly those tokens (nothing is re-tokenised, so the trainer's sequence is the engine's).

Token budget: ``params.max_new_tokens`` bounds a whole trajectory, observations included. Each turn
samples up to the largest budget left among the active trajectories and every trajectory is cut at
its own; a trajectory cut there, or whose observation does not fit, ends with finish reason
"length" (truncated). Observations are tokenised with ``add_special_tokens=False`` and get policy
mask 0 and log-prob 0.

The calls of one turn run at once (``Toolset.execute_many``: the Python tool's are sandboxed processes). A call
whose tool machinery failed (``kind`` "sandbox") ends its trajectory as a failed sample (``Grade.failed_as``):
it says nothing of the policy and takes no part in advantages or the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from statistics import mean
from typing import Any

from grpolab.models.weights import PolicyWeights
from grpolab.rollout.base import Completion, FinishReason, RolloutEngine, SamplingParams
from grpolab.tasks.base import Grade
from grpolab.tools.protocol import ERROR_KINDS, ToolCall, Toolset

__all__ = ["MultiTurnEngine", "tool_metrics"]


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of turn ``turn`` (0 = the first turn keeps the call's seed)."""
    return seed if seed is None or turn == 0 else (seed * 1_000_033 + turn * 7_919) % 2**62


@dataclass
class _Trajectory:
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    turns: int = 0
    finish: FinishReason = "stop"
    failure: str | None = None  # why the trajectory cannot be graded (its tool machinery failed)

    def add(self, ids: list[int], logprobs: list[float], policy: bool) -> None:
        self.ids += ids
        self.logprobs += logprobs if policy else [0.0] * len(ids)
        self.mask += [int(policy)] * len(ids)


class MultiTurnEngine:
    """``RolloutEngine`` whose trajectories may call the tools of ``toolset``, on top of ``engine``.

    tokenizer: decodes each turn (special tokens kept, to find the call tags) and encodes observations.
    eos_token_ids: a turn ending in one of them ends its trajectory; default: the engine's.
    """

    def __init__(self, engine: RolloutEngine, toolset: Toolset, tokenizer, eos_token_ids: list[int] | None = None):
        self.engine, self.toolset, self.tokenizer = engine, toolset, tokenizer
        self.eos_token_ids = set(eos_token_ids if eos_token_ids is not None else getattr(engine, "eos_token_ids", []))

    def sync_weights(self, weights: PolicyWeights) -> None:
        self.engine.sync_weights(weights)

    def close(self) -> None:
        self.engine.close()

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """``n`` trajectories per prompt, ``[len(prompts)][n]``, prompt order kept."""
        budget = params.max_new_tokens
        stops = tuple(dict.fromkeys((*params.stop_strings, self.toolset.call_close)))
        groups = self.engine.generate(prompts, n, replace(params, stop_strings=stops))
        trajectories = [_Trajectory(list(p)) for p, group in zip(prompts, groups) for _ in group]
        active = self._advance(trajectories, [c for group in groups for c in group], budget)
        turn = 1
        while active:
            left = max(budget - len(t.ids) for t in active)
            outs = self.engine.generate(
                [t.prompt + t.ids for t in active],
                1,
                replace(params, max_new_tokens=left, stop_strings=stops, seed=turn_seed(params.seed, turn)),
            )
            active = self._advance(active, [group[0] for group in outs], budget)
            turn += 1
        flat = [self._completion(t) for t in trajectories]
        return [flat[i * n : (i + 1) * n] for i in range(len(prompts))]

    def _advance(self, trajectories: list[_Trajectory], turns: list[Completion], budget: int) -> list[_Trajectory]:
        """Append each trajectory's new turn (cut at its budget), run the call it ended on; returns the
        trajectories that continue."""
        active, calling = [], []
        for t, c in zip(trajectories, turns):
            room = budget - len(t.ids)
            ids, logprobs, finish = c.completion_ids[:room], c.logprobs[:room], c.finish_reason
            if len(c.completion_ids) > room:
                finish = "length"
            t.add(ids, logprobs, policy=True)
            t.turns += 1
            t.finish = finish
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            if finish != "stop" or (ids and ids[-1] in self.eos_token_ids) or not self.toolset.ends_on_call(text):
                continue
            call_text = self.toolset.call_text(text)
            if t.turns >= self.toolset.max_turns:
                t.calls.append(
                    ToolCall(
                        call_text or "",
                        None,
                        None,
                        "turn limit reached: not executed",
                        "",
                        len(t.ids),
                        len(t.ids),
                        kind="turn_limit",
                    )
                )
                continue
            calling.append((t, call_text))
        for (t, _), call in zip(calling, self.toolset.execute_many([text for _, text in calling])):
            if call.kind == "sandbox":
                t.calls.append(replace(call, start=len(t.ids), end=len(t.ids)))
                t.failure = call.error
                continue
            observation = self.tokenizer(call.observation, add_special_tokens=False)["input_ids"]
            start = len(t.ids)
            kept = observation[: budget - start]
            t.add(kept, [], policy=False)
            t.calls.append(replace(call, start=start, end=start + len(kept)))
            if len(t.ids) >= budget:
                t.finish = "length"
            else:
                active.append(t)
        return active

    def _completion(self, t: _Trajectory) -> Completion:
        return Completion(
            prompt_ids=t.prompt,
            completion_ids=t.ids,
            logprobs=t.logprobs,
            finish_reason=t.finish,
            text=self.tokenizer.decode(t.ids, skip_special_tokens=True),
            policy_mask=t.mask,
            tool_calls=[c.record() for c in t.calls],
            turns=t.turns,
            grade=None if t.failure is None else Grade.failed_as("sandbox", t.failure),
        )


def tool_metrics(completions: list[Completion], correct: list[bool], prefix: str = "tool/") -> dict[str, float]:
    """Tool use of a batch of trajectories: ``call_rate`` (trajectories with a call), ``calls_mean``,
    ``valid_call_rate`` (calls that ran without error), ``errors`` (and ``errors/<kind>`` per
    ``grpolab.tools.protocol.ERROR_KINDS``), ``turns_mean``,
    ``observation_tokens`` (masked out of the loss), and ``accuracy_with_calls`` /
    ``accuracy_without_calls`` (answer accuracy of the trajectories with / without a valid call; left
    out when there are none)."""
    calls = [call for c in completions for call in c.tool_calls]
    errors = sum(call["error"] is not None for call in calls)
    used = [any(call["error"] is None for call in c.tool_calls) for c in completions]
    out: dict[str, Any] = {
        "call_rate": mean(bool(c.tool_calls) for c in completions),
        "calls_mean": len(calls) / len(completions),
        "errors": errors,
        "turns_mean": mean(c.turns for c in completions),
        "observation_tokens": sum(len(c.completion_ids) - c.num_policy_tokens for c in completions),
    }
    if calls:
        out["valid_call_rate"] = 1 - errors / len(calls)
        for kind in ERROR_KINDS:
            count = sum(call.get("kind") == kind for call in calls)
            if count:
                out[f"errors/{kind}"] = count
    for key, want in (("accuracy_with_calls", True), ("accuracy_without_calls", False)):
        picked = [ok for ok, u in zip(correct, used) if u == want]
        if picked:
            out[key] = mean(picked)
    return {prefix + k: v for k, v in out.items()}
