"""Engines by capability: each registered engine declares everything it can do, code outside ``rollout/`` asks
those capabilities and never an engine's name, and the settings an engine cannot run are refused from its
capabilities (``grpolab.rollout.engines``)."""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from pathlib import Path

import pytest

import grpolab
from grpolab.config import ConfigError, load_config
from grpolab.rollout.base import EngineCapabilities
from grpolab.rollout.engines import (
    ENGINES,
    EngineKind,
    available_engines,
    capabilities,
    check_settings,
    engine_choices,
    engine_record,
    register_engine,
    weight_kind,
)
from grpolab.rollout.hf.engine import HFEngine
from grpolab.rollout.vllm.engine import VLLMEngine

PACKAGE = Path(grpolab.__file__).parent
NAME = re.compile(r'"(hf|vllm)"')


def test_every_registered_engine_declares_every_capability():
    fields = {f.name for f in dataclasses.fields(EngineCapabilities)}
    assert fields >= {
        "shares_training_model",
        "max_temperature",
        "truncated_sampling",
        "graceful_stop",
        "records_routing",
        "serves_adapters",
        "batch_refill",
        "bounded_batch",
        "runs_apart",
    }
    for name, kind in ENGINES.items():
        assert isinstance(kind.capabilities, EngineCapabilities), name
        assert capabilities(name) is kind.capabilities
    # the registry's record is the one each engine class declares; one that runs apart says how
    assert capabilities("hf") is HFEngine.capabilities
    assert capabilities("vllm") is VLLMEngine.capabilities
    assert all((kind.apart is not None) == kind.capabilities.runs_apart for kind in ENGINES.values())
    with pytest.raises(ValueError, match="capabilities.runs_apart says True, apart is None"):
        register_engine("half", dataclasses.replace(HFEngine.capabilities, runs_apart=True))
    assert HFEngine.capabilities.batch_refill and not VLLMEngine.capabilities.batch_refill


def engine_names(package: Path) -> list[str]:
    """Every line outside ``rollout/`` that names an engine as a string (``"hf"``, ``"vllm"``): the choices and
    the vLLM section's settings live in ``rollout/settings.py``, so there is none."""
    found = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package).as_posix()
        if relative.startswith("rollout/"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if NAME.search(line):
                found.append(f"{relative}:{number}: {line.strip()}")
    return found


def test_no_module_outside_rollout_names_an_engine():
    """Like the layer contract, over the package's source: code outside ``grpolab/rollout/`` asks an engine's
    capabilities (``grpolab.rollout.engines.capabilities``), never its name."""
    assert not engine_names(PACKAGE), "\n".join(engine_names(PACKAGE))


def test_a_branch_on_an_engine_name_is_found(tmp_path):
    (tmp_path / "rollout").mkdir()
    (tmp_path / "rollout" / "engines.py").write_text('ENGINE = "vllm"\n')  # rollout/ may name its engines
    (tmp_path / "trainer.py").write_text('armed = cfg.rollout.engine == "hf"\n')
    assert engine_names(tmp_path) == ['trainer.py:1: armed = cfg.rollout.engine == "hf"']


def _with_engine(cfg, name):
    """``cfg`` with ``rollout.engine`` set, unvalidated (a name the config's choices need not list)."""
    return cfg.model_copy(update={"rollout": cfg.rollout.model_copy(update={"engine": name})})


@pytest.fixture
def fake_engine():
    """An engine registered for the test only, with vLLM's limits under another name, that cannot run apart."""
    ENGINES["fake"] = EngineKind(
        "fake",
        lambda request: None,
        dataclasses.replace(capabilities("vllm"), max_temperature=1.5, runs_apart=False),
        "Fake",
        lambda cfg: False,
        lambda cfg: {"version": "0"},
    )
    yield "fake"
    del ENGINES["fake"]


def test_refusals_follow_the_capabilities_not_the_name(fake_engine):
    with pytest.raises(ConfigError, match="rollout.temperature 1.8: the Fake engine samples at temperatures up to 1.5"):
        check_settings(_with_engine(load_config(None, {"rollout.temperature": 1.8}), fake_engine))
    with pytest.raises(ConfigError, match="eval.top_p / top_k: the Fake engine .* \\(Fake reports"):
        check_settings(_with_engine(load_config(None, {"eval.top_p": 0.9}), fake_engine))
    with pytest.raises(ConfigError, match="which only the hf engine makes \\(fake does not\\)"):
        check_settings(_with_engine(load_config(None, {"algorithm.routing_replay": True}), fake_engine))
    with pytest.raises(ConfigError, match="no weight files for Fake to load; use rollout.engine 'hf'"):
        check_settings(_with_engine(load_config(None, {"model": "like:qwen3-0.6b"}), fake_engine))
    check_settings(load_config(None, {"rollout.temperature": 1.8, "eval.top_p": 0.9}))  # hf takes them all
    with pytest.raises(
        ConfigError, match="the Fake engine generates in step with training here: .* rollout.engine 'hf'"
    ):
        check_settings(_with_engine(load_config(None, {"rollout.mode": "async"}), fake_engine))
    ENGINES[fake_engine] = dataclasses.replace(
        ENGINES[fake_engine], capabilities=dataclasses.replace(capabilities(fake_engine), runs_apart=True)
    )  # (and its ``apart``, which a registration requires)
    check_settings(
        _with_engine(load_config(None, {"rollout.mode": "async"}), fake_engine)
    )  # its capability, not its name
    assert "fake" not in available_engines(load_config(None, {}).rollout)
    assert engine_record(_with_engine(load_config(None, {}), fake_engine).rollout) == {"engine": "fake", "version": "0"}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            {"rollout.temperature": 2.5},
            "config: rollout.temperature 2.5: the vLLM engine samples at temperatures up to 2",
        ),
        (
            {"eval.top_k": 5},
            "config: eval.top_p / top_k: the vLLM engine samples with top_p = 1 and top_k = 0 only (vLLM "
            "reports log-probs renormalised over the truncated set)",
        ),
        (
            {"algorithm.routing_replay": True},
            "config: algorithm.routing_replay with one optimizer step per batch replays "
            "the engine's record, which only the hf engine makes (vllm does not): use rollout.engine 'hf' or more than one "
            "step (algorithm.epochs x steps_per_epoch > 1)",
        ),
        (
            {"model": "like:qwen3-0.6b"},
            "config: a like:NAME model has random weights and no weight files for vLLM to load; "
            "use rollout.engine 'hf'",
        ),
    ],
)
def test_the_refusals_read_as_the_configs_did(overrides, message):
    """Word for word what validating the config said when it held these rules."""
    with pytest.raises(ConfigError) as refused:
        check_settings(load_config(None, {"engine": "vllm", **overrides}))
    assert str(refused.value) == message


def test_the_engine_record_of_the_manifest():
    assert engine_record(load_config(None, {}).rollout) == {"engine": "hf"}
    cfg = load_config(None, {"vllm_python": "/opt/py/bin/python"})
    assert engine_record(cfg.rollout) == {"engine": "vllm", "python": "/opt/py/bin/python"}
    assert available_engines(cfg.rollout) == ["hf", "vllm"]  # an interpreter named for it: offered


@pytest.mark.parametrize(
    "engine,offered,lora_sync,kind",
    [
        ("hf", ("full",), "merged", "full"),  # the training model itself, whatever the policy
        ("hf", ("gathered",), "merged", "full"),  # sharded too: it generates with the shards in lockstep
        ("hf", ("merged", "adapter"), "adapter", "full"),
        ("vllm", ("full",), "merged", "full"),  # a copy of the whole weights, read from the model
        ("vllm", ("gathered",), "merged", "gathered"),  # ... gathered from the shards
        ("vllm", ("merged", "adapter"), "merged", "merged"),  # a LoRA policy: base + adapter product
        ("vllm", ("merged", "adapter"), "adapter", "adapter"),  # ... or its adapter alone, vLLM's LoRA serving it
    ],
)
def test_the_engines_capabilities_select_the_kind_of_weights(engine, offered, lora_sync, kind):
    overrides = {"engine": engine, "rollout.vllm.lora_sync": lora_sync}
    if lora_sync == "adapter":
        overrides["model.lora.rank"] = 4
    assert weight_kind(load_config(None, overrides), offered) == kind


def test_engines_a_bench_cannot_run_are_named_with_why(monkeypatch):
    """``grpolab bench`` tries every engine that can run the config and names the others with the reason: a
    setting the engine refuses (check_settings' own words), or the engine missing from this interpreter (vLLM
    not importable, as an interpreter without the package sees it)."""
    assert engine_choices(load_config(None, {"vllm_python": "/opt/py/bin/python"})) == (["hf", "vllm"], {})
    # vLLM in another interpreter, so that the refusal is the setting's wherever vLLM is installed or not
    usable, skipped = engine_choices(
        load_config(None, {"model": "like:qwen3-0.6b", "vllm_python": "/opt/py/bin/python"})
    )
    assert usable == ["hf"] and skipped == {
        "vllm": "a like:NAME model has random weights and no weight files for vLLM to load; use rollout.engine 'hf'"
    }
    monkeypatch.setitem(sys.modules, "vllm", None)  # import vllm now fails: not installed
    usable, skipped = engine_choices(load_config(None, {}))
    assert usable == ["hf"] and skipped["vllm"].startswith(
        "vLLM is not installed in this interpreter and rollout.vllm.python names no other (GPU: pip install"
    )


class RecordingEngine:
    """An engine that records what it was built from and asked, and answers with the weights it saw."""

    def __init__(self, request):
        self.request, self.calls = request, []

    def generate(self, prompts, n, params):
        weight = next(self.request.model.parameters()).detach().flatten()[0].item()
        self.calls.append(("generate", prompts, n))
        return [[weight] * n for _ in prompts]

    def sync_weights(self, weights):
        self.calls.append(("sync_weights",))

    def close(self):
        pass


def test_an_engine_process_builds_its_engine_by_the_registered_factory():
    """The engine process's side (``_serve``, driven here in a thread through its pipe) builds the engine its
    request names by that engine's registered factory, on the shared copy of the model, and points the copy at
    a version's slot before it generates with a version it does not hold (a second write of one version is
    loaded again); an engine that cannot run apart is refused before any process starts."""
    import signal
    import threading

    import torch
    from torch import nn

    from grpolab.rollout import engine_process
    from grpolab.rollout.base import SamplingParams
    from grpolab.rollout.engines import EngineRequest, _built_on, build_engine_apart

    built, threads = [], torch.get_num_threads()

    def factory(request):
        built.append(RecordingEngine(request))
        return built[-1]

    ENGINES["recording"] = EngineKind(
        "recording",
        factory,
        dataclasses.replace(capabilities("hf"), runs_apart=True),
        "Recording",
        lambda cfg: True,
        lambda cfg: {},
    )
    try:
        model = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            model.weight.fill_(1.0)
        cfg = load_config(None, {}).rollout.model_copy(update={"engine": "recording"})
        request = EngineRequest(cfg, model, None, Path("."), 0, 16, None)
        slots = engine_process.SharedSlots(model, 2)
        slots.slots[1]["weight"].fill_(7.0)
        parent, child = torch.multiprocessing.Pipe()
        params, replies = SamplingParams(max_new_tokens=4, seed=0), []

        def learner():
            replies.append(parent.recv())  # built: its EOS ids
            for ticket in (None, (1, 0), (1, 0), (1, 1)):  # built weights, version 1, again, version 1 rewritten
                parent.send(("generate", ticket, ([[1, 2]], 2, params)))
                replies.append(parent.recv())
            parent.send(None)

        asking = threading.Thread(target=learner)
        asking.start()
        interrupt = signal.getsignal(signal.SIGINT)
        try:  # the engine process's loop, in this (main) thread
            build = functools.partial(_built_on, dataclasses.replace(request, model=None))
            engine_process._serve(child, functools.partial(build, slots.model), slots.load)
        finally:
            signal.signal(signal.SIGINT, interrupt)
            torch.set_num_threads(threads)
        asking.join(timeout=10)
        assert [engine.request.model is slots.model for engine in built] == [True]  # built once, on the copy
        assert (
            replies == [("ok", []), ("ok", [[1.0, 1.0]])] + [("ok", [[7.0, 7.0]])] * 3
        )  # version 1 read from its slot
        generate = ("generate", [[1, 2]], 2)
        assert built[0].calls == [generate, ("sync_weights",), generate, generate, ("sync_weights",), generate]
        with pytest.raises(ValueError, match="the Recording engine cannot run in a process of its own"):
            build_engine_apart(request, 1)  # no ``apart`` registered
    finally:
        del ENGINES["recording"]


def test_vllms_weight_slots_are_checkpoint_folders_by_version(tmp_path, make_tiny_model):
    """vLLM apart takes each version as a checkpoint folder of its slot (version % slots), in the engine's dtype,
    and reloads by the ticket's kind: full weights from the folder, an adapter alone from peft's folder."""
    import torch
    from safetensors.torch import load_file

    from grpolab.models.weights import ModelWeights
    from grpolab.rollout.vllm.apart import FolderSlots

    model = make_tiny_model("llama")
    slots = FolderSlots(tmp_path, 2, "bfloat16")
    tickets = [slots.write(ModelWeights(model), version) for version in (0, 1, 2)]
    assert tickets[0] == tickets[2] == ("full", str(tmp_path / "slot_0")) and tickets[1][1] == str(tmp_path / "slot_1")
    saved = load_file(tmp_path / "slot_1" / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16} and len(saved) == len(dict(model.named_parameters()))

    class Recording:
        calls = []

        def sync_from_folder(self, folder):
            self.calls.append(("full", folder))

        def sync_adapter_from_folder(self, folder):
            self.calls.append(("adapter", folder))

    engine = Recording()
    FolderSlots.load(engine, tickets[1])
    FolderSlots.load(engine, ("adapter", "/a"))
    assert engine.calls == [("full", str(tmp_path / "slot_1")), ("adapter", "/a")]
