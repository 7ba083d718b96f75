"""The tool protocol: calls parsed and checked against the tool's schema, every failure an error
observation (never an exception); the tools settings; the prompts that say how to call."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpolab.config import ConfigError, load_config
from grpolab.tasks import build_task
from grpolab.tasks.calculator import CalculatorTask, tool_solution
from grpolab.tasks.datasets import text_sha256
from grpolab.tasks.r1_zero import R1_ZERO_TEMPLATE, r1_zero_prompt
from grpolab.tools import Toolset

TOOLS = Toolset(["calculator"])


def call(expression) -> str:
    return json.dumps({"name": "calculator", "arguments": {"expression": expression}})


def test_a_valid_call_runs_the_tool():
    result = TOOLS.execute(call("37*24+15"))
    assert result.error is None and result.name == "calculator" and result.arguments == {"expression": "37*24+15"}
    assert result.observation == "<tool_response>903</tool_response>"


@pytest.mark.parametrize(
    "text, reason",
    [
        ("37*24", "not valid JSON"),
        ('{"name": "calculator", "arguments": {"expression": "1+1"}', "not valid JSON"),
        ("[" * 3500 + "]" * 3500, "longer than"),
        ("[" * 900 + "]" * 900, "a call is"),
        ('["calculator", {"expression": "1"}]', "a call is"),
        ('{"name": "calculator"}', "a call is"),
        ('{"name": 3, "arguments": {}}', "a call is"),
        ('{"name": "calculator", "arguments": {"expression": "1"}, "extra": 1}', "a call is"),
        ('{"name": "python", "arguments": {"code": "import os"}}', "unknown tool 'python'"),
        ('{"name": "calculator", "arguments": {}}', "'expression' is a required property"),
        ('{"name": "calculator", "arguments": {"expression": 12}}', "expression: 12 is not of type 'string'"),
        ('{"name": "calculator", "arguments": {"expression": "1", "mode": "x"}}', "Additional properties"),
        (call("1" * 201), "expression: "),
        (call("__import__('os')"), "not allowed"),
        (call("1/0"), "zero"),
    ],
)
def test_a_bad_call_is_an_error_observation(text, reason):
    result = TOOLS.execute(text)
    assert result.error is not None and reason in result.error, result.error
    assert result.observation == f"<tool_response>error: {result.error}</tool_response>"
    assert len(result.observation) < 250  # the model's own text is never echoed at length


def test_a_closing_tag_without_an_opening_tag_is_an_error():
    assert TOOLS.call_text('{"name": "calculator"}</tool_call>') is None
    assert "without <tool_call>" in TOOLS.execute(None).error
    assert TOOLS.call_text(f"thinking <tool_call>{call('2+2')}</tool_call>") == call("2+2")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400) | st.builds(call, st.text(max_size=250)))
def test_execute_never_raises(text):
    result = TOOLS.execute(text)
    assert result.observation.startswith("<tool_response>") and result.observation.endswith("</tool_response>")
    assert (result.error is None) == (not result.observation.startswith("<tool_response>error:"))


def test_segments_split_out_the_observations():
    text = tool_solution(TOOLS, "2*3+4", "10")
    pieces = TOOLS.segments(text)
    assert "".join(p for p, _ in pieces) == text
    assert [p for p, obs in pieces if obs] == ["<tool_response>10</tool_response>"]
    assert TOOLS.segments("no tools here") == [("no tools here", False)]


def test_toolset_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="unknown tools"):
        Toolset(["shell"])
    with pytest.raises(ValueError, match="max_turns"):
        Toolset(["calculator"], max_turns=1)


def test_tools_settings_are_validated_up_front():
    with pytest.raises(ConfigError, match="unknown tools shell"):
        load_config(
            None,
            {
                "model.path": "m",
                "task.name": "gsm8k",
                "task.train_path": "a",
                "task.test_path": "b",
                "task.tools.enabled": ["shell"],
            },
        )
    with pytest.raises(ConfigError, match="needs tools.enabled to include 'calculator'"):
        load_config(None, {"task.name": "calculator", "task.tools.enabled": []})
    cfg = load_config(None, {"task.name": "calculator"})  # the tiny model is warm-started for it
    assert cfg.task.tools.enabled == ["calculator"] and cfg.model.path is None


def test_the_r1_zero_prompt_with_tools_says_how_to_call(tmp_path):
    rows = [{"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3+4=7\n#### 7"}]
    for name in ("train.jsonl", "test.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths = {
        "train_path": str(tmp_path / "train.jsonl"),
        "test_path": str(tmp_path / "test.jsonl"),
        "n_train": 1,
        "n_val": 1,
    }
    plain = build_task({"name": "gsm8k", **paths})
    tools = build_task({"name": "gsm8k", **paths, "tools": {"enabled": ["calculator"]}})
    example = plain.train_examples()[0]
    assert plain.prompt(example) == R1_ZERO_TEMPLATE.format(question=example.question)
    prompt = tools.prompt(example)
    assert prompt == r1_zero_prompt(example.question, tools.toolset.instruction())
    assert '<tool_call>{"name": ..., "arguments": {...}}</tool_call>' in prompt and "calculator:" in prompt
    assert prompt.endswith(f"User: {example.question}\nAssistant: <think>")
    assert plain.data_fingerprint()["prompt_template_sha256"] != tools.data_fingerprint()["prompt_template_sha256"]
    assert plain.toolset is None and tools.toolset.max_turns == 4


def test_the_calculator_task_mixes_tool_use_and_direct_demonstrations():
    task = CalculatorTask(n_train=400, n_val=50, tool_demos=0.5)
    train = task.train_examples()
    uses = [e for e in train if "<tool_call>" in e.solution]
    assert 150 < len(uses) < 250
    assert not {e.question for e in train} & {e.question for e in task.validation_examples()}
    for example in train[:20]:
        a, rest = example.question.split("*")
        b, c = rest.split("+")
        assert example.answer == str(int(a) * int(b) + int(c))
        grade = task.grade(example.solution, example, truncated=False)
        assert grade.answer_reward == 1.0 and grade.format_reward == 1.0
    assert "To compute, call <tool_call>" in task.prompt(train[0])
    assert CalculatorTask(n_train=10, n_val=5).train_examples() == CalculatorTask(n_train=10, n_val=5).train_examples()


TOOLS_CHAT_TEMPLATE = (  # a Qwen3-like template's tools block: the function schemas as JSON in the system turn
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.mark.parametrize(
    "prompt",
    [
        {"format": "r1_zero"},
        {"format": "chat", "answer": "answer_tags"},
        {"format": "template", "template": "{tools}Q: {question}\nA:", "answer": "last_number"},
    ],
)
def test_dataset_prompts_with_tools(tmp_path, prompt):
    from conftest import build_char_tokenizer

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"What is {i}*7?", "answer": str(7 * i)}) + "\n" for i in range(4)))
    table = {
        "name": "dataset",
        "train": str(rows),
        "validation_size": 1,
        "prompt": prompt,
        "rewards": [{"function": "numeric"}],
    }
    task = build_task({**table, "tools": {"enabled": ["calculator"], "max_turns": 3}})
    plain = build_task(table) if prompt["format"] != "template" else None
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TOOLS_CHAT_TEMPLATE
    for t in filter(None, (task, plain)):
        t.bind_tokenizer(tokenizer)
    example = task.train_examples()[0]
    text = task.prompt(example)
    assert task.toolset.max_turns == 3 and example.question in text
    if prompt["format"] == "chat":
        assert json.dumps(task.toolset.schemas()[0]) in text and "# Tools" not in plain.prompt(example)
    else:
        assert task.toolset.instruction() in text
    if plain is not None:
        assert (
            plain.prompt(example) != text
            and plain.data_fingerprint()["prompt_template_sha256"] != task.data_fingerprint()["prompt_template_sha256"]
        )


def test_a_tools_field_without_tools_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"names \{tools\} but task.tools.enabled is empty"):
        load_config(
            None,
            {
                "model.path": "m",
                "task.name": "dataset",
                "task.train": "x.jsonl",
                "task.validation_size": 1,
                "task.prompt.format": "template",
                "task.prompt.template": "{tools}{question}",
                "task.prompt.answer": "last_number",
            },
        )


def test_the_gsm8k_calculator_config_runs_a_step(long_context_model_dirs, tmp_path):
    """configs/gsm8k_calculator_qwen3_0.6b.toml on real GSM8K rows (a tiny random model: the wiring, not the skill)."""
    from grpolab.run.trainer import train

    cfg = load_config(
        "configs/gsm8k_calculator_qwen3_0.6b.toml",
        {
            "model": str(long_context_model_dirs["qwen3"]),
            "output_dir": str(tmp_path / "run"),
            "steps": 1,
            "task.n_train": 4,
            "task.n_val": 2,
            "rollout.prompts_per_step": 2,
            "rollout.group_size": 2,
            "rollout.max_new_tokens": 24,
            "reference": "none",
            "model.gradient_checkpointing": False,
        },
    )
    assert cfg.task.tools.enabled == ["calculator"] and cfg.task.tools.max_turns == 6
    summary = train(cfg)
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 1 and "tool/call_rate" in records[1] and "val/tool/call_rate" in records[0]
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    task = build_task(cfg.task)
    assert manifest["data"]["prompt_template_sha256"] == text_sha256(
        r1_zero_prompt("{question}", task.toolset.instruction())
    )


def test_the_warm_start_trains_on_the_policy_text_only():
    from grpolab.models.tinymodel import _encode, _segments, _tags, build_tokenizer

    task = CalculatorTask(n_train=60, n_val=5, tool_demos=1.0)
    pairs = [(task.prompt(e), e.solution) for e in task.train_examples()]
    tokenizer = build_tokenizer((p + s for p, s in pairs), vocab_size=300, tags=_tags(task))
    for tag in task.toolset.tags():  # the protocol's tags are single tokens of the tiny vocabulary
        assert len(tokenizer(tag, add_special_tokens=False)["input_ids"]) == 1
    ((ids, trained),) = _encode(tokenizer, pairs[:1], _segments(task))
    prompt, solution = pairs[0]
    pieces = [tokenizer(prompt, add_special_tokens=False)["input_ids"]] + [
        tokenizer(text, add_special_tokens=False)["input_ids"] for text, _ in task.toolset.segments(solution)
    ]
    assert ids == [t for piece in pieces for t in piece] + [tokenizer.eos_token_id]
    observation = tokenizer(
        "<tool_response>" + task.train_examples()[0].answer + "</tool_response>", add_special_tokens=False
    )["input_ids"]
    n_prompt, n_call = len(pieces[0]), len(pieces[1])
    assert trained == [False] * n_prompt + [True] * n_call + [False] * len(observation) + [True] * (len(pieces[3]) + 1)
    assert ids[n_prompt + n_call : n_prompt + n_call + len(observation)] == observation
