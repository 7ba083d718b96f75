"""Tiny model: BPE tokenizer, random model, cached supervised warm start (all real HF objects)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.models.tinymodel import (
    TAGS,
    WarmStartSettings,
    build_model,
    build_tokenizer,
    default_cache_root,
    save_checked,
    warm_start_key,
    warm_start_model,
)
from grpolab.tasks import ArithmeticTask, grade_r1_zero

TASK = ArithmeticTask(n_train=64, n_val=8)
TINY = WarmStartSettings(steps=3, batch_size=8, hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TASK.prompt(e) + e.solution for e in TASK.train_examples())


def test_round_trip_of_prompt_and_solution(tokenizer) -> None:
    for ex in TASK.validation_examples():
        text = TASK.prompt(ex) + ex.solution
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
        with_eos = ids + [tokenizer.eos_token_id]
        completion = tokenizer.decode(
            with_eos[len(tokenizer(TASK.prompt(ex))["input_ids"]) :], skip_special_tokens=True
        )
        assert completion == ex.solution
        assert grade_r1_zero(completion, ex.answer, truncated=False).reward == 1.0


def test_prompt_and_completion_tokenize_independently(tokenizer) -> None:
    ex = TASK.validation_examples()[0]
    prompt, solution = TASK.prompt(ex), ex.solution
    joint = tokenizer(prompt + solution)["input_ids"]
    assert joint == tokenizer(prompt)["input_ids"] + tokenizer(solution)["input_ids"]


def test_preamble_is_cheap(tokenizer) -> None:
    assert len(tokenizer(TASK.prompt(TASK.validation_examples()[0]))["input_ids"]) < 60


def test_tags_are_single_tokens_and_kept_by_decode(tokenizer) -> None:
    for tag in TAGS:
        ids = tokenizer(tag, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 and tokenizer.convert_ids_to_tokens(ids) == [tag]
    ids = tokenizer(" </think> <answer> 7 </answer>")["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == " </think> <answer> 7 </answer>"


def test_digits_split_one_per_token(tokenizer) -> None:
    ids = tokenizer("1234567890", add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == list("1234567890")
    ids = tokenizer(" 68 ", add_special_tokens=False)["input_ids"]
    assert len(ids) == 4


def test_special_tokens_and_any_text(tokenizer) -> None:
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    assert tokenizer.eos_token_id != tokenizer.pad_token_id
    assert (
        tokenizer(TASK.prompt(TASK.train_examples()[0]))["input_ids"][0] != tokenizer.eos_token_id
    )  # no BOS/EOS added
    text = "Unseen text: é ☃ 中文 {x} \t tabs"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_save_load_round_trip_gives_identical_logits(tokenizer, tmp_path, arch: str) -> None:
    torch.manual_seed(0)
    model = build_model(tokenizer, arch, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=64).eval()
    assert model.config.model_type == arch and model.config.vocab_size == len(tokenizer)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    text = TASK.prompt(TASK.validation_examples()[0])
    assert loaded_tok(text)["input_ids"] == tokenizer(text)["input_ids"]
    ids = torch.tensor([tokenizer(text)["input_ids"]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


def test_arch_whose_tokenizer_does_not_reload_is_refused(tokenizer, tmp_path) -> None:
    model = build_model(tokenizer, "qwen2", hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    with pytest.raises(ValueError, match="qwen2"):
        save_checked(model, tokenizer, tmp_path, probe=TASK.prompt(TASK.validation_examples()[0]))


def test_default_model_is_about_a_million_parameters(tokenizer) -> None:
    model = build_model(tokenizer)
    assert 0.8e6 < sum(p.numel() for p in model.parameters()) < 1.5e6


def test_warm_start_caches_and_reloads(tmp_path) -> None:
    path = warm_start_model(TASK, TINY, cache_dir=tmp_path)
    assert path.parent == tmp_path and path.name == warm_start_key(TASK, TINY)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp folders left behind
    info = json.loads((path / "warm_start.json").read_text())
    assert len(info["losses"]) == TINY.steps and info["settings"] == TINY.model_dump()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.eos_token_id == tok.eos_token_id and model.config.pad_token_id == tok.pad_token_id
    stamps = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert warm_start_model(TASK, TINY, cache_dir=tmp_path) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == stamps  # reused, not retrained


def test_warm_start_is_deterministic_and_learns(tmp_path) -> None:
    settings = TINY.model_copy(update={"steps": 8, "lr": 1e-2})
    a = AutoModelForCausalLM.from_pretrained(warm_start_model(TASK, settings, cache_dir=tmp_path / "a"))
    b = AutoModelForCausalLM.from_pretrained(warm_start_model(TASK, settings, cache_dir=tmp_path / "b"))
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(pa, pb), name
    losses = json.loads((tmp_path / "a" / warm_start_key(TASK, settings) / "warm_start.json").read_text())["losses"]
    assert losses[-1] < losses[0]


def test_cache_key_depends_on_settings_and_data() -> None:
    key = warm_start_key(TASK, TINY)
    assert key == warm_start_key(ArithmeticTask(n_train=64, n_val=8), TINY)
    assert key != warm_start_key(TASK, TINY.model_copy(update={"seed": 1}))
    assert key != warm_start_key(ArithmeticTask(n_train=64, n_val=8, seed=1), TINY)


def test_cache_root_respects_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("GRPOLAB_CACHE", str(tmp_path))
    assert default_cache_root() == tmp_path / "tiny"
    monkeypatch.delenv("GRPOLAB_CACHE")
    assert default_cache_root().parts[-3:] == (".cache", "grpolab", "tiny")


def test_settings_reject_unknown_fields() -> None:
    with pytest.raises(ValueError):
        WarmStartSettings(stepz=3)  # type: ignore[call-arg]
