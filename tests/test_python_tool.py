"""The Python tool (``grpolab.tools.python_tool``): the model's code runs in the bubblewrap sandbox and what it
printed is the observation; the code's own failures are error observations counted by kind; a sandbox that
fails makes its trajectory a failed sample (graded neither 0 nor anything); calls of one turn run at once."""

from __future__ import annotations

import json
import shutil
import time

import pytest
from conftest import build_char_tokenizer
from test_multiturn import ScriptedEngine

from grpolab.config import ConfigError, validate_config
from grpolab.rollout.base import SamplingParams
from grpolab.rollout.multiturn import MultiTurnEngine, tool_metrics
from grpolab.tools.protocol import SandboxSettings, Toolset

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)")

FAST = SandboxSettings(wall_seconds=3, cpu_seconds=1, max_output_chars=120)


def call(code: str) -> str:
    return json.dumps({"name": "python", "arguments": {"code": code}})


@pytest.fixture(scope="module")
def tools():
    return Toolset(["python", "calculator"], sandbox=FAST)


def test_what_the_code_prints_is_the_observation(tools):
    result = tools.execute(call("print(1234 * 5678)"))
    assert (result.error, result.kind, result.observation) == (None, None, "<tool_response>7006652</tool_response>")


@pytest.mark.parametrize(
    "code, kind, says",
    [
        ("print('half'); 1 / 0", "exception", "half\n"),  # what it printed first, then the error's last line
        ("while True: pass", "timeout", "timed out"),
        ("print('x' * 100000)", "output_limit", "...(cut)\nprinted more than the output limit"),
        ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed", "killed (exit code 137)"),
    ],
)
def test_the_codes_own_failures_are_error_observations_of_their_kind(tools, code, kind, says):
    result = tools.execute(call(code))
    assert result.kind == kind and result.error is not None
    assert says in result.observation and len(result.observation) <= FAST.max_output_chars + 40
    if kind == "exception":
        assert result.observation.endswith("ZeroDivisionError: division by zero</tool_response>")


def test_the_sandbox_failing_ends_the_trajectory_as_a_failed_sample(monkeypatch):
    tokenizer = build_char_tokenizer()
    tools = Toolset(["python"], sandbox=FAST)
    monkeypatch.setattr(tools.tools["python"].run.sandbox, "python", "/usr/bin/no-such-python")  # after its start
    engine = ScriptedEngine(tokenizer, lambda context: f"<tool_call>{call('print(6)')}</tool_call> more")
    multi = MultiTurnEngine(engine, tools, tokenizer)
    prompt = tokenizer("Q: 2*3?", add_special_tokens=False)["input_ids"]
    [[completion]] = multi.generate([prompt], 1, SamplingParams(max_new_tokens=200, seed=0))
    assert completion.grade is not None and completion.grade.failure == "sandbox" and not completion.grade.ok
    assert "the code sandbox failed" in completion.grade.error and completion.turns == 1
    assert completion.tool_calls[0]["kind"] == "sandbox" and completion.num_policy_tokens == len(
        completion.completion_ids
    )
    assert tool_metrics([completion], [False])["tool/errors/sandbox"] == 1


def test_a_turns_calls_run_at_once_and_come_back_in_order():
    tools = Toolset(["python"], sandbox=SandboxSettings(workers=4))
    texts = [call(f"import time; time.sleep(0.5); print({i})") for i in range(4)]
    start = time.monotonic()
    results = tools.execute_many(texts)
    assert [r.observation for r in results] == [f"<tool_response>{i}</tool_response>" for i in range(4)]
    assert time.monotonic() - start < 1.6  # four half-second calls side by side, not one after another
    assert Toolset(["calculator"]).workers == 1  # calls of microseconds: no pool


def test_the_tool_in_a_config_and_its_sandbox_settings():
    def config(sandbox):
        task = {"name": "gsm8k", "train_path": "train.jsonl", "test_path": "test.jsonl"}
        tools = {"enabled": ["python"], "sandbox": sandbox}
        return validate_config({"model": {"path": "org/name"}, "task": {**task, "tools": tools}})

    cfg = config({"cpu_seconds": 2})
    assert cfg.task.tools.sandbox.cpu_seconds == 2
    toolset = cfg.task.tools.build()
    assert list(toolset.tools) == ["python"] and "Run a Python 3 program" in toolset.instruction()
    assert toolset.tools["python"].run.sandbox.limits.cpu_seconds == 2
    with pytest.raises(
        ConfigError, match="task.tools.sandbox.cpu_secs: unknown field; did you mean task.tools.sandbox.cpu_seconds"
    ):
        config({"cpu_secs": 2})


def test_a_run_that_needs_the_sandbox_where_bubblewrap_is_missing_is_one_line(monkeypatch, tmp_path, capsys):
    from grpolab.commands.cli import main

    monkeypatch.setenv("PATH", "/nonexistent")
    args = ["--task.name", "calculator", "--task.tools.enabled", '["calculator", "python"]', "--steps", "1"]
    assert main(["train", *args, "--output-dir", str(tmp_path / "run")]) == 2
    out = capsys.readouterr().out
    assert out.startswith("error: bwrap not found: the code sandbox needs bubblewrap") and len(out.splitlines()) == 1
    assert "task.tools.sandbox.unsafe = true" in out and not (tmp_path / "run").exists()
