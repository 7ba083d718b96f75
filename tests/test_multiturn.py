"""Multi-turn rollouts: the turn loop's bookkeeping (on a scripted stand-in engine), then each real
engine (hf, and vLLM's CPU build) on a warm-started tool model: observation spans are exactly the
executor's output tokens, the policy mask is 0 on exactly those spans, and the engine's log-probs of
the policy's tokens match the trainer's within the sync limits."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import QUICK_WARM_START, build_char_tokenizer, run_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.learning.batching import collate
from grpolab.models.logprobs import token_logprobs
from grpolab.models.tinymodel import warm_start_model
from grpolab.rollout.base import Completion, SamplingParams
from grpolab.rollout.hf.engine import HFEngine
from grpolab.rollout.multiturn import MultiTurnEngine, tool_metrics
from grpolab.rollout.sync_check import verify_weight_sync
from grpolab.tasks.calculator import CalculatorTask
from grpolab.tools import Toolset

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "%s"}}</tool_call>'


class ScriptedEngine:
    """A stand-in single-turn engine (char tokenizer) that continues each context with a scripted turn:
    ``script(context_text) -> text``. It keeps the engine contract: cut after the first stop string or
    EOS (finish "stop"), or at max_new_tokens ("length"); log-prob -0.5 per token. Records every call."""

    def __init__(self, tokenizer, script):
        self.tokenizer, self.script, self.calls = tokenizer, script, []
        self.eos_token_ids = [tokenizer.eos_token_id]

    def generate(self, prompts, n, params):
        self.calls.append((len(prompts), n, params))
        groups = []
        for prompt in prompts:
            text = self.script(self.tokenizer.decode(prompt, skip_special_tokens=False))
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            finish, cut = "length", min(len(ids), params.max_new_tokens)
            for end in range(1, len(ids) + 1):
                piece = self.tokenizer.decode(ids[:end], skip_special_tokens=False)
                if ids[end - 1] in self.eos_token_ids or any(s in piece for s in params.stop_strings):
                    finish, cut = ("stop", end) if end <= params.max_new_tokens else ("length", params.max_new_tokens)
                    break
            ids = ids[:cut]
            groups.append(
                [Completion(list(prompt), ids, [-0.5] * len(ids), finish, self.tokenizer.decode(ids)) for _ in range(n)]
            )
        return groups

    def sync_weights(self, model):
        pass

    def close(self):
        pass


@pytest.fixture(scope="module")
def char_tok():
    return build_char_tokenizer()


def _run(char_tok, script, prompts=("Q: 2*3?",), n=1, budget=200, max_turns=4):
    engine = ScriptedEngine(char_tok, script)
    tools = Toolset(["calculator"], max_turns=max_turns)
    multi = MultiTurnEngine(engine, tools, char_tok)
    ids = [char_tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    out = multi.generate(ids, n, SamplingParams(max_new_tokens=budget, seed=5, stop_strings=("</answer>",)))
    return out, engine


def _check_spans(completion: Completion, tokenizer) -> None:
    """Mask 0 exactly on the recorded observation spans, and each span holds the observation's tokens."""
    zeros = [i for i, m in enumerate(completion.mask) if m == 0]
    spans = [i for call in completion.tool_calls for i in range(call["start"], call["end"])]
    assert zeros == spans
    for call in completion.tool_calls:
        expected = tokenizer(call["observation"], add_special_tokens=False)["input_ids"]
        got = completion.completion_ids[call["start"] : call["end"]]
        assert got == expected[: len(got)] and (got == expected or completion.truncated)
        assert all(lp == 0.0 for lp in completion.logprobs[call["start"] : call["end"]])


def test_a_call_is_run_and_the_next_turn_continues_from_its_observation(char_tok):
    def script(context):
        return CALL % "2*3" if "<tool_response>" not in context else " </think> <answer> 6 </answer><eos>"

    out, engine = _run(char_tok, script, prompts=("Q: 2*3?", "Q: 4*5?"), n=3)
    assert [len(g) for g in out] == [3, 3]
    c = out[0][0]
    assert c.turns == 2 and c.finish_reason == "stop" and len(c.tool_calls) == 1
    assert c.text == CALL % "2*3" + "<tool_response>6</tool_response> </think> <answer> 6 </answer>"
    assert c.tool_calls[0]["error"] is None and c.tool_calls[0]["arguments"] == {"expression": "2*3"}
    _check_spans(c, char_tok)
    # one engine call per turn, over the trajectories still active; turn seeds differ, the call tag stops
    assert [(k, n) for k, n, _ in engine.calls] == [(2, 3), (6, 1)]
    first, second = engine.calls[0][2], engine.calls[1][2]
    assert first.seed == 5 and second.seed not in (None, 5)
    assert first.stop_strings == second.stop_strings == ("</answer>", "</tool_call>")
    assert second.max_new_tokens == 200 - len(
        char_tok(CALL % "2*3" + "<tool_response>6</tool_response>", add_special_tokens=False)["input_ids"]
    )


def test_bad_calls_are_error_observations_and_the_turn_limit_holds(char_tok):
    turns = ['<tool_call>{"name": "calc"}</tool_call>', CALL % "1+", CALL % "2+2", " never"]

    def script(context):
        return turns[context.count("<tool_response>")]

    c = _run(char_tok, script, budget=400, max_turns=3)[0][0][0]
    errors = [call["error"] for call in c.tool_calls]
    assert errors[:2] == ['a call is {"name": "<tool>", "arguments": {...}}', "unexpected end of expression"]
    assert errors[2] == "turn limit reached: not executed" and c.tool_calls[2]["observation"] == ""
    assert c.turns == 3 and c.finish_reason == "stop" and not c.truncated
    assert c.text.endswith(CALL % "2+2")  # nothing after the unexecuted call
    _check_spans(c, char_tok)
    metrics = tool_metrics([c], [False])
    assert metrics["tool/errors"] == 3 and metrics["tool/valid_call_rate"] == 0 and metrics["tool/turns_mean"] == 3


def test_the_budget_covers_observations_and_truncates(char_tok):
    call = CALL % "2*3"
    n_call = len(char_tok(call, add_special_tokens=False)["input_ids"])
    script = lambda context: call if "<tool_response>" not in context else " </think> <answer> 6 </answer>"  # noqa: E731
    # the observation does not fit: cut at the budget, truncated
    c = _run(char_tok, script, budget=n_call + 5)[0][0][0]
    assert len(c.completion_ids) == n_call + 5 and c.truncated and c.turns == 1
    assert c.tool_calls[0]["end"] - c.tool_calls[0]["start"] == 5
    _check_spans(c, char_tok)
    # the second turn does not fit: cut there, truncated
    n_obs = len(char_tok("<tool_response>6</tool_response>", add_special_tokens=False)["input_ids"])
    c = _run(char_tok, script, budget=n_call + n_obs + 4)[0][0][0]
    assert len(c.completion_ids) == n_call + n_obs + 4 and c.truncated and c.turns == 2
    assert c.mask[-4:] == [1, 1, 1, 1]
    _check_spans(c, char_tok)


def test_single_turn_completions_pass_through(char_tok):
    c = _run(char_tok, lambda context: " </think> <answer> 6 </answer><eos>")[0][0][0]
    assert c.turns == 1 and c.tool_calls == [] and c.mask == [1] * len(c.completion_ids)
    metrics = tool_metrics([c], [True])
    assert metrics["tool/call_rate"] == 0 and "tool/valid_call_rate" not in metrics
    assert metrics["tool/accuracy_without_calls"] == 1 and "tool/accuracy_with_calls" not in metrics


# ---- the real engines on a warm-started tool model ----------------------------------------------
TOOL_TASK = {"n_train": 300, "n_val": 16, "tool_demos": 1.0}
TOOL_WARM_START = QUICK_WARM_START.model_copy(update={"steps": 120})  # head_dim 32 suits vLLM


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory):
    task = CalculatorTask(**TOOL_TASK)
    return task, warm_start_model(task, TOOL_WARM_START, cache_dir=tmp_path_factory.mktemp("tool_cache"))


def _sample(engine, task, tokenizer, n=4):
    prompts = [tokenizer(task.prompt(e), add_special_tokens=False)["input_ids"] for e in task.validation_examples()[:8]]
    multi = MultiTurnEngine(engine, task.toolset, tokenizer)
    return [c for group in multi.generate(prompts, n, SamplingParams(max_new_tokens=48, seed=3)) for c in group]


def _check_against_trainer(completions, task, tokenizer, model_dir):
    with_calls = [c for c in completions if any(call["error"] is None for call in c.tool_calls)]
    assert len(with_calls) >= 4, "the warm-started model should call the calculator"
    for c in completions:
        _check_spans(c, tokenizer)
        for call in c.tool_calls:  # the executor's output, re-run
            assert call["observation"] == "" or call["observation"] == task.toolset.execute(call["text"]).observation
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    batch = collate(completions, tokenizer.pad_token_id)
    assert (
        batch.token_counts()["tokens/masked_observation"]
        == sum(c["end"] - c["start"] for x in completions for c in x.tool_calls)
        > 0
    )
    with torch.no_grad():
        trainer = token_logprobs(model, batch.input_ids, batch.attention_mask).logprobs
    check = verify_weight_sync(
        batch.engine_logprobs, trainer, batch.response_mask, max_abs_diff=1e-3, mean_abs_diff=1e-4
    )
    assert check.num_tokens == batch.num_response_tokens


def test_hf_engine_multi_turn_spans_and_logprobs(tool_model):
    task, model_dir = tool_model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    completions = _sample(HFEngine(model, tokenizer), task, tokenizer)
    _check_against_trainer(completions, task, tokenizer, model_dir)
    print(json.dumps(tool_metrics(completions, [False] * len(completions))))


@pytest.mark.slow  # ~30 s (a vLLM engine); default tier: the same checks on the hf engine (MultiTurnEngine wraps
# any engine) and test_rollout_vllm.py's vLLM log-probs with stop strings
def test_vllm_engine_multi_turn_spans_and_logprobs(tool_model):
    pytest.importorskip("vllm")
    from grpolab.rollout.vllm.engine import VLLMEngine

    task, model_dir = tool_model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = VLLMEngine(model_dir, tokenizer, dtype="float32", seed=0, max_model_len=128, enforce_eager=True)
    try:
        completions = _sample(engine, task, tokenizer)
    finally:
        engine.close()
    _check_against_trainer(completions, task, tokenizer, model_dir)


def test_a_tool_task_run_logs_tool_use_and_masked_tokens(tool_model, tmp_path):
    from grpolab.run.trainer import train

    _, model_dir = tool_model
    cfg = run_config(
        model_dir,
        tmp_path / "run",
        {
            "steps": 2,
            "task.name": "calculator",
            **{f"task.{k}": v for k, v in TOOL_TASK.items()},
            "rollout.prompts_per_step": 4,
            "rollout.group_size": 4,
            "rollout.max_new_tokens": 48,
            "optim.micro_batch_size": 16,
            "eval.every": 2,
            "checkpoint.every": 2,
            "log_every": 1,
        },
    )
    train(cfg)
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train_steps = [r for r in steps if "reward_mean" in r]
    for r in train_steps:
        assert r["tool/call_rate"] > 0 and r["tokens/masked_observation"] == r["tool/observation_tokens"] > 0
        assert r["tokens/policy"] + r["tokens/masked_observation"] == r["response_tokens"]
        assert r["metric_tokens"] == r["tokens/policy"]  # the loss's tokens
    evals = [r for r in steps if "val/accuracy" in r]
    assert all("val/tool/call_rate" in r for r in evals)
    records = [json.loads(line) for line in (tmp_path / "run" / "eval" / "step_000002.jsonl").read_text().splitlines()]
    called = [r for r in records if r.get("tool_calls")]
    assert called and all(
        r["completion"].count("<tool_response>") == sum(c["observation"] != "" for c in r["tool_calls"]) for r in called
    )
    from rich.console import Console

    from grpolab.common.progress import Reporter
    from grpolab.studies.report import write_report

    write_report(tmp_path / "run", Reporter(Console()))
    report = (tmp_path / "run" / "report" / "report.md").read_text()
    assert "## Tool use" in report


@pytest.mark.slow  # about 6.5 minutes on 2 cores: the default 300-step warm start, then 40 RL steps
def test_rl_on_the_tool_task_learns(tmp_path, monkeypatch):
    """The built-in tool task from its warm start: greedy validation accuracy rises with RL."""
    from grpolab.config import load_config
    from grpolab.run.trainer import train

    monkeypatch.setenv("GRPOLAB_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(2)
    try:
        cfg = load_config(
            None,
            {
                "task.name": "calculator",
                "output_dir": str(tmp_path / "run"),
                "steps": 40,
                "eval.every": 20,
                "eval.n_examples": 200,
                "checkpoint.every": 40,
                "threads": 2,
            },
        )
        summary = train(cfg)
    finally:
        torch.set_num_threads(int(os.environ.get("GRPOLAB_TEST_THREADS", "1")))
    start, final = summary["val_accuracy"]["start"], summary["val_accuracy"]["final"]
    assert final >= start + 0.15, (start, final)
    evals = [
        json.loads(line)
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if "val/accuracy" in line
    ]
    assert evals[-1]["val/tool/accuracy_with_calls"] > evals[0]["val/tool/accuracy_with_calls"]
