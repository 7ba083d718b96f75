"""Chat-template prompts: the trainer's prompt tokens are exactly what ``apply_chat_template`` produces
(generation prompt included) for tiny models with Qwen3-style and Llama-3-style chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import build_char_tokenizer, run_config
from tiny_configs import tiny_llama
from tokenizers import AddedToken, processors
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from grpolab.config import RunConfig, load_config
from grpolab.run.trainer import Trainer
from grpolab.tasks import build_task

# A Qwen3-style template: ChatML turns, and a thinking switch after the generation prompt.
QWEN3_STYLE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'user' %}"
    "{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)
# A Llama-3-style template: BOS in the text, header tokens, <|eot_id|> after each turn.
LLAMA3_STYLE = (
    "{{- bos_token }}{%- if messages[0].role == 'system' %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' + messages[0].content | trim + '<|eot_id|>' }}"
    "{%- set messages = messages[1:] %}{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)
STYLES = {
    "qwen3": (QWEN3_STYLE, ["<|im_start|>", "<|im_end|>"], {"eos_token": "<|im_end|>"}),
    "llama3": (
        LLAMA3_STYLE,
        ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    ),
}


def chat_model_dir(tmp_path, style: str):
    """A tiny random Llama whose tokenizer has ``style``'s special tokens and chat template; the Llama-3
    one also adds BOS by itself when asked to add special tokens, as the real one does."""
    template, specials, roles = STYLES[style]
    base = build_char_tokenizer().backend_tokenizer
    base.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    if style == "llama3":
        bos = base.token_to_id("<|begin_of_text|>")
        base.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]
        )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=base, pad_token="<pad>", unk_token="<unk>", **roles)
    tokenizer.chat_template = template
    torch.manual_seed(0)
    config = tiny_llama(tokenizer, 512, initializer_range=0.02)  # transformers' default
    path = tmp_path / f"chat_{style}"
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def data(tmp_path):
    train, val = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train.write_text(
        "".join(json.dumps({"problem": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(6))
    )
    val.write_text("".join(json.dumps({"problem": f"What is {i}+1?", "answer": str(i + 1)}) + "\n" for i in range(3)))
    return train, val


def dataset_config(model_dir, tmp_path, prompt: dict, max_new_tokens: int) -> RunConfig:
    """One step of the model in ``model_dir`` on a dataset task of ``data(tmp_path)``'s problems, prompted by
    ``prompt``: 2 prompts x 2 samples of up to ``max_new_tokens`` tokens."""
    train, val = data(tmp_path)
    task = {
        "task.train": str(train),
        "task.validation": str(val),
        "task.question_field": "problem",
        "task.prompt": prompt,
    }
    rollout = {"rollout.prompts_per_step": 2, "rollout.group_size": 2, "rollout.max_new_tokens": max_new_tokens}
    return run_config(model_dir, tmp_path / "run", {"steps": 1, "task.name": "dataset", **task, **rollout})


@pytest.mark.parametrize(
    "style, kwargs, system",
    [
        ("qwen3", {"enable_thinking": False}, "Put the answer in \\boxed{}."),
        ("qwen3", {}, None),
        ("llama3", {}, "You are a careful solver."),
    ],
)
def test_trainer_prompt_tokens_equal_apply_chat_template(tmp_path, style, kwargs, system):
    model_dir = chat_model_dir(tmp_path, style)
    prompt = {"format": "chat", "answer": "boxed", "template": "Question: {problem}", "chat_template_kwargs": kwargs}
    if system:
        prompt["system"] = system
    trainer = Trainer(dataset_config(model_dir, tmp_path, prompt, max_new_tokens=8))
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        for example in trainer.parts.task.train_examples() + trainer.parts.val_examples:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": f"Question: {example.fields['problem']}"}
            ]
            expected = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
            )
            assert trainer.parts.prompt_ids[example.id] == list(expected)
        text = tokenizer.decode(trainer.parts.prompt_ids["train-1"])
        if style == "qwen3":
            assert text.endswith("<|im_start|>assistant\n" + ("<think>\n\n</think>\n\n" if kwargs else ""))
        else:
            assert text.startswith("<|begin_of_text|><|start_header_id|>") and text.count("<|begin_of_text|>") == 1
            assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
        record = trainer.train_step(1)  # one real step on those prompts
        assert record["reward/math_failed"] == 0 and "reward/math" in record
        fingerprint = trainer.parts.task.data_fingerprint()
        assert (
            "chat_template" in trainer.parts.task.prompt_template() and len(fingerprint["prompt_template_sha256"]) == 64
        )
    finally:
        trainer.close()


def test_chat_format_needs_a_chat_template(tmp_path, tiny_model_dirs):
    train, val = data(tmp_path)
    task = build_task(
        {
            "name": "dataset",
            "train": str(train),
            "validation": str(val),
            "question_field": "problem",
            "prompt": {"format": "chat", "answer": "boxed"},
        }
    )
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        task.bind_tokenizer(AutoTokenizer.from_pretrained(tiny_model_dirs["llama"]))
    with pytest.raises(Exception, match="like:NAME model's tokenizer has no chat template"):
        load_config(
            None,
            {
                "model.path": "like:qwen3-0.6b",
                "task.name": "dataset",
                "task.train": "x.jsonl",
                "task.validation_size": 2,
                "task.prompt": {"format": "chat", "answer": "boxed"},
            },
        )


def test_the_math_config_runs_on_the_math_like_fixture(tmp_path):
    """configs/math_qwen3_0.6b.toml, with the tiny MATH-like fixture and a Qwen3-style tiny model standing in."""
    fixture = Path(__file__).parent / "data" / "math_tiny"
    cfg = load_config(
        Path(__file__).parents[1] / "configs" / "math_qwen3_0.6b.toml",
        {
            "model": str(chat_model_dir(tmp_path, "qwen3")),
            "task.train": str(fixture / "train.jsonl"),
            "task.validation": str(fixture / "test.jsonl"),
            "task.n_val": 6,
            "output_dir": str(tmp_path / "run"),
            "steps": 1,
            "rollout.prompts_per_step": 2,
            "rollout.group_size": 2,
            "rollout.max_new_tokens": 12,
            "reward.overlong_buffer": 4,
            "model.gradient_checkpointing": False,
        },
    )
    trainer = Trainer(cfg)
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        text = tokenizer.decode(trainer.parts.prompt_ids["train/algebra/2.json"])
        assert text == (
            "<|im_start|>system\nPlease reason step by step, and put your final answer within \\boxed{}."
            "<|im_end|>\n<|im_start|>user\nSolve $2x-3>5$ for $x$; give the interval.<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
        record = trainer.train_step(1)
        assert -1.0 <= record["reward/overlong_penalty"] < 0  # random weights: most completions hit the limit
        assert record["reward_mean"] == pytest.approx(record["reward/correct"] + record["reward/overlong_penalty"])
        assert trainer.evaluate(1)["val/accuracy"] == 0.0
        answers = {e.id: e.answer for e in trainer.parts.val_examples}
        assert (
            trainer.parts.task.grade("so \\boxed{\\frac{6}{4}}", trainer.parts.val_examples[0], False).answer_reward
            == 1.0
        )
        assert answers["test/algebra/2.json"] == "(-2,2)"
    finally:
        trainer.close()
