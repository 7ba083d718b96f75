"""The policy's own dropout is off for the whole run: the update's forwards (train mode, for gradient
checkpointing) compute the same policy as the eval-mode forwards that froze the old log-probs, so the
first optimizer step of a multi-update schedule sees ratios of exactly 1."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import first_update_of_gspo
from tiny_configs import tiny_sizes
from transformers import AutoConfig, AutoModelForCausalLM

P = 0.1
FAMILIES = {  # every dropout field each family's config has, at 0.1
    "qwen2": dict(attention_dropout=P),
    "llama": dict(attention_dropout=P),
    "gpt2": dict(resid_pdrop=P, embd_pdrop=P, attn_pdrop=P),
    "opt": dict(dropout=P, attention_dropout=P, activation_dropout=P, layerdrop=P),
    "phi": dict(resid_pdrop=P, embd_pdrop=P, attention_dropout=P),
    "gpt_neox": dict(attention_dropout=P, hidden_dropout=P),
    # reads config.attention_dropout / hidden_dropout inside its forward, not a module attribute
    "falcon": dict(attention_dropout=P, hidden_dropout=P),
    "gpt_neo": dict(attention_dropout=P, embed_dropout=P, resid_dropout=P),
}
SIZES = tiny_sizes(vocab_size=64, num_key_value_heads=4, max_position_embeddings=64)
SIZES_OF = {
    "gpt2": dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64),
    "opt": dict(SIZES, ffn_dim=64, word_embed_proj_dim=32),
    "gpt_neo": dict(SIZES, num_layers=2, num_heads=4, attention_types=[[["global"], 2]]),
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_train_mode_forward_equals_eval_mode_once_dropout_is_off(family):
    from grpolab.models.dropout import disable_dropout

    config = AutoConfig.for_model(family, **SIZES_OF.get(family, SIZES), **FAMILIES[family])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    ids = torch.randint(0, 64, (3, 20))
    with torch.no_grad():
        model.train()
        noisy = model(ids).logits
        model.eval()
        clean = model(ids).logits
    assert not torch.equal(noisy, clean), "the fixture must have dropout that acts in train mode"
    switched = disable_dropout(model)
    assert switched, "what was switched off is named"
    model.train()
    with torch.no_grad():
        for _ in range(3):
            assert torch.equal(model(ids).logits, clean)
    # the model's config says what it computes (a checkpoint records the dropout it was trained with)
    assert all(getattr(model.config, k) == 0 for k in FAMILIES[family])


def test_first_update_of_a_multi_update_preset_has_ratio_exactly_one(warm_model_dir, tmp_path):
    """A warm-started model with attention_dropout 0.1, one GSPO step (4 optimizer steps): the first
    update's logged ratios are exactly 1 (with dropout on in the update: 0.38-1.12, mean 0.82)."""
    model_dir = tmp_path / "model"
    shutil.copytree(warm_model_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "attention_dropout": P}))
    record = first_update_of_gspo(model_dir, tmp_path / "run")
    assert record["first_update/ratio_mean"] == 1.0
