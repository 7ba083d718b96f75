"""The policy object (``grpolab.models.policy``) and the typed, versioned weights it hands an engine
(``grpolab.models.weights``): full or LoRA, each kind of weights what the engine's sync reads, loading in the
order and from the RNG draws the run always used."""

from __future__ import annotations

import pytest
import torch

from grpolab.config import LoraSettings
from grpolab.models.loading import load_policy
from grpolab.models.lora import AdapterWeights, MergedWeights, add_adapter
from grpolab.models.policy import FullPolicy, LoraPolicy, load_run_policy, policy_start
from grpolab.models.precision import resolve_precision
from grpolab.models.weights import ModelWeights, PolicyWeights

FP32 = resolve_precision("fp32_master", torch.float32)
CPU = torch.device("cpu")
LORA = LoraSettings(rank=2, alpha=4)


def test_a_full_policy_hands_its_own_weights(warm_model_dir):
    policy = load_run_policy(warm_model_dir, warm_model_dir, FP32, CPU, lora=None, seed=0, sharded=False)
    assert isinstance(policy, FullPolicy) and policy.copy_kinds == ("full",) and policy.adapter_rank is None
    weights = policy.weights("full", 7)
    assert isinstance(weights, ModelWeights) and weights.kind == "full" and weights.version == 7
    assert weights.model is policy.model
    assert [(n, p) for n, p in weights.named_parameters()] == list(policy.model.named_parameters())
    assert list(weights.parameters()) == list(policy.model.parameters())
    with pytest.raises(ValueError, match="has no merged weights"):
        policy.weights("merged", 0)
    assert policy.start_files == warm_model_dir and policy.files_are_policy
    assert policy.saved is policy.model and policy.saved_state({"w": torch.ones(1)}).keys() == {"w"}
    assert policy.reference is None
    policy.add_reference()  # a frozen copy of the start policy
    assert policy.reference is not policy.model and not any(p.requires_grad for p in policy.reference.parameters())
    assert all(torch.equal(a, b) for a, b in zip(policy.reference.parameters(), policy.model.parameters()))
    with policy.reference_context():
        pass
    assert "parameters on cpu" in policy.describe() and "LoRA" not in policy.describe()


def test_a_lora_policy_is_the_adapter_the_run_always_made(warm_model_dir):
    """Loading through the policy draws the adapter's initial A from the run's seed exactly as before: the same
    base in the compute dtype, then ``add_adapter`` with the seed; the global RNG is left as it was."""
    torch.manual_seed(123)
    policy = load_run_policy(warm_model_dir, warm_model_dir, FP32, CPU, lora=LORA, seed=5, sharded=False)
    after = torch.rand(1)
    torch.manual_seed(123)
    expected = add_adapter(load_policy(warm_model_dir, FP32.compute, CPU)[0], LORA, 5, warm_model_dir)
    assert torch.equal(after, torch.rand(1))
    ours, theirs = dict(policy.model.named_parameters()), dict(expected.model.named_parameters())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    assert isinstance(policy, LoraPolicy) and policy.adapter_rank == 2 and "LoRA rank 2" in policy.describe()
    assert policy.copy_kinds == ("merged", "adapter")
    assert not policy.files_are_policy and policy.start_files == warm_model_dir  # the base's: a sync follows
    assert policy.saved is policy.adapter
    assert set(policy.saved_state({"model.norm.weight": torch.ones(1)})) == {"base_model.model.model.norm.weight"}
    policy.add_reference()
    assert policy.reference is policy.model
    with torch.no_grad():  # move B so the adapter changes the policy: off, the reference is the base again
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
    ids = torch.tensor([[3, 4, 5, 6]])
    base = load_policy(warm_model_dir, FP32.compute, CPU)[0]
    with torch.no_grad(), policy.reference_context():
        assert torch.allclose(policy.model(ids).logits, base(ids).logits, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(policy.model(ids).logits, base(ids).logits, atol=1e-3)

    kinds = {kind: policy.weights(kind, 3) for kind in ("full", "merged", "adapter")}
    assert [type(w) for w in kinds.values()] == [ModelWeights, MergedWeights, AdapterWeights]
    for kind, weights in kinds.items():
        assert isinstance(weights, PolicyWeights) and weights.kind == kind and weights.version == 3
        assert weights.model is policy.model
    merged = dict(kinds["merged"].named_parameters())
    assert merged.keys() == dict(base.named_parameters()).keys()  # a plain model's names
    assert all("lora_" in k for k in kinds["adapter"].state)
    with pytest.raises(NotImplementedError):
        kinds["adapter"].named_parameters()


def test_a_lora_checkpoint_as_the_start_is_refused_without_its_settings(warm_model_dir, tmp_path):
    checkpoint = tmp_path / "lora_checkpoint"
    add_adapter(load_policy(warm_model_dir)[0], LORA, 0, warm_model_dir).save_pretrained(checkpoint)
    assert policy_start(warm_model_dir, None, needs_reference=True) == (warm_model_dir, None)
    assert policy_start(checkpoint, LORA, needs_reference=False) == (warm_model_dir, checkpoint)
    with pytest.raises(ValueError, match="is a LoRA checkpoint: set \\[model.lora\\]"):
        policy_start(checkpoint, None, needs_reference=False)
    with pytest.raises(ValueError, match="cannot start from it"):
        policy_start(checkpoint, LORA, needs_reference=True)
    policy = load_run_policy(
        warm_model_dir, warm_model_dir, FP32, CPU, lora=LORA, seed=1, sharded=False, started_from=checkpoint
    )  # continues the checkpoint's adapter, not a fresh one
    saved = add_adapter(load_policy(warm_model_dir)[0], LORA, 0, warm_model_dir).model
    assert all(
        torch.equal(p, dict(saved.named_parameters())[n]) for n, p in policy.model.named_parameters() if "lora_A" in n
    )


def test_vllm_takes_each_kind_of_weights_the_way_it_always_did(warm_model_dir, tmp_path):
    """A call-recording stand-in for the GPU transfer (CUDA IPC does not run here): the training model's own
    weights go as the module itself (its one sender kept), merged weights as they are, weights on the CPU
    through a folder of safetensors, an adapter through peft's files."""
    from types import SimpleNamespace

    from safetensors.torch import load_file

    from grpolab.rollout.vllm.engine import VLLMEngine

    class OnCuda:  # what the engine checks before it sends over CUDA IPC
        def parameters(self):
            return iter([SimpleNamespace(is_cuda=True)])

    class CudaModelWeights(OnCuda, ModelWeights):
        pass

    class CudaMergedWeights(OnCuda, MergedWeights):
        pass

    calls = []
    engine = VLLMEngine.__new__(VLLMEngine)  # no engine processes: its pushes are recorded
    engine.weight_sync, engine.dtype, engine._sync_dir = "cuda_ipc", None, tmp_path
    engine._reload = lambda push, restore=None: push()
    engine._sync_cuda_ipc = lambda source: calls.append(("ipc", source))
    engine.sync_from_folder = lambda folder: calls.append(("folder", str(folder)))
    engine.sync_adapter_from_folder = lambda folder: calls.append(("adapter", str(folder)))

    full = load_run_policy(warm_model_dir, warm_model_dir, FP32, CPU, lora=None, seed=0, sharded=False)
    engine.sync_weights(CudaModelWeights(full.model, 1))
    assert calls.pop() == ("ipc", full.model)
    engine.sync_weights(full.weights("full", 1))  # on the CPU: a folder
    assert calls.pop() == ("folder", str(tmp_path))
    written = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(written[n], p) for n, p in full.model.named_parameters())

    lora = load_run_policy(warm_model_dir, warm_model_dir, FP32, CPU, lora=LORA, seed=0, sharded=False)
    merged = CudaMergedWeights(lora.model, 2)
    engine.sync_weights(merged)
    assert calls.pop() == ("ipc", merged)
    engine.sync_weights(lora.weights("adapter", 2))
    assert calls.pop() == ("adapter", str(tmp_path / "adapter"))
    assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file() and not calls
