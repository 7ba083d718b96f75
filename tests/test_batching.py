"""collate / TrainBatch: padding, masks, log-prob alignment, select, to."""

from __future__ import annotations

import pytest
import torch

from grpolab.learning.batching import TrainBatch, collate
from grpolab.rollout.base import Completion

PAD = 0


def _completion(prompt: list[int], completion: list[int], reason="stop") -> Completion:
    return Completion(
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.1 * (i + 1) for i in range(len(completion))],
        finish_reason=reason,
        text="",
    )


@pytest.fixture
def batch() -> TrainBatch:
    return collate(
        [
            _completion([5, 6, 7], [8, 9]),  # length 5
            _completion([5], [10, 11, 12, 13, 2], "length"),  # length 6
            _completion([5, 6], [14]),  # length 3
        ],
        pad_id=PAD,
    )


def test_shapes_and_dtypes(batch):
    assert len(batch) == 3
    assert batch.input_ids.shape == (3, 6) and batch.input_ids.dtype == torch.long
    assert batch.attention_mask.dtype == torch.long
    assert batch.response_mask.dtype == torch.float32 and batch.engine_logprobs.dtype == torch.float32
    assert batch.prompt_lens.tolist() == [3, 1, 2] and batch.completion_lens.tolist() == [2, 5, 1]
    assert batch.num_response_tokens == 8


def test_tokens_and_masks(batch):
    assert batch.input_ids.tolist() == [
        [5, 6, 7, 8, 9, PAD],
        [5, 10, 11, 12, 13, 2],
        [5, 6, 14, PAD, PAD, PAD],
    ]
    assert batch.attention_mask.tolist() == [[1] * 5 + [0], [1] * 6, [1] * 3 + [0] * 3]
    assert batch.response_mask.tolist() == [
        [0, 0, 0, 1, 1, 0],
        [0, 1, 1, 1, 1, 1],  # the final EOS (2) is a response token
        [0, 0, 1, 0, 0, 0],
    ]


def test_engine_logprobs_sit_on_their_tokens(batch):
    lp = batch.engine_logprobs
    assert torch.allclose(lp[0], torch.tensor([0, 0, 0, -0.1, -0.2, 0]))
    assert torch.allclose(lp[1], torch.tensor([0, -0.1, -0.2, -0.3, -0.4, -0.5]))
    assert torch.allclose(lp[2], torch.tensor([0, 0, -0.1, 0, 0, 0]))
    assert (lp[batch.response_mask == 0] == 0).all()


def test_select_trims_to_longest_row(batch):
    sub = batch.select([2, 0])
    assert sub.input_ids.tolist() == [[5, 6, 14, PAD, PAD], [5, 6, 7, 8, 9]]
    assert sub.response_mask.shape == (2, 5) and sub.engine_logprobs.shape == (2, 5)
    assert sub.prompt_lens.tolist() == [2, 3] and sub.completion_lens.tolist() == [1, 2]
    one = batch.select(torch.tensor([2]))
    assert one.input_ids.tolist() == [[5, 6, 14]]
    assert torch.equal(batch.select([0, 1, 2]).input_ids, batch.input_ids)
    with pytest.raises(ValueError):
        batch.select([])


def test_to_device(batch):
    moved = batch.to("cpu")
    assert isinstance(moved, TrainBatch)
    assert torch.equal(moved.input_ids, batch.input_ids)
    moved64 = batch.to(torch.device("cpu"))
    assert moved64.response_mask.device.type == "cpu"


def test_empty_completion_and_errors():
    b = collate([_completion([4, 5], []), _completion([4], [6])], pad_id=PAD)
    assert b.response_mask.sum().item() == 1
    assert b.input_ids.tolist() == [[4, 5], [4, 6]]
    with pytest.raises(ValueError):
        collate([], pad_id=PAD)
    with pytest.raises(ValueError):
        Completion(prompt_ids=[1], completion_ids=[2, 3], logprobs=[0.0], finish_reason="stop", text="")


def test_an_eos_that_is_also_the_pad_token_is_trained():
    """SmolLM2's ``<|im_end|>`` (id 2) is EOS and pad: the EOS that ends a completion is a response token
    and attended to, the padding after a shorter row is not."""
    eos = 2
    b = collate([_completion([5, 6], [7, eos]), _completion([5, 6], [eos])], pad_id=eos)
    assert b.input_ids.tolist() == [[5, 6, 7, eos], [5, 6, eos, eos]]
    assert b.response_mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
