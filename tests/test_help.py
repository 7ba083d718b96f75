"""The front door: every config field in --help and docs/config.md, "did you mean" for a mistyped field, the
resolved config as TOML that loads back, and train that asks for a config instead of starting the demo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpolab.commands.cli import main, names_own_run, parse_overrides
from grpolab.commands.fields import config_toml, markdown
from grpolab.config import ConfigError, RunConfig, config_fields, load_config, load_run_config

ROOT = Path(__file__).resolve().parents[1]


def error_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]


def help_of(command: str, capsys) -> str:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


# ---- --help ---------------------------------------------------------------------------------------------------
def test_every_field_has_a_description():
    missing = [f"{f.name} ({f.variant})" if f.variant else f.name for f in config_fields() if not f.description]
    assert not missing, f"fields without a description: {missing}"


@pytest.mark.parametrize("command", ["train", "demo", "probe", "bench", "config"])
def test_help_lists_every_dotted_field_with_type_default_and_description(command, capsys):
    """train --help used to show --config and --resume only, demo --help nothing but -h."""
    text = help_of(command, capsys)
    for field in config_fields():
        if not field.is_section:
            assert f"  --{field.name} " in text, field.name
    for line in (
        "--optim.lr float, > 0 = 0.0001",
        "--model.lora.rank int, > 0 = 8",  # a nested, optional section
        '--rollout.vllm.lora_sync "merged" | "adapter" = "merged"',
        "--task.train_path str = required",  # a task kind's field
        "--task.rewards[].function str = required",
        '--algorithm.name str = "grpo"',
        "--threads int | none, >= 1 = None",
        "AdamW's learning rate (constant)",  # the description under it
    ):
        assert line in text, line
    short, top, model = (text.index(f"\n{line}") for line in ("  --algo ", "  --steps ", "[model]"))
    assert short < top < model  # the short names first, then the top-level fields, then the sections
    assert '[task] name = "gsm8k"' in text and '[task.tools] (task.name = "calculator")' in text


def test_algorithms_help_says_what_it_prints(capsys):
    text = help_of("algorithms", capsys)
    assert "Prints every algorithm preset" in text and "loss formula" in text


def test_the_help_listing_does_not_load_the_model_code_until_asked():
    """Every command builds the parser; report and compare must not import torch through it."""
    import subprocess
    import sys

    code = "import sys; from grpolab.commands.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_docs_config_md_is_the_generated_reference():
    assert (ROOT / "docs" / "config.md").read_text() == markdown(), (
        "docs/config.md differs from the fields' descriptions: regenerate it with "
        "`python -m grpolab.commands.fields > docs/config.md`"
    )


# ---- did you mean ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argument", "line"),
    [
        ("--optim.lrr", "optim.lrr: unknown field; did you mean optim.lr?"),
        ("--optimm.lr", "optimm.lr: unknown field; did you mean optim.lr?"),
        ("--model.lora.rnak", "model.lora.rnak: unknown field; did you mean model.lora.rank?"),
        ("--rollout.vllm.sleep-levl", "rollout.vllm.sleep_levl: unknown field; did you mean rollout.vllm.sleep_level?"),
        ("--task.digts", "task.digts: unknown field; did you mean task.digits?"),
        ("--algorithm.eps_hihg", "algorithm.eps_hihg: unknown field; did you mean algorithm.eps_high?"),
        ("--stpes", "stpes: unknown field; did you mean steps?"),
        ("--enigne", "enigne: unknown field; did you mean engine (short for rollout.engine)?"),
        ("--zzzzzz", "zzzzzz: unknown field (grpolab train --help lists every field)"),
    ],
)
def test_a_mistyped_override_names_the_closest_field_in_one_line(argument, line, tmp_path, capsys):
    """It used to be pydantic's 'Extra inputs are not permitted', with nothing to go on."""
    out = tmp_path / "run"
    assert main(["train", "--task", "arithmetic", argument, "2", "--output-dir", str(out)]) == 2
    assert error_lines(capsys) == [f"error: {line}"]
    assert not out.exists()


def test_a_mistyped_toml_key_at_any_depth_names_the_closest_field(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_text(
        'steps = 2\nthreds = 1\n\n[rollout]\ngroup_sise = 4\n\n[model.lora]\nrnak = 4\n\n[task]\nname = "dataset"\n'
        'train = "rows.jsonl"\nvalidation_size = 2\n\n[[task.rewards]]\nfunction = "numeric"\nweigth = 1\n'
    )
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), "--model", str(tmp_path), "--output-dir", str(out)]) == 2
    assert sorted(error_lines(capsys)) == [
        "error: model.lora.rnak: unknown field; did you mean model.lora.rank?",
        "error: rollout.group_sise: unknown field; did you mean rollout.group_size?",
        "error: task.rewards[].weigth: unknown field; did you mean task.rewards[].weight?",
        "error: threds: unknown field; did you mean threads?",
    ]
    assert not out.exists()


def test_a_mistyped_warm_start_setting_names_the_closest(capsys):
    assert main(["config", "--model.warm_start", '{arhc = "qwen3"}']) == 2
    (line,) = error_lines(capsys)
    assert line.endswith("model.warm_start.arhc: unknown field; did you mean model.warm_start.arch?"), line


def test_bad_values_keep_their_one_line_per_field(capsys):
    assert main(["config", "--optim.lr", "-1", "--rollout.group_size", "zero"]) == 2
    assert error_lines(capsys) == [
        "error: rollout.group_size: Input should be a valid integer, unable to parse string as an integer",
        "error: optim.lr: Input should be greater than 0",
    ]


# ---- grpolab config ---------------------------------------------------------------------------------------------
ROUND_TRIPS = {
    "defaults": [],
    "algorithm and sections": [
        "--algo",
        "dapo",
        "--algorithm.eps_high",
        "0.2",  # the class default, but not dapo's 0.28: it must be written
        "--steps",
        "5",
        "--optim.lr",
        "3e-4",
        "--optim.betas",
        "[0.8, 0.9]",
        "--model.lora.rank",
        "8",  # the default rank: LoRA on, all defaults
        "--eval.pass_k",
        "[1, 2]",
        "--model.warm_start",
        '{arch = "qwen3_moe", num_experts = 4}',
    ],
    "task of another kind": [
        "--model",
        "some/model",
        "--task",
        "dataset",
        "--task.train",
        "rows.jsonl",
        "--task.validation_size",
        "0.1",
        "--task.rewards",
        '[{function = "numeric", options = {tolerance = 0.5}}, {function = "math", weight = 0}]',
        "--task.prompt.format",
        "chat",
        "--task.prompt.answer",
        "boxed",
        "--task.prompt.chat_template_kwargs",
        "{enable_thinking = false}",
    ],
    "a kind's own tool defaults": ["--task", "calculator", "--task.tools", '{enabled = ["calculator"], max_turns = 5}'],
}


@pytest.mark.parametrize("every_field", [False, True], ids=["differences", "all"])
@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_grpolab_config_prints_toml_that_loads_back_to_the_same_config(case, every_field, tmp_path, capsys):
    args = ROUND_TRIPS[case]
    assert main(["config", *args, *(["--all"] if every_field else [])]) == 0
    text = capsys.readouterr().out
    config = tmp_path / "resolved.toml"
    config.write_text(text)
    expected = load_config(None, parse_overrides(args))
    assert load_config(config) == expected
    assert main(["config", "--config", str(config)]) == 0  # and once more: a fixed point
    assert capsys.readouterr().out == config_toml(expected)


def test_config_prints_only_what_differs_unless_all(capsys):
    assert main(["config", "--algo", "dapo", "--steps", "5"]) == 0
    text = capsys.readouterr().out
    body = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert body == ["steps = 5", "[algorithm]", 'name = "dapo"']  # dapo's own settings come with its name
    assert main(["config", "--all"]) == 0
    every = capsys.readouterr().out
    assert "lr = 0.0001" in every and "# output_dir = None" in every and "[rollout.vllm]" in every


def test_a_none_toml_cannot_say_is_refused_in_one_line(tmp_path, capsys):
    data = RunConfig().model_dump(mode="json")
    data["rollout"]["sync_noise_multiple"] = None  # possible in a JSON config, not in TOML
    config = tmp_path / "run.json"
    config.write_text(json.dumps(data))
    assert main(["config", "--config", str(config)]) == 2
    assert error_lines(capsys) == [
        "error: rollout.sync_noise_multiple is None, which TOML cannot write (its default is not None); keep "
        "this config as JSON"
    ]


# ---- train without a config ---------------------------------------------------------------------------------------
def test_train_without_a_config_is_refused_before_anything_moves(tmp_path, monkeypatch, capsys):
    """`grpolab train` alone silently started the whole demo."""
    monkeypatch.chdir(tmp_path)
    for args in ([], ["--steps", "2"], ["--output-dir", "run", "--threads", "1"], ["--task.n_val", "16"]):
        assert main(["train", *args]) == 2
        assert error_lines(capsys) == [
            "error: train needs --config FILE.toml (or --resume RUN_DIR, or a model or task of its own: --model "
            "DIR, --task NAME); `grpolab demo` runs the built-in demo"
        ]
    assert list(tmp_path.iterdir()) == []


def test_a_model_or_task_on_the_command_line_is_a_run_of_its_own():
    for overrides in ({"model": "DIR"}, {"model.path": "DIR"}, {"task": "calculator"}, {"task.name": "gsm8k"}):
        assert names_own_run(overrides), overrides
    for overrides in ({}, {"steps": 2, "output_dir": "x"}, {"task.n_val": 16}, {"model.lora.rank": 8}):
        assert not names_own_run(overrides), overrides


# ---- resume ---------------------------------------------------------------------------------------------------------
def test_a_resume_accepts_threads_and_still_refuses_what_changes_results(tmp_path):
    """--threads was refused on resume although the CPU threads change no result (tests/test_resume_safety.py
    resumes a real run with it)."""
    (tmp_path / "config.json").write_text(json.dumps(RunConfig(output_dir=str(tmp_path)).model_dump(mode="json")))
    assert load_run_config(tmp_path, {"threads": 2, "log_every": 5, "steps": 200}).threads == 2
    with pytest.raises(ConfigError) as refused:
        load_run_config(tmp_path, {"threads": 2, "optim.lr": 0.5})
    assert str(refused.value) == (
        "a resumed run keeps its config; only steps, log_every, threads, model.revision may change (got --optim.lr)"
    )
