"""Rollout engine on vLLM, colocated with training, weights synced every step, the sync checked.

``VLLMEngine`` follows the ``grpolab.rollout.base`` contract exactly like ``HFEngine`` (EOS and
stop-string tokens kept last, finish reasons "stop"/"length", ``Completion.logprobs`` =
log-softmax(logits / temperature) of the sampled token, untruncated). vLLM runs with
``logprobs_mode="processed_logprobs"`` (after temperature and top-k/top-p): with top-k/top-p
disabled that is the contract, so top-k/top-p sampling is refused rather than reported with
renormalised log-probs (vLLM's "raw" modes are at temperature 1).

``sync_weights(weights)`` (a ``grpolab.models.weights.PolicyWeights``): "file" (CPU, any device) writes the
parameters as safetensors into a private folder and reloads them in the workers
(``grpolab.rollout.vllm.worker.WorkerExtension``, which also fixes the CPU backend's stale packed lm_head with
tied embeddings); "cuda_ipc" (GPU only, not run here) uses vLLM's CUDA-IPC weight transfer. With ``lora_rank``
the engine serves the base with vLLM's own LoRA, and a LoRA run's sync (weights of kind ``adapter``) moves only
the adapter, reloaded in place under one adapter id. The prefix cache is reset after a sync. Sleep
mode (``sleep_level`` 1/2, CUDA/ROCm/XPU only; skipped with a logged note elsewhere) frees the
accelerator between rollouts; level 2 discards the weights, so the engine pushes the latest ones
again (last sync, else the checkpoint) whenever it wakes to generate (see ``VLLMEngine._wake``).
The sync check is ``grpolab.rollout.sync_check``; the engine in a process of its own (under another
interpreter, or for async rollouts) is ``grpolab.rollout.vllm.apart``.

vLLM is imported lazily. Creating an engine
spawns engine-core processes: scripts need an ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from torch import nn

from grpolab.models.routing import routers
from grpolab.models.weights import PolicyWeights
from grpolab.rollout.base import Completion, SamplingParams, collect_eos_ids, let_an_interrupt_land
from grpolab.rollout.capabilities import VLLM_CAPABILITIES, VLLM_MAX_TEMPERATURE

__all__ = ["VLLM_CAPABILITIES", "VLLM_MAX_TEMPERATURE", "VLLMEngine", "request_seed", "save_weights"]


logger = logging.getLogger(__name__)
WeightSync = Literal["auto", "file", "cuda_ipc"]
_SEED_STRIDE = 1_000_003
_SEED_LIMIT = 2**63  # every seed vLLM uses stays an int64 (it seeds a torch.Generator per request)
WORKER_EXTENSION = "grpolab.rollout.vllm.worker.WorkerExtension"
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm.config.lora.MaxLoRARanks
POLICY_ADAPTER = "policy"  # the name (and id 1) of the one adapter an engine with LoRA serves


# ---- helpers ---------------------------------------------------------------------------------
def request_seed(seed: int | None, prompt_index: int, n: int) -> int | None:
    """Seed of prompt ``prompt_index``'s request of ``n`` samples.

    vLLM splits an n > 1 request into n child requests and seeds child j with ``seed + j``
    (``ParentRequest._get_child_sampling_params``, vllm/v1/engine/parallel_sampling.py). Request i
    gets the block ``[s, s + n)`` with ``s = n * ((seed * stride + i) mod (2**63 // n))``: the
    blocks of one call's requests never overlap, and ``s + n - 1 < 2**63`` for any ``seed``.
    """
    if seed is None:
        return None
    return n * ((seed * _SEED_STRIDE + prompt_index) % (_SEED_LIMIT // n))


def checkpoint_tensors(model: nn.Module, tensors: dict) -> dict:
    """``tensors`` (``model``'s parameters by name) as its checkpoint files name and shape them: transformers 5
    loads some families converted (an MoE's per-expert weights fused into one [E, ...] tensor) and saves them
    reverted (``revert_weight_conversion``); vLLM's loaders read the checkpoint format. ``model``: a transformers
    model, or ``PolicyWeights`` of one; others are left as they are."""
    from transformers import PreTrainedModel
    from transformers.core_model_loading import revert_weight_conversion

    source = model.model if isinstance(model, PolicyWeights) else model
    return revert_weight_conversion(source, tensors) if isinstance(source, PreTrainedModel) else tensors


def save_weights(model: nn.Module | PolicyWeights, folder: str | Path, dtype: str | None = None) -> Path:
    """Write ``model``'s parameters (tied ones once, as named_parameters lists them) as safetensors in its
    checkpoint format (``checkpoint_tensors``), cast to ``dtype`` (the engine's, e.g. "bfloat16" from float32
    master weights) when given."""
    import torch
    from safetensors.torch import save_file

    path = Path(folder) / "model.safetensors"
    cast = getattr(torch, dtype) if dtype else None
    tensors = {name: p.detach().to("cpu", dtype=cast).contiguous() for name, p in model.named_parameters()}
    save_file({k: v.contiguous() for k, v in checkpoint_tensors(model, tensors).items()}, str(path))
    return path


def _empty_cuda_cache() -> None:
    """Before vLLM maps memory again: hand the blocks PyTorch's caching allocator keeps in *this*
    process (freed training activations and gradients) back to the driver. vLLM's own
    ``CuMemAllocator.wake_up`` (vllm/device_allocator/cumem.py) empties the cache of the engine-core
    process, by default not this one."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _context_len(model_dir: str) -> int:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir).get_text_config()
    return int(getattr(config, "max_position_embeddings", 0) or 0)


def _generation_eos(model_dir: str) -> int | list[int] | None:
    """The checkpoint's generation_config EOS id(s), if it has a generation config."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(model_dir).eos_token_id
    except OSError:
        return None


def lora_engine_kwargs(model_dir: str, rank: int) -> dict[str, Any]:
    """``vllm.LLM`` settings that serve one adapter of rank ``rank`` on the model in ``model_dir``; refuses
    (one line) an architecture vLLM has without LoRA support, or a rank above vLLM's largest."""
    from transformers import AutoConfig
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora

    max_rank = next((r for r in VLLM_LORA_RANKS if r >= rank), None)
    if max_rank is None:
        raise ValueError(
            f"model.lora.rank {rank}: vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]}; "
            "use rollout.vllm.lora_sync 'merged'"
        )
    for arch in AutoConfig.from_pretrained(model_dir).architectures or []:
        entry = ModelRegistry.models.get(arch)  # absent: vLLM's Transformers backend, which has LoRA
        if entry is not None and not supports_lora(entry.load_model_cls()):
            raise ValueError(f"vLLM has no LoRA support for {arch}: use rollout.vllm.lora_sync 'merged'")
    return {"enable_lora": True, "max_lora_rank": max_rank, "max_loras": 1}


# ---- the engine ------------------------------------------------------------------------------
class VLLMEngine:
    """``RolloutEngine`` on a vLLM ``LLM`` created once per run from ``model_dir``.

    model_dir: a saved transformers checkpoint (with its tokenizer) of the policy's architecture.
    tokenizer: decodes ``Completion.text`` and gives the EOS id; default: loaded from model_dir.
    dtype: vLLM weight/activation dtype ("float32" on CPU; match the trainer's for a tight check).
    gpu_memory_utilization: GPU share for vLLM (weights + KV cache); leave room for the trainer.
    kv_cache_bytes: explicit KV-cache size (bytes); CPU default 256 MiB unless
        VLLM_CPU_KVCACHE_SPACE is set.
    sleep_level: 1 or 2 to sleep between rollouts (weights offloaded / discarded, KV freed) where
        the platform supports it; None never sleeps. After a level-2 sleep the latest weights
        (last ``sync_weights`` / ``sync_from_folder``, else ``model_dir``) are pushed again.
    weight_sync: "file", "cuda_ipc" or "auto" (cuda_ipc on a CUDA platform, else file).
    eos_token_ids: ids that end generation; default tokenizer EOS + generation_config EOS.
    lora_rank: serve one LoRA adapter of this rank with vLLM's LoRA (synced with ``AdapterWeights``).
    untie_head: serve a tied model with an output layer of its own (a LoRA policy that trains its head in full:
    its merged weights carry ``lm_head.weight`` beside the base's embedding); it starts on placeholder
    weights, so sync before generating.
    llm_kwargs: passed on to ``vllm.LLM``.
    """

    capabilities = VLLM_CAPABILITIES

    def __init__(
        self,
        model_dir: str | Path,
        tokenizer=None,
        *,
        dtype: str = "float32",
        seed: int = 0,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.3,
        kv_cache_bytes: int | None = None,
        sleep_level: int | None = None,
        enforce_eager: bool = True,
        weight_sync: WeightSync = "auto",
        eos_token_ids: Sequence[int] | None = None,
        sync_dir: str | Path | None = None,
        lora_rank: int | None = None,
        untie_head: bool = False,
        **llm_kwargs: Any,
    ):
        from vllm import LLM
        from vllm.platforms import current_platform

        if sleep_level not in (None, 1, 2):
            raise ValueError(f"sleep_level must be None, 1 or 2, got {sleep_level}")
        self.model_dir, self.dtype = str(model_dir), dtype
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.tokenizer = tokenizer
        self.eos_token_ids = (
            list(eos_token_ids)
            if eos_token_ids is not None
            else collect_eos_ids(tokenizer, _generation_eos(self.model_dir))
        )
        if not self.eos_token_ids:
            raise ValueError("no EOS token id: pass eos_token_ids")
        cuda = current_platform.is_cuda_alike()
        self.weight_sync = ("cuda_ipc" if cuda else "file") if weight_sync == "auto" else weight_sync
        if self.weight_sync == "cuda_ipc":
            if not cuda:
                raise ValueError("weight_sync='cuda_ipc' needs a CUDA platform")
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # IPC handles are pickled
            from vllm.config import WeightTransferConfig

            llm_kwargs.setdefault("weight_transfer_config", WeightTransferConfig(backend="ipc"))
        if sleep_level is not None and not current_platform.is_sleep_mode_available():
            logger.info(
                "vLLM sleep mode is not supported on this platform (%s): sleep_level=%s ignored",
                current_platform.device_type,
                sleep_level,
            )
            sleep_level = None
        self.sleep_level = sleep_level
        if current_platform.is_cpu():
            if kv_cache_bytes is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
                kv_cache_bytes = 256 << 20
            # a partly prefilled seeded request crashes the CPU sampler ("CPU Generator does not use
            # offset"): never split a prompt, so the step budget must hold a whole context
            context = max_model_len or _context_len(self.model_dir)
            llm_kwargs.setdefault("enable_chunked_prefill", False)
            llm_kwargs.setdefault("max_num_batched_tokens", max(8192, context))
        if kv_cache_bytes is not None:
            llm_kwargs.setdefault("kv_cache_memory_bytes", kv_cache_bytes)
        llm_kwargs.setdefault("use_tqdm_on_load", False)  # no progress bar per weight sync
        if lora_rank is not None:
            llm_kwargs.update(lora_engine_kwargs(self.model_dir, lora_rank))
        if untie_head:
            # vLLM builds a tied model's head as its embedding and skips ``lm_head.*`` when loading: a policy
            # whose head trained apart (LoRA's modules_to_save) needs a head of its own. The base's files hold
            # no lm_head weight, so the engine starts on placeholders and serves nothing until the first sync.
            llm_kwargs["hf_overrides"] = {**llm_kwargs.get("hf_overrides", {}), "tie_word_embeddings": False}
            llm_kwargs["load_format"] = "dummy"
        self._placeholders = untie_head  # no weights of the policy yet: generate refuses until a sync
        self.lora_rank = lora_rank
        self._adapter = None  # the LoRARequest of the synced adapter, once there is one
        self._ipc = None  # CudaIPCWeightSender, built on the first cuda_ipc sync
        self._sleeping: set[str] = set()  # vLLM memory tags now asleep: "weights", "kv_cache"
        self._weights_lost = False  # a level-2 sleep discarded the weights: push them again on waking
        self._push_latest: Callable[[], object] = lambda: self._load_folder(self.model_dir)  # until a sync
        self.llm = LLM(
            model=self.model_dir,
            tokenizer=self.model_dir,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            enable_sleep_mode=sleep_level is not None,
            logprobs_mode="processed_logprobs",
            generation_config="vllm",
            worker_extension_cls=WORKER_EXTENSION,
            disable_log_stats=True,
            **llm_kwargs,
        )
        self._owns_sync_dir = sync_dir is None
        self._sync_dir = Path(sync_dir) if sync_dir is not None else Path(tempfile.mkdtemp(prefix="grpolab-vllm-"))

    # ---- sampling ----
    def sampling_params(self, params: SamplingParams, n: int, seed: int | None):
        """The ``vllm.SamplingParams`` of one prompt's request (n samples)."""
        from vllm import SamplingParams as VSamplingParams

        if params.top_k > 0 or params.top_p < 1.0:
            raise ValueError(
                "VLLMEngine samples with top_k=0 and top_p=1 only: vLLM reports log-probs "
                "renormalised over the top-k/top-p set, not the untruncated ones of the contract"
            )
        if params.temperature > VLLM_MAX_TEMPERATURE:
            raise ValueError(
                f"VLLMEngine: temperature {params.temperature:g} is above vLLM's limit of {VLLM_MAX_TEMPERATURE:g}"
            )
        return VSamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=params.max_new_tokens,
            seed=seed,
            logprobs=0,
            stop=list(params.stop_strings),
            include_stop_str_in_output=True,
            stop_token_ids=self.eos_token_ids,
            ignore_eos=True,  # EOS = exactly eos_token_ids
            skip_special_tokens=False,
            repetition_penalty=1.0,
            min_tokens=0,
        )

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """``n`` completions per prompt, ``[len(prompts)][n]``, prompt order kept."""
        from vllm.inputs import TokensPrompt

        if n < 1:
            raise ValueError("n must be >= 1")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if not prompts:
            return []
        if self._placeholders:
            raise RuntimeError(
                "this vLLM engine was started untied (untie_head) on placeholder weights: "
                "sync_weights before generating"
            )
        k = 1 if params.greedy else n  # vLLM refuses greedy n > 1: sample once, copy (deterministic)
        requests = [
            self.sampling_params(params, k, request_seed(params.seed, params.prompt_index(i), n))
            for i in range(len(prompts))
        ]
        self._wake()
        try:
            outputs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                requests,
                use_tqdm=False,
                **({"lora_request": self._adapter} if self._adapter else {}),
            )
        except Exception:  # e.g. its engine core died of the terminal's Ctrl-C
            let_an_interrupt_land()
            raise
        result = [
            [self._completion(list(p), c) for c in sorted(o.outputs, key=lambda c: c.index)]
            for p, o in zip(prompts, outputs)
        ]
        self._sleep()
        return result if k == n else [[copy.deepcopy(g[0]) for _ in range(n)] for g in result]

    def _completion(self, prompt: list[int], out) -> Completion:
        ids = list(out.token_ids)
        if out.finish_reason not in ("stop", "length"):  # "abort": the engine core was interrupted
            let_an_interrupt_land()
            raise RuntimeError(f"vLLM finished a request with {out.finish_reason!r} ({out.stop_reason!r})")
        if out.logprobs is None or len(out.logprobs) != len(ids):
            raise RuntimeError("vLLM returned no log-prob for some sampled tokens")
        logprobs = [float(step[t].logprob) for step, t in zip(out.logprobs, ids)]
        return Completion(
            prompt_ids=prompt,
            completion_ids=ids,
            logprobs=logprobs,
            finish_reason=out.finish_reason,
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
        )

    # ---- weights ----
    def sync_weights(self, weights: PolicyWeights) -> None:
        """Load the policy's current ``weights`` into the engine (asleep, its weights wake; its KV cache wakes
        at the next ``generate``); kind ``adapter``: only the adapter."""
        if weights.kind == "adapter":
            self.sync_adapter_from_folder(weights.save(self._sync_dir / "adapter", self.dtype))
        elif self.weight_sync == "cuda_ipc" and next(weights.parameters()).is_cuda and not routers(weights.model):
            # (an MoE's fused experts reach vLLM under their checkpoint names, through the folder below); the
            # training model itself is sent as a module, the one sender kept for it
            source = weights.model if weights.kind == "full" else weights
            self._reload(lambda: self._sync_cuda_ipc(source))
        else:
            self.sync_from_folder(save_weights(weights, self._sync_dir, self.dtype).parent)

    def sync_from_folder(self, folder: str | Path) -> None:
        """Reload the weights from a folder of checkpoint-format safetensors (HF parameter names).
        The folder must keep them: a wake from a level-2 sleep reloads from it."""
        folder = str(folder)
        self._reload(lambda: self._load_folder(folder))

    def sync_adapter_from_folder(self, folder: str | Path) -> None:
        """Reload the served adapter from a folder in peft's format (kept: a wake from a level-2 sleep
        reloads the base, then it)."""
        if self.lora_rank is None:
            raise ValueError("this vLLM engine was started without LoRA (lora_rank): it cannot take an adapter")
        folder = str(folder)
        self._reload(
            lambda: self._load_adapter(folder),
            restore=lambda: (self._load_folder(self.model_dir), self._load_adapter(folder)),
        )

    def _load_adapter(self, folder: str) -> None:
        """vLLM's ``add_lora`` with ``load_inplace``: the adapter under the same id is read again from
        ``folder`` once (LRUCacheWorkerLoRAManager.add_adapter, vllm/lora/worker_manager.py); the
        requests then name it without ``load_inplace``, which would reload it at every scheduler step."""
        from vllm.lora.request import LoRARequest

        if not self.llm.llm_engine.add_lora(LoRARequest(POLICY_ADAPTER, 1, folder, load_inplace=True)):
            raise RuntimeError(f"vLLM did not load the adapter in {folder}")
        self._adapter = LoRARequest(POLICY_ADAPTER, 1, folder)

    def _load_folder(self, folder: str) -> None:
        self.llm.collective_rpc("grpolab_reload_weights", kwargs={"weights_path": folder})

    def _reload(self, push: Callable[[], object], restore: Callable[[], object] | None = None) -> None:
        """Push new weights with ``push``; ``restore`` (default ``push``) restores them after every later
        level-2 sleep.
        Asleep, only the weights wake (vLLM's RL order, docs/features/sleep_mode.md: wake_up(["weights"]),
        load, and the KV cache once needed); level 1 brings back the offloaded old weights first,
        overwritten here."""
        restore = restore or push
        self._wake_weights()
        (restore if self._weights_lost else push)()  # after a level-2 sleep ``push`` alone may not be enough
        self._push_latest, self._weights_lost, self._placeholders = restore, False, False
        self.llm.reset_prefix_cache()  # its KV was computed with the old weights

    def _sync_cuda_ipc(self, model: nn.Module) -> None:
        if self._ipc is None or self._ipc.model is not model:
            from grpolab.rollout.vllm.worker import CudaIPCWeightSender

            self._ipc = CudaIPCWeightSender(self.llm, model)
        self._ipc.send()

    # ---- sleep / shutdown ----
    # vLLM 0.32: sleep(level) frees the "weights" and "kv_cache" memory; level 1 copies the weights
    # to CPU and wake_up copies them back, level 2 keeps only the model's buffers, and wake_up maps
    # fresh memory for the weights with nothing restored in it (CuMemBackend.suspend / CuMemAllocator.
    # wake_up, Worker.sleep / wake_up in vllm/v1/worker/gpu_worker.py). wake_up(tags) maps only the
    # tags named (and only allocations still asleep); the scheduler resumes once no tag sleeps
    # (EngineCore.wake_up). The tags are tracked here and each is woken exactly once.
    def _sleep(self) -> None:
        if self.sleep_level is not None and not self._sleeping:
            self.llm.sleep(level=self.sleep_level)
            self._sleeping = {"weights", "kv_cache"}
            self._weights_lost = self.sleep_level == 2

    def _wake_weights(self) -> None:
        if "weights" in self._sleeping:
            _empty_cuda_cache()
            self.llm.wake_up(tags=["weights"])
            self._sleeping.discard("weights")

    def _wake(self) -> None:
        """Ready to generate: weights awake and holding the latest weights (pushed again after a
        level-2 sleep), then the KV cache."""
        self._wake_weights()
        if self._weights_lost:
            self._push_latest()
            self._weights_lost = False
        if "kv_cache" in self._sleeping:
            _empty_cuda_cache()
            self.llm.wake_up(tags=["kv_cache"])
            self._sleeping.discard("kv_cache")

    def close(self) -> None:
        """Shut the engine-core processes down and remove the sync folder (idempotent)."""
        llm, self.llm = getattr(self, "llm", None), None
        self._ipc = None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
        if self._owns_sync_dir:
            shutil.rmtree(self._sync_dir, ignore_errors=True)
