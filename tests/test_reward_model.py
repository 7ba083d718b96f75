"""Reward models: loading checks (one line each), rendering, and batched scores equal to the model's own
forward of each text alone (``model(**tok(text)).logits[:, 0]``), with left and right padding."""

from __future__ import annotations

import pytest
import torch
from reward_model_fixtures import CHAT_TEMPLATE, save_reward_model

from grpolab.models.reward_model import RewardModel, padded_batch
from grpolab.tasks.reward_model_spec import reward_model_spec

TEXTS = [
    "1+2=<think> 1+2=3 </think> <answer> 3 </answer>",
    "9+9=",
    "a much longer text " * 5,
    "x",
    "4+4=<think> 4+4=8 </think> <answer> 8 </answer>",
]


def spec(path, **options):
    return reward_model_spec(f"model:{path}", None, 1.0, options)


def by_hand(rm: RewardModel, texts: list[str]) -> list[float]:
    """Each text alone, through the model's own forward as a user would call it."""
    out = []
    for text in texts:
        inputs = rm.tokenizer(text, return_tensors="pt", add_special_tokens=not rm.has_template)
        out.append(rm.model(**inputs).logits[:, 0].item())
    return out


def test_padded_batch_counts_positions_of_real_tokens():
    ids, mask, positions = padded_batch([[5, 6, 7], [8]], pad_id=0, side="left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    ids, mask, positions = padded_batch([[5, 6, 7], [8]], pad_id=0, side="right")
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and positions.tolist() == [[0, 1, 2], [0, 0, 0]]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("batch_size", [1, 2, 16])
def test_batched_scores_equal_the_models_own_forward(reward_model_dir, side, batch_size):
    rm = RewardModel.load(spec(reward_model_dir, batch_size=batch_size), torch.device("cpu"))
    rm.tokenizer.padding_side = side
    scores = rm.score(TEXTS)
    expected = by_hand(rm, TEXTS)
    assert len(set(expected)) == len(expected)  # the texts score differently: the order is checked too
    assert scores == pytest.approx(expected, abs=1e-5)


def test_chat_template_renders_messages_and_completion(tmp_path, tokenizer):
    rm = RewardModel.load(
        spec(save_reward_model(tmp_path / "rm", tokenizer, chat_template=CHAT_TEMPLATE)), torch.device("cpu")
    )
    messages = [{"role": "user", "content": "2+2"}]
    text = rm.render(messages, "policy prompt: 2+2 ", "4")
    assert text == "<user>2+2<eos><assistant>4<eos>"
    assert rm.token_ids(text)[0] != rm.tokenizer.bos_token_id  # the template's own text, nothing added
    assert rm.score([text, "<user>x<eos>"]) == pytest.approx(by_hand(rm, [text, "<user>x<eos>"]), abs=1e-5)


def test_without_chat_template_prompt_and_completion_are_concatenated(reward_model_dir):
    rm = RewardModel.load(spec(reward_model_dir), torch.device("cpu"))
    assert rm.render([{"role": "user", "content": "ignored"}], "Q: 2+2 A:", " 4") == "Q: 2+2 A: 4"


def test_score_runs_in_bfloat16(reward_model_dir):
    rm = RewardModel.load(spec(reward_model_dir, dtype="bfloat16"), torch.device("cpu"))
    assert next(rm.model.parameters()).dtype == torch.bfloat16
    full = RewardModel.load(spec(reward_model_dir), torch.device("cpu"))
    assert rm.score(TEXTS) == pytest.approx(full.score(TEXTS), abs=0.1)
    assert not any(p.requires_grad for p in rm.model.parameters())


def test_too_long_is_an_error_unless_truncated_left(reward_model_dir):
    rm = RewardModel.load(spec(reward_model_dir, max_length=8), torch.device("cpu"))
    with pytest.raises(ValueError, match="longer than max_length 8; set options.truncate"):
        rm.score(["0123456789"])
    left = RewardModel.load(spec(reward_model_dir, max_length=8, truncate="left"), torch.device("cpu"))
    assert left.token_ids("0123456789") == left.tokenizer("23456789")["input_ids"]
    assert left.score(["0123456789"]) == pytest.approx(left.score(["23456789"]), abs=1e-6)


def test_bad_reward_models_are_one_line(tmp_path, tokenizer, tiny_model_dirs):
    with pytest.raises(ValueError, match="no config.json"):
        spec(tmp_path / "missing")
    with pytest.raises(ValueError, match="not a sequence-classification model .architectures: LlamaForCausalLM"):
        spec(tiny_model_dirs["llama"])
    with pytest.raises(ValueError, match="has 2 labels; a reward model has one output"):
        spec(save_reward_model(tmp_path / "two", tokenizer, num_labels=2))
    with pytest.raises(ValueError, match=r"options.normalize: Input should be 'none', 'batch' or 'running'"):
        spec(tmp_path, normalize="zscore")
    no_pad = save_reward_model(tmp_path / "no_pad", tokenizer, pad=False)
    with pytest.raises(
        ValueError, match="its tokenizer has no pad token; set options.pad_token .e.g. its EOS token '<eos>'"
    ):
        RewardModel.load(spec(no_pad), torch.device("cpu"))
    with pytest.raises(ValueError, match="pad_token 'nope' is not one of its tokenizer's tokens"):
        RewardModel.load(spec(no_pad, pad_token="nope"), torch.device("cpu"))
    rm = RewardModel.load(spec(no_pad, pad_token="<eos>"), torch.device("cpu"))
    assert rm.tokenizer.pad_token_id == rm.tokenizer.eos_token_id == rm.model.config.pad_token_id
