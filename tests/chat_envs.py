"""Shared by the environment tests: a tiny chat model (ChatML template over every role, a char-level
tokenizer) and small environments written against ``grpolab.tasks.environment``."""

from __future__ import annotations

import asyncio
from pathlib import Path

import torch
from conftest import build_char_tokenizer
from tiny_configs import tiny_llama
from tokenizers import AddedToken
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from grpolab.tasks.base import Example, Grade
from grpolab.tasks.environment import Endpoint, Environment, EnvironmentTask

# SmolLM2's ChatML turns, every role rendered (tool results too); a turn's content may be empty
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def chatml_tokenizer() -> PreTrainedTokenizerFast:
    base = build_char_tokenizer().backend_tokenizer
    base.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=base, pad_token="<pad>", unk_token="<unk>", eos_token="<|im_end|>"
    )
    tokenizer.chat_template = CHATML
    return tokenizer


def chatml_model_dir(root: Path, seed: int = 0, vllm: bool = False) -> Path:
    """A tiny random Llama with ``chatml_tokenizer`` (EOS ``<|im_end|>``), saved under ``root``; ``vllm``: with
    head_dim 32, which vLLM's CPU attention takes (8 it does not)."""
    tokenizer = chatml_tokenizer()
    torch.manual_seed(seed)
    config = tiny_llama(tokenizer, 1024, hidden_size=64 if vllm else 32, num_attention_heads=2 if vllm else 4)
    path = root / ("chatml_vllm" if vllm else "chatml")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class EchoGame(Environment):
    """Two model turns: the question, then an observation ("again: ..."); reward 1 when the second reply
    contains the letter of the example's answer, a second term the length of the first reply (capped)."""

    name, version = "echo-game", "1"

    def __init__(self, turns: int = 2, delay_s: float = 0.0, fail_on: str | None = None, timeout_s: float = 60.0):
        self.turns, self.delay_s, self.fail_on, self.timeout_s = turns, delay_s, fail_on, timeout_s
        self.settings = {"turns": turns}
        self.in_flight = self.peak = 0
        self.started = self.closed = 0

    def start(self) -> None:
        self.started += 1

    def close(self) -> None:
        self.closed += 1

    async def rollout(self, example: Example, endpoint: Endpoint) -> Grade:
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            if example.question == self.fail_on:
                raise RuntimeError("the environment broke")
            await asyncio.sleep(self.delay_s)
            messages = [{"role": "user", "content": example.question}]
            replies = []
            async with endpoint.client() as client:
                for turn in range(self.turns):
                    out = await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=8)
                    reply = out.choices[0].message.content
                    replies.append(reply)
                    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"again {turn}"}]
            hit = float(example.answer in replies[-1])
            size = min(len(replies[0]), 8) / 8
            return Grade(hit, hit, components=(("hit", hit), ("size", size)), total=hit + 0.5 * size)
        finally:
            self.in_flight -= 1


class EchoTask(EnvironmentTask):
    """``EchoGame`` over letters: the question ``"say X"``; a task class a run names by import path."""

    name = "echo"

    def __init__(self, n_train: int = 8, n_val: int = 4, **game):
        self.environment = EchoGame(**game)
        letters = "abcdefghijklmnopqrstuvwxyz"
        self._examples = [Example(id=f"e{i}", question=f"say {c}", answer=c) for i, c in enumerate(letters)]
        self.n_train, self.n_val = n_train, n_val
        self.tokenizer = None

    def bind_tokenizer(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def train_examples(self) -> list[Example]:
        return self._examples[self.n_val : self.n_val + self.n_train]

    def validation_examples(self) -> list[Example]:
        return self._examples[: self.n_val]

    def prompt(self, example: Example) -> str:
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": example.question}], tokenize=False, add_generation_prompt=True
        )
