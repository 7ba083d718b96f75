"""vLLM's side of ``grpolab.rollout.vllm.engine``: the worker extension and the GPU weight transfer.

``WorkerExtension`` is mixed into vLLM's worker class (``LLM(worker_extension_cls=...)``, vLLM's
hook for RL frameworks); its methods run in every worker via ``llm.collective_rpc(name)``.
``CudaIPCWeightSender`` is the GPU-only in-process weight update (vLLM's CUDA-IPC transfer).
Nothing here imports the engine (``grpolab.rollout.vllm.engine``), which imports this.
"""

from __future__ import annotations

from torch import nn

__all__ = ["CudaIPCWeightSender", "WorkerExtension"]


class WorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker)."""

    def grpolab_reload_weights(self, weights_path: str) -> None:
        """``reload_weights`` from a folder of checkpoint-format safetensors, then re-process the
        output layers on CPU.

        The CPU backend repacks the lm_head weight into a GEMM-friendly copy after loading; with
        tied embeddings the reload updates the shared tensor but skips the lm_head layer (no
        ``lm_head.*`` in the checkpoint), leaving its packed copy stale: re-run its processing.
        """
        from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        from vllm.platforms import current_platform

        if self.vllm_config.load_config.load_format == "dummy":
            # started on placeholders (an untied head, ``VLLMEngine(untie_head=True)``): that loader reads no
            # files, so the folder's safetensors are read here
            from pathlib import Path

            from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

            files = sorted(str(p) for p in Path(weights_path).glob("*.safetensors"))
            self.reload_weights(weights_iterator=safetensors_weights_iterator(files, use_tqdm_on_load=False))
        else:
            self.reload_weights(weights_path=weights_path)
        if current_platform.is_cpu():
            for module in self.model_runner.get_model().modules():
                if isinstance(module, ParallelLMHead):
                    module.quant_method.process_weights_after_loading(module)


class CudaIPCWeightSender:
    """GPU only (not run on the CPU dev machine): pushes a CUDA ``model``'s parameters into an
    in-process ``vllm.LLM`` (built with ``WeightTransferConfig(backend="ipc")``) with vLLM's CUDA-IPC
    weight transfer; it is also the ``VLLMWeightSyncClient`` the transfer drives."""

    def __init__(self, llm, model: nn.Module):
        from vllm.distributed.weight_transfer import ModuleSource
        from vllm.distributed.weight_transfer.ipc_engine import (
            IPCTrainerInitInfo,
            IPCTrainerWeightTransferEngine,
        )

        self.llm, self.model = llm, model
        self._sender = IPCTrainerWeightTransferEngine.trainer_init(
            IPCTrainerInitInfo(rank=0), client=self, source=ModuleSource(model)
        )

    def send(self) -> None:
        self._sender.send_weights()  # start_weight_update -> update_weights -> finish_weight_update

    # VLLMWeightSyncClient: LLM's own methods take request dicts
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info) -> None:
        from vllm.distributed.weight_transfer.clients import (
            _json_safe_update_payload,  # pickles IPC handles
        )

        self.llm.update_weights({"update_info": _json_safe_update_payload(update_info)})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)
