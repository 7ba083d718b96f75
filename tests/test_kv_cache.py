"""ReservedLayer: transformers' DynamicLayer with in-place appends, against DynamicLayer itself."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from grpolab.rollout.hf.kv_cache import ReservedLayer, reserved_cache


@pytest.mark.parametrize("capacity", [3, 9, 40])  # smaller than the prefill, mid-decode, room for all
def test_reserved_layer_holds_what_a_dynamic_layer_holds(capacity):
    """Prefill 6 positions of 4 rows, repeat rows, append single positions and drop rows in between: the
    keys and values (and the length) are those of DynamicLayer at every step; appends after the first
    allocation that fits write in place, and so do row drops whose moved rows all come from past the
    rows kept."""
    torch.manual_seed(0)
    ours, theirs = ReservedLayer(capacity), DynamicLayer()
    steps = [
        ("update", 6),
        ("select", [0, 0, 1, 2, 3, 3]),
        ("update", 1),
        ("update", 1),
        ("select", [0, 5, 2, 4]),
        ("select", [3, 1, 2]),
        ("update", 1),
        ("select", [2]),
        ("update", 2),
    ]
    # the selections decode's compaction makes (every moved row from past the kept count) stay in place
    in_place = {(0, 5, 2, 4): True, (3, 1, 2): True, (2,): True, (0, 0, 1, 2, 3, 3): False}
    rows = 4
    for op, arg in steps:
        if op == "update":
            k, v = torch.randn(rows, 2, arg, 3), torch.randn(rows, 2, arg, 3)
            before = ours._keys if ours.is_initialized else None
            a, b = ours.update(k, v), theirs.update(k, v)
            if before is not None and ours.length <= before.shape[-2]:
                assert ours._keys is before  # written in place
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
        else:
            index, storage = torch.tensor(arg), ours._keys.untyped_storage().data_ptr()
            ours.batch_select_indices(index)
            assert (ours._keys.untyped_storage().data_ptr() == storage) == in_place[tuple(arg)]
            theirs.batch_select_indices(index)
            rows = len(arg)
        assert ours.get_seq_length() == theirs.get_seq_length()
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)


def test_a_model_decodes_over_a_reserved_cache_as_over_a_dynamic_one(make_tiny_model):
    """A prefill then three decoding steps of a tiny Llama: the logits are identical with either cache."""
    model = make_tiny_model("llama")
    torch.manual_seed(1)
    ids = torch.randint(3, 60, (3, 7))
    logits = []
    for cache in (reserved_cache(model.config, 10), DynamicCache(config=model.config)):
        assert any(isinstance(layer, ReservedLayer) for layer in cache.layers) == (not logits)
        out, steps = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1], []
        for _ in range(3):
            token = out.argmax(-1, keepdim=True)
            out = model(input_ids=token, past_key_values=cache, use_cache=True).logits[:, -1]
            steps.append(out)
        logits.append(torch.stack(steps))
    assert torch.equal(logits[0], logits[1])
