"""An engine in a process of its own, for asynchronous rollouts on one machine.

The engine process holds a copy of the policy and builds its engine there by the engine's registered factory
(``grpolab.rollout.engines.build_engine``, from the same ``EngineRequest`` as the run's in-process engine: the
same compute context and compute-dtype copy), for an engine whose capabilities say it ``runs_apart`` (the hf
engine). It generates on its own CPU threads while the learner trains in the parent. Its weights live in shared memory, in ``slots`` versions (``WeightSlots``): the parent writes the policy after step
v into slot ``v % slots`` and the engine, asked to generate with version v, points its parameters at that slot
(no copy). The rollout pipeline (``grpolab.rollout.pipeline``) only asks for a version once it is written and
only overwrites a slot whose previous version no batch still needs, so a slot never changes under a
generation.

Requests and replies go over one pipe, one request at a time (completions, MoE routing records included,
travel back through torch's shared-memory pickling). An engine process that dies is noticed within a
second of the parent waiting on it (``EngineDied``: one line, the run stops with its last checkpoint). The
engine process ignores SIGINT (the parent decides how a Ctrl-C stops the run) and ends, quietly, when its pipe
closes (a reply that finds it closed included), so a parent killed outright leaves no engine behind.
"""

from __future__ import annotations

import copy
import dataclasses
import signal
import traceback
from collections.abc import Sequence

import torch
import torch.multiprocessing as mp
from torch import nn

from grpolab.models.weights import ModelWeights, PolicyWeights
from grpolab.rollout.base import Completion, SamplingParams
from grpolab.rollout.engines import EngineRequest, build_engine, capabilities

__all__ = ["EngineDied", "EngineProcess", "WeightSlots"]

POLL_SECONDS = 1.0  # how often a parent waiting on the engine checks that it is alive


class EngineDied(RuntimeError):
    """The engine process ended (killed, out of memory) or failed while generating."""


class WeightSlots:
    """``count`` versions of a model's parameters (tied ones once), in shared memory; version v is held in slot
    ``v % count``. Slot 0 is the engine copy's own parameters."""

    def __init__(self, engine_model: nn.Module, count: int):
        first = {name: p.data for name, p in engine_model.named_parameters()}
        self.slots = [first] + [
            {name: t.clone().share_memory_() for name, t in first.items()} for _ in range(count - 1)
        ]

    def __len__(self) -> int:
        return len(self.slots)

    def of(self, version: int) -> dict[str, torch.Tensor]:
        return self.slots[version % len(self.slots)]

    @torch.no_grad()
    def write(self, weights: PolicyWeights, version: int) -> None:
        """Copy ``weights`` into the slot of ``version``; every parameter must be there by name."""
        slot = self.of(version)
        names = set(slot)
        for name, tensor in weights.named_parameters():
            slot[name].copy_(tensor.detach())
            names.discard(name)
        if names:
            raise ValueError(f"the policy's weights lack {len(names)} engine parameters, e.g. {sorted(names)[0]}")


def engine_copy(model: nn.Module) -> nn.Module:
    """A frozen copy of ``model`` (its dtype, its device), in eval mode, its tensors shared with a spawned
    process (CPU: shared memory; CUDA: torch's IPC handles, the same GPU's memory)."""
    engine_model = copy.deepcopy(model)
    engine_model.requires_grad_(False).eval()
    return engine_model.share_memory()


def _serve(conn, request: EngineRequest, slots: list[dict[str, torch.Tensor]], threads: int) -> None:
    """The engine process: answer (version, prompts, n, params) requests until the pipe closes or says None.
    Its engine is the one the run's process would build from ``request`` (whose model is the shared-memory copy),
    by the same factory: the same compute context, and a compute-dtype copy of the weights where that engine
    makes one (refreshed at each version)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(threads)
    engine = build_engine(request)
    model = request.model
    params = dict(model.named_parameters())
    current = 0  # the version the parameters and the engine's copy hold
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        if request is None:
            return
        version, prompts, n, sampling = request
        try:
            if version != current:  # a new version, in another slot or written into the same one
                current = version
                for name, tensor in slots[version % len(slots)].items():
                    params[name].data = tensor
                engine.sync_weights(ModelWeights(model))  # its compute-dtype copy, if any, from the slot
            reply = ("ok", engine.generate(prompts, n, sampling))
        except Exception:
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except (BrokenPipeError, ConnectionResetError):  # the learner is gone (killed): no one to answer
            return


class EngineProcess:
    """The parent's handle on an engine process generating from a copy of ``request.model`` as the engine
    ``request`` names does in the run's process.

    slots: how many weight versions it holds (the pipeline's staleness bound + 1).
    threads: the engine process's CPU threads.
    ``generate`` samples with the version last set in ``version`` (a ``RolloutEngine`` for the collector); its
    ``capabilities`` are its engine's, but for the model it samples from (a copy, synced by version).
    """

    def __init__(self, request: EngineRequest, slots: int, threads: int):
        can = capabilities(request.cfg.engine)
        if not can.runs_apart:  # check_settings refuses the config first, in its words
            raise ValueError(f"the {request.cfg.engine} engine cannot run in a process of its own")
        self.capabilities = dataclasses.replace(can, shares_training_model=False)
        self.model_copy = engine_copy(request.model)
        self.slots = WeightSlots(self.model_copy, slots)
        self.version = 0
        self.busy = False  # a request is in flight
        context = mp.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve,
            args=(child, dataclasses.replace(request, model=self.model_copy), self.slots.slots, threads),
            daemon=True,
            name="grpolab-engine",
        )
        self.process.start()
        child.close()
        self.closed = False

    @classmethod
    def for_rollout(cls, request: EngineRequest, threads: int) -> EngineProcess:
        """The engine process of a run's async rollouts: as many weight slots as versions may be in use at once
        (``rollout.max_staleness`` + 1)."""
        return cls(request, request.cfg.max_staleness + 1, threads)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def publish(self, weights: PolicyWeights, version: int) -> None:
        """Write the policy after step ``version`` into its slot (the pipeline knows no batch still reads it)."""
        self.slots.write(weights, version)

    def generate(self, prompts: Sequence[list[int]], n: int, params: SamplingParams) -> list[list[Completion]]:
        """``n`` completions per prompt from the policy of ``self.version`` (``HFEngine.generate``)."""
        self.busy = True
        try:
            self.conn.send((self.version, [list(p) for p in prompts], n, params))
            while not self.conn.poll(POLL_SECONDS):
                if not self.process.is_alive():
                    raise EOFError
            status, reply = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            raise EngineDied(
                f"the rollout engine process (pid {self.process.pid}) ended while generating "
                f"(exit code {self.process.exitcode})"
            ) from None
        finally:
            self.busy = False
        if status != "ok":
            last = reply.strip().splitlines()[-1]
            raise EngineDied(f"the rollout engine process failed while generating: {last}")
        return reply

    def sync_weights(self, weights: PolicyWeights) -> None:
        """Write ``weights`` as the version ``generate`` samples with."""
        self.publish(weights, self.version)

    def close(self) -> None:
        """Stop the engine process (at once: a generation in flight is abandoned). Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        if not self.busy:
            try:
                self.conn.send(None)
            except (OSError, BrokenPipeError):
                pass
            self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()
