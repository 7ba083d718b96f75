"""vLLM in a process of its own (``grpolab.rollout.engine_process``): under another interpreter
(``rollout.vllm.python``), or beside the learner for async rollouts. Its weights travel as checkpoint folders
that the engine reloads (``FolderSlots``), one per version slot."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from grpolab.models.weights import PolicyWeights
from grpolab.rollout.engine_process import EngineProcess
from grpolab.rollout.vllm.engine import VLLM_CAPABILITIES, VLLMEngine, save_weights

__all__ = ["FolderSlots", "vllm_process"]


class FolderSlots:
    """``count`` weight versions as folders under ``folder``, written in the engine's ``dtype`` (full weights in
    checkpoint format, or a LoRA adapter in peft's); the folder of a loaded version is kept until that slot's next
    write (a wake from a level-2 sleep reloads from it)."""

    def __init__(self, folder: Path, count: int, dtype: str | None):
        self.folder, self.count, self.dtype = folder, count, dtype

    def __len__(self) -> int:
        return self.count

    def write(self, weights: PolicyWeights, version: int) -> tuple[str, str]:
        slot = self.folder / f"slot_{version % self.count}"
        slot.mkdir(parents=True, exist_ok=True)
        if weights.kind == "adapter":
            return "adapter", str(weights.save(slot / "adapter", self.dtype))
        return "full", str(save_weights(weights, slot, self.dtype).parent)

    @staticmethod
    def load(engine: VLLMEngine, ticket: tuple[str, str]) -> None:
        kind, folder = ticket
        if kind == "adapter":
            engine.sync_adapter_from_folder(folder)
        else:
            engine.sync_from_folder(folder)


def vllm_process(model_dir: str | Path, *, python: str, slots: int = 1, **engine_kwargs: Any) -> EngineProcess:
    """A ``VLLMEngine(model_dir, **engine_kwargs)`` (JSON-like values) in a process started under ``python`` (an
    interpreter with vLLM and grpolab's dependencies), holding ``slots`` weight versions."""
    build = functools.partial(VLLMEngine, str(model_dir), None, **engine_kwargs)
    dtype = engine_kwargs.get("dtype")
    return EngineProcess.started(
        python, build, lambda folder: FolderSlots(folder / "weights", slots, dtype), VLLM_CAPABILITIES
    )
