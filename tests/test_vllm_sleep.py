"""VLLMEngine's sleep mode, wake order and weight restores, temperature limit and request seeds.

vLLM's sleep mode exists only on GPU, so ``vllm.LLM`` is replaced by ``FakeLLM``: a call-recording
stand-in that keeps the state vLLM's allocator would (vllm/device_allocator/cumem.py, vLLM 0.32):
``sleep(1)`` copies the weights to CPU and unmaps them, ``sleep(2)`` unmaps them with no copy, both
drop the KV cache; ``wake_up(tags)`` maps the named tags again, level-1 weights with their copy
restored, level-2 weights as fresh memory (poisoned with NaN here until a reload). It refuses to
generate while any memory is asleep or on weights nobody reloaded, so a missed restore fails loudly.
It samples with ``HFEngine`` on its own copy of the model. The real ``Trainer`` drives it through the
step-0 evaluation (greedy then sampled pass@k), DAPO steps that resample, and the bench's rollout
timing; every generation is checked against ``HFEngine`` on the trainer's current model.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import params_of, quick_config, same
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.commands.bench import time_rollout
from grpolab.config import RunConfig
from grpolab.models.weights import ModelWeights
from grpolab.rollout import HFEngine, SamplingParams
from grpolab.rollout.vllm.engine import _SEED_STRIDE, VLLM_MAX_TEMPERATURE, VLLMEngine, request_seed
from grpolab.run.trainer import Trainer

vllm = pytest.importorskip("vllm")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# ---- the stand-in ------------------------------------------------------------------------------
class FakeLLM:
    """``vllm.LLM`` as ``VLLMEngine`` uses it; ``calls`` lists every call in order (shared with the
    ``torch.cuda.empty_cache`` spy). Stricter than vLLM where vLLM only logs a warning: sleeping
    twice, or waking a tag that is not asleep (it would map nothing), raises here."""

    def __init__(self, model: str, tokenizer: str, enable_sleep_mode: bool = False, **kwargs):
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer)
        self.enable_sleep_mode, self.kwargs = enable_sleep_mode, kwargs
        self.calls: list[tuple] = []
        self.asleep: set[str] = set()  # vLLM's sleeping tags
        self.cpu_copy: list[torch.Tensor] | None = None  # level-1 backup of the weights
        self.fresh_weights = False  # woken from level 2: mapped, never loaded
        self.generated_with: list[list[torch.Tensor]] = []  # the weights each generate call used
        shutdown = SimpleNamespace(shutdown=lambda: self.calls.append(("shutdown",)))
        self.llm_engine = SimpleNamespace(engine_core=shutdown, add_lora=self.add_lora)

    def add_lora(self, request) -> bool:
        self.calls.append(("add_lora", request.lora_path, request.load_inplace))
        assert "weights" not in self.asleep, "adapter loaded into unmapped memory"
        return True

    @torch.no_grad()
    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.calls.append(("sleep", level))
        assert self.enable_sleep_mode, "sleep without enable_sleep_mode"
        assert not self.asleep, "sleep while asleep"
        self.cpu_copy = [p.detach().clone() for p in self.model.parameters()] if level == 1 else None
        for p in self.model.parameters():  # unmapped: the old contents are gone
            p.fill_(float("nan"))
        self.asleep = {"weights", "kv_cache"}

    @torch.no_grad()
    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append(("wake_up", None if tags is None else tuple(tags)))
        waking = set(self.asleep) if tags is None else set(tags)
        assert self.asleep and waking <= self.asleep, f"wake_up({tags}) with {sorted(self.asleep)} asleep"
        if "weights" in waking:
            if self.cpu_copy is not None:  # level 1: copied back
                for p, saved in zip(self.model.parameters(), self.cpu_copy):
                    p.copy_(saved)
                self.cpu_copy = None
            else:  # level 2: fresh memory, nothing restored
                self.fresh_weights = True
        self.asleep -= waking
        return not self.asleep

    @torch.no_grad()
    def collective_rpc(self, method: str, timeout=None, args=(), kwargs=None) -> list:
        self.calls.append(("collective_rpc", method, dict(kwargs or {})))
        assert method == "grpolab_reload_weights", method
        assert "weights" not in self.asleep, "weights loaded into unmapped memory"
        state = {}
        for file in sorted(Path(kwargs["weights_path"]).glob("*.safetensors")):
            state.update(load_file(file))
        assert state, f"no safetensors in {kwargs['weights_path']}"
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        assert not unexpected, unexpected
        assert all(torch.isfinite(p).all() for p in self.model.parameters()), f"not reloaded: {missing}"
        self.fresh_weights = False
        return [None]

    def reset_prefix_cache(self, *args) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return True

    def generate(self, prompts, sampling_params, use_tqdm=True, lora_request=None):
        from vllm.v1.engine.parallel_sampling import ParentRequest

        self.calls.append(
            ("generate", len(prompts))
            if lora_request is None
            else ("generate", len(prompts), lora_request.lora_path, lora_request.load_inplace)
        )
        if self.asleep:
            raise RuntimeError(f"generate with {sorted(self.asleep)} asleep")
        if self.fresh_weights or not all(torch.isfinite(p).all() for p in self.model.parameters()):
            raise RuntimeError("generate on weights woken from a level-2 sleep and never reloaded")
        self.generated_with.append(params_of(self.model))
        outputs = []
        for prompt, sp in zip(prompts, sampling_params, strict=True):
            if sp.seed is not None:  # the seeds vLLM's engine gives the n samples
                parent = ParentRequest(SimpleNamespace(params=sp, request_id="r", external_req_id="r"))
                seeds = [parent.get_child_info(j)[1].seed for j in range(sp.n)] if sp.n > 1 else [sp.seed]
                assert all(0 <= s < 2**63 for s in seeds), seeds
            params = SamplingParams(
                max_new_tokens=sp.max_tokens,
                temperature=sp.temperature,
                stop_strings=tuple(sp.stop or ()),
                seed=sp.seed,
            )
            group = HFEngine(self.model, self.tokenizer, eos_token_ids=list(sp.stop_token_ids)).generate(
                [list(prompt["prompt_token_ids"])], sp.n, params
            )[0]
            outputs.append(
                SimpleNamespace(
                    outputs=[
                        SimpleNamespace(
                            index=j,
                            token_ids=c.completion_ids,
                            finish_reason=c.finish_reason,
                            stop_reason=None,
                            logprobs=[{t: SimpleNamespace(logprob=lp)} for t, lp in zip(c.completion_ids, c.logprobs)],
                        )
                        for j, c in reversed(list(enumerate(group)))
                    ]
                )
            )  # any order: the engine sorts by index
        return outputs


@pytest.fixture
def fake_vllm(monkeypatch):
    """vllm.LLM -> FakeLLM, a platform with sleep mode and no CUDA (so the file sync is used).
    Returns the list of FakeLLMs created; ``fake_cuda(fakes)`` then turns on the empty_cache spy."""
    from vllm.platforms import current_platform

    fakes: list[FakeLLM] = []

    def make(*args, **kwargs):
        fakes.append(FakeLLM(*args, **kwargs))
        return fakes[-1]

    monkeypatch.setattr(vllm, "LLM", make)
    monkeypatch.setattr(current_platform, "is_sleep_mode_available", lambda: True)
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: False)
    return fakes


@pytest.fixture
def fake_cuda(monkeypatch):
    """After the trainer is built on CPU: CUDA "initialised", empty_cache logged in the fakes' calls."""

    def start(fakes: list[FakeLLM]) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: fakes[-1].calls.append(("empty_cache",)))

    return start


# ---- checks ------------------------------------------------------------------------------------
def hf_reference(model, tokenizer, eos: list[int], prompts, n: int, params: SamplingParams):
    """What VLLMEngine.generate must return when its weights are ``model``'s: per request, HFEngine
    with the request's seed (greedy: one sample, copied)."""
    k = 1 if params.greedy else n
    engine = HFEngine(model, tokenizer, eos_token_ids=eos)
    groups = [
        engine.generate([p], k, replace(params, seed=request_seed(params.seed, i, n)))[0] for i, p in enumerate(prompts)
    ]
    return [g if k == n else g * n for g in groups]


def assert_same(out, expected) -> None:
    for got_group, want_group in zip(out, expected, strict=True):
        for got, want in zip(got_group, want_group, strict=True):
            assert (got.completion_ids, got.finish_reason) == (want.completion_ids, want.finish_reason)
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-6)


def spy_generate(trainer: Trainer) -> list[SamplingParams]:
    """Wrap trainer.parts.engine.generate: each call must run on the trainer's current weights and give
    exactly HFEngine's completions and log-probs on that model. Returns the calls' params."""
    engine, generate, seen = trainer.parts.engine, trainer.parts.engine.generate, []

    def checked(prompts, n, params):
        weights = params_of(trainer.parts.model)
        out = generate(prompts, n, params)
        assert same(engine.llm.generated_with[-1], weights), "generated on other weights than the trainer's"
        assert_same(
            out, hf_reference(trainer.parts.model, trainer.parts.tokenizer, engine.eos_token_ids, prompts, n, params)
        )
        seen.append(params)
        return out

    engine.generate = checked
    return seen


def check_wakes(calls: list[tuple], level: int, model_dir: str) -> list[str]:
    """Replays the calls: empty_cache right before each wake_up, never a bare wake_up, the weights
    woken before the KV cache, generation only when all is awake and, at level 2, the weights
    reloaded in between, from the latest synced folder (the checkpoint before any sync). Returns
    the folders of these restores (reloads that are not a sync, which resets the prefix cache)."""
    restores, state, latest = [], "awake", model_dir
    for i, call in enumerate(calls):
        if call[0] == "wake_up":
            assert calls[i - 1] == ("empty_cache",), calls[max(0, i - 3) : i + 1]
            assert call[1] in (("weights",), ("kv_cache",)), call
        if call[0] == "sleep":
            assert call[1] == level and state == "awake", (call, state)
            state = "asleep"
        elif call == ("wake_up", ("weights",)):
            assert state == "asleep", state
            state = "weights unloaded" if level == 2 else "weights up"
        elif call[0] == "collective_rpc":
            folder = call[2]["weights_path"]
            if calls[i + 1] == ("reset_prefix_cache",):  # a sync
                latest = folder
            else:
                assert state == "weights unloaded" and folder == latest, (state, folder, latest)
                restores.append(folder)
            state = "weights up" if state == "weights unloaded" else state
        elif call == ("wake_up", ("kv_cache",)):
            assert state == "weights up", state
            state = "awake"
        elif call[0] == "generate":
            assert state == "awake", f"generate in state {state!r}"
    return restores


# ---- the trainer on every call path --------------------------------------------------------------
def sleeping_vllm_config(model_dir, out, level: int, **settings) -> RunConfig:
    """A quick run of the model in ``model_dir`` into ``out``, the policy on the CPU, its vLLM engine sleeping at
    ``level`` between generations; ``settings`` on top."""
    return quick_config(
        model_dir, out, engine="vllm", **{"model.device": "cpu", "rollout.vllm.sleep_level": level}, **settings
    )


@pytest.mark.parametrize("level", [2, 1])
def test_weights_restored_before_every_generation(warm_model_dir, tmp_path, fake_vllm, fake_cuda, level):
    evaluation = {"eval.pass_k": [1, 2], "eval.pass_n": 2, "task.n_val": 6}
    rollout = {"rollout.group_size": 2, "rollout.max_new_tokens": 24}
    cfg = sleeping_vllm_config(warm_model_dir, tmp_path / "run", level, algo="dapo", **evaluation, **rollout)
    trainer = Trainer(cfg)
    try:
        fake, model_dir = fake_vllm[-1], str(trainer.parts.engine.model_dir)
        assert fake.enable_sleep_mode and trainer.parts.engine.sleep_level == level
        fake_cuda(fake_vllm)
        seen = spy_generate(trainer)
        trainer.evaluate(0)  # (a) greedy, then sampled pass@k: a wake with no sync before it
        assert [p.greedy for p in seen] == [True, False]
        rounds = [trainer.train_step(step)["rollout_rounds"] for step in (1, 2)]  # (b)
        assert max(rounds) > 1, "dynamic sampling resampled within a step"
        trainer.evaluate(2)
        assert len(seen) == 4 + sum(rounds) and fake.calls.count(("generate", len(trainer.parts.val_examples))) == 4
        restores = check_wakes(fake.calls, level, model_dir)
        sync_dir = str(trainer.parts.engine._sync_dir)
        if level == 2:
            # all but 3 generations woke from a level-2 sleep with no sync before them; the first
            # (the engine starts awake) and the first after each of the 2 syncs wake the KV cache only.
            # Before any sync (eval 0 sampled, step 1's rounds) the checkpoint is reloaded, then the
            # synced weights (step 2's rounds but its first, eval 2 sampled).
            assert restores == [model_dir] * (1 + rounds[0]) + [sync_dir] * (rounds[1] - 1 + 1)
        else:  # level 1 copies the weights back: nothing to reload but the syncs
            assert restores == []
        assert fake.calls.count(("reset_prefix_cache",)) == 2  # one per sync
    finally:
        trainer.close()
    assert fake.calls[-1] == ("shutdown",)


@pytest.mark.parametrize("level", [2, 1])
def test_bench_rollout_timing(warm_model_dir, tmp_path, fake_vllm, fake_cuda, level):
    """(c) bench: warm-up and timed generations before any sync, then syncs."""
    cfg = sleeping_vllm_config(warm_model_dir, tmp_path / "run", level, **{"rollout.max_new_tokens": 16})
    trainer = Trainer(cfg)
    try:
        fake_cuda(fake_vllm)
        seen = spy_generate(trainer)
        result = time_rollout(trainer.parts, repeats=2)
        assert result["tokens"] > 0 and len(seen) == 3
        fake = fake_vllm[-1]
        restores = check_wakes(fake.calls, level, str(trainer.parts.engine.model_dir))
        assert restores == ([str(trainer.parts.engine.model_dir)] * 2 if level == 2 else [])
        prompts = [trainer.parts.prompt_ids[e.id] for e in trainer.parts.prompts.take(2)]
        trainer.parts.engine.generate(
            prompts, 2, trainer.parts.collector.sampling_params(9, 0)
        )  # after the syncs: synced weights
        check_wakes(fake.calls, level, str(trainer.parts.engine.model_dir))
    finally:
        trainer.close()


@pytest.mark.parametrize("level", [2, 1])
def test_sync_while_asleep_then_generate(warm_model_dir, fake_vllm, fake_cuda, level):
    """The call sequence itself: a sync wakes only the weights (vLLM's RL order; level 1 brings the
    old weights back first, overwritten by the load), the KV cache wakes at the next generation; a
    later level-2 wake reloads the last synced folder, a level-1 wake copies the weights back."""
    engine = VLLMEngine(warm_model_dir, sleep_level=level, dtype="float32")
    try:
        fake = fake_vllm[-1]
        fake_cuda(fake_vllm)
        model = AutoModelForCausalLM.from_pretrained(warm_model_dir, dtype=torch.float32)
        prompts = [engine.tokenizer("1+2=", add_special_tokens=False)["input_ids"]]
        params = SamplingParams(max_new_tokens=8, temperature=1.0, seed=3)
        engine.generate(prompts, 2, params)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        engine.sync_weights(ModelWeights(model))
        folder = str(engine._sync_dir)
        assert fake.calls[-5:] == [
            ("sleep", level),
            ("empty_cache",),
            ("wake_up", ("weights",)),
            ("collective_rpc", "grpolab_reload_weights", {"weights_path": folder}),
            ("reset_prefix_cache",),
        ]
        out = engine.generate(prompts, 2, params)
        assert fake.calls[-5:] == [
            ("reset_prefix_cache",),
            ("empty_cache",),
            ("wake_up", ("kv_cache",)),
            ("generate", 1),
            ("sleep", level),
        ]
        assert same(fake.generated_with[-1], params_of(model))
        assert_same(out, hf_reference(model, engine.tokenizer, engine.eos_token_ids, prompts, 2, params))
        calls = len(fake.calls)
        engine.generate(prompts, 1, replace(params, temperature=0.0))  # no sync in between
        restore = [("collective_rpc", "grpolab_reload_weights", {"weights_path": folder})] if level == 2 else []
        assert fake.calls[calls:] == [
            ("empty_cache",),
            ("wake_up", ("weights",)),
            *restore,
            ("empty_cache",),
            ("wake_up", ("kv_cache",)),
            ("generate", 1),
            ("sleep", level),
        ]
        assert same(fake.generated_with[-1], params_of(model))
    finally:
        engine.close()


def test_an_adapter_synced_after_a_level_2_sleep_comes_with_the_base_every_time(warm_model_dir, fake_vllm, fake_cuda):
    """vLLM's own LoRA (``lora_rank``): a sync moves only the adapter, but a level-2 sleep lost the base too, so
    each wake reloads the base (its checkpoint), then the adapter in place; requests name it without reloading."""
    from grpolab.config import LoraSettings
    from grpolab.models.lora import AdapterWeights, add_adapter

    engine = VLLMEngine(warm_model_dir, sleep_level=2, dtype="float32", lora_rank=2)
    try:
        fake = fake_vllm[-1]
        fake_cuda(fake_vllm)
        assert fake.kwargs["enable_lora"] and fake.kwargs["max_lora_rank"] == 8 and fake.kwargs["max_loras"] == 1
        model = AutoModelForCausalLM.from_pretrained(warm_model_dir, dtype=torch.float32)
        adapter = add_adapter(model, LoraSettings(rank=2), seed=0, base_dir=warm_model_dir)
        prompts = [engine.tokenizer("1+2=", add_special_tokens=False)["input_ids"]]
        params = SamplingParams(max_new_tokens=4, temperature=0.0)
        engine.generate(prompts, 1, params)  # no adapter yet: the base, no LoRA request
        assert fake.calls[-1] == ("sleep", 2) and fake.calls[-2] == ("generate", 1)
        engine.sync_weights(AdapterWeights(adapter))
        base = ("collective_rpc", "grpolab_reload_weights", {"weights_path": str(warm_model_dir)})
        folder = str(engine._sync_dir / "adapter")
        assert fake.calls[-6:] == [
            ("sleep", 2),
            ("empty_cache",),
            ("wake_up", ("weights",)),
            base,
            ("add_lora", folder, True),
            ("reset_prefix_cache",),
        ]
        assert sorted(p.name for p in Path(folder).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
        engine.generate(prompts, 1, params)
        calls = len(fake.calls)
        engine.generate(prompts, 1, params)  # no sync in between: the wake restores both
        assert fake.calls[calls:] == [
            ("empty_cache",),
            ("wake_up", ("weights",)),
            base,
            ("add_lora", folder, True),
            ("empty_cache",),
            ("wake_up", ("kv_cache",)),
            ("generate", 1, folder, False),
            ("sleep", 2),
        ]
    finally:
        engine.close()


def test_missing_restore_is_caught(warm_model_dir, fake_vllm):
    """The stand-in is a real check: the old wake (a bare wake_up, no reload) fails on level 2."""
    engine = VLLMEngine(warm_model_dir, sleep_level=2, dtype="float32")
    try:
        prompts = [engine.tokenizer("1+2=", add_special_tokens=False)["input_ids"]]
        engine.generate(prompts, 1, SamplingParams(max_new_tokens=4, temperature=0.0))
        engine.llm.wake_up()
        with pytest.raises(RuntimeError, match="never reloaded"):
            engine.llm.generate(
                [{"prompt_token_ids": prompts[0]}],
                [engine.sampling_params(SamplingParams(max_new_tokens=4, temperature=0.0), 1, None)],
            )
    finally:
        engine.close()


# ---- temperature and seeds ---------------------------------------------------------------------
def test_temperature_above_vllm_limit_refused(warm_model_dir, fake_vllm):
    from vllm import SamplingParams as VSamplingParams
    from vllm.exceptions import VLLMValidationError

    VSamplingParams(temperature=VLLM_MAX_TEMPERATURE)  # the constant is vLLM's own limit
    with pytest.raises(VLLMValidationError, match=r"temperature must be in \[0, 2\]"):
        VSamplingParams(temperature=VLLM_MAX_TEMPERATURE + 0.01)
    engine = VLLMEngine(warm_model_dir, sleep_level=2, dtype="float32")
    try:
        with pytest.raises(ValueError, match=r"temperature 2\.5 is above vLLM's limit of 2"):
            engine.generate([[5, 6]], 2, SamplingParams(max_new_tokens=4, temperature=2.5, seed=0))
        assert fake_vllm[-1].calls == [], "refused before touching the engine"
    finally:
        engine.close()


def wrapping_seed(modulus: int) -> int:
    """The seed whose scaled value ``seed * stride`` is -1 modulo ``modulus``: a request seed at the
    very top of the range when reduced modulo 2**63 (as before) or modulo 2**63 // n (now)."""
    return (modulus - 1) * pow(_SEED_STRIDE, -1, modulus) % modulus


@pytest.mark.parametrize("seed", [0, 7, 2**62, 2**63 - 1, 2**200 + 12345, -5, "top", "top/n"])
@pytest.mark.parametrize("n", [1, 8, 7])
def test_request_seeds_stay_int64_and_distinct(seed, n):
    """Every seed vLLM uses (child j of request i: ``request_seed + j``, vLLM's ParentRequest) is
    in [0, 2**63) and no two samples of one call share one."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.v1.engine.parallel_sampling import ParentRequest

    seed = {"top": wrapping_seed(2**63), "top/n": wrapping_seed(2**63 // n) + 2**80}.get(seed, seed)
    prompts = 300
    used = []
    for i in range(prompts):
        base = request_seed(seed, i, n)
        sp = VSamplingParams(n=n, temperature=1.0, seed=base)
        parent = ParentRequest(SimpleNamespace(params=sp, request_id=str(i), external_req_id=str(i)))
        used += [parent.get_child_info(j)[1].seed for j in range(n)] if n > 1 else [base]
    assert all(0 <= s < 2**63 for s in used)
    assert len(set(used)) == prompts * n
    assert request_seed(None, 3, n) is None


def test_huge_seed_through_the_engine(warm_model_dir, fake_vllm):
    """n = 8 at the edge: the stand-in asserts each child seed vLLM derives is < 2**63."""
    engine = VLLMEngine(warm_model_dir, dtype="float32")
    try:
        prompts = [engine.tokenizer(s, add_special_tokens=False)["input_ids"] for s in ("1+2=", "3+4=", "5+5=")]
        for seed in (2**63 - 1, wrapping_seed(2**63), wrapping_seed(2**63 // 8)):
            out = engine.generate(prompts, 8, SamplingParams(max_new_tokens=4, temperature=1.0, seed=seed))
            assert [len(g) for g in out] == [8, 8, 8]
        assert {c[0] for c in fake_vllm[-1].calls} == {"generate"}, "no sleep_level: never sleeps"
    finally:
        engine.close()
