"""Prompt tokens carry the tokenizer's BOS exactly once: added for tokenizers that add it (Llama-3 base,
Mistral, Gemma), never twice when a chat template wrote it, never an appended EOS."""

from __future__ import annotations

import pytest
from conftest import build_char_tokenizer
from test_chat_prompts import chat_model_dir, dataset_config
from tokenizers import AddedToken, processors
from transformers import PreTrainedTokenizerFast

from grpolab.models.prompt_tokens import leading_special_ids, tokenize_prompts
from grpolab.run.trainer import Trainer


def char_tokenizer(post: str | None) -> PreTrainedTokenizerFast:
    """The character tokenizer with a ``<s>`` token, and a post-processor ``post`` (e.g. ``"<s> $A"``)."""
    base = build_char_tokenizer().backend_tokenizer
    base.add_special_tokens([AddedToken("<s>", special=True, normalized=False)])
    if post:
        ids = [(t, base.token_to_id(t)) for t in ("<s>", "<eos>") if t in post]
        base.post_processor = processors.TemplateProcessing(single=post, special_tokens=ids)
    return PreTrainedTokenizerFast(
        tokenizer_object=base, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>", bos_token="<s>"
    )


@pytest.mark.parametrize("post, prefix", [(None, []), ("<s> $A", ["<s>"]), ("$A <eos>", []), ("<s> $A <eos>", ["<s>"])])
def test_the_tokenizers_leading_special_tokens_once_and_never_an_appended_eos(post, prefix):
    tokenizer = char_tokenizer(post)
    bos = tokenizer.convert_tokens_to_ids("<s>")
    assert leading_special_ids(tokenizer) == tokenizer.convert_tokens_to_ids(prefix)
    plain = tokenizer("Q: 1+2", add_special_tokens=False)["input_ids"]
    ids = tokenize_prompts(tokenizer, ["Q: 1+2", "<s>Q: 1+2"])
    assert ids[0] == [bos] * len(prefix) + plain  # added when the tokenizer adds it
    assert ids[1] == [bos] + plain  # a prompt that wrote it keeps one
    assert tokenize_prompts(tokenizer, []) == []


@pytest.mark.parametrize("fmt", ["template", "chat"])
def test_trainer_prompts_start_with_one_bos_for_a_bos_adding_tokenizer(tmp_path, fmt):
    model_dir = chat_model_dir(tmp_path, "llama3")  # its tokenizer adds <|begin_of_text|>; its template writes it
    prompt = {
        "format": fmt,
        "answer": "last_number",
        "template": "Question: {problem}" + ("\nAnswer:" * (fmt == "template")),
    }
    trainer = Trainer(dataset_config(model_dir, tmp_path, prompt, max_new_tokens=4))
    try:
        bos = trainer.parts.tokenizer.convert_tokens_to_ids("<|begin_of_text|>")
        for ids in trainer.parts.prompt_ids.values():
            assert ids[0] == bos and ids.count(bos) == 1
        trainer.train_step(1)
    finally:
        trainer.close()
