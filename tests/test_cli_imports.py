"""The commands that only read settings answer at once: ``grpolab --help`` and each sub-command's (the
field listing of train, demo, config, probe and bench too), ``grpolab config``, ``grpolab algorithms`` and
every refusal of a field or value import neither torch nor transformers nor any other heavy package (each
costs seconds before the first line; ``benchmarks/cli_startup.py`` times them). Each command runs as
``python -m grpolab`` in an interpreter of its own (this one has imported torch already), which writes the
names of the modules it imported at its exit; the interpreters run side by side."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = frozenset(
    """
    torch transformers tokenizers safetensors accelerate huggingface_hub vllm peft trl datasets math_verify
    numpy scipy sympy pandas matplotlib reasoning_gym verifiers
    """.split()
)
"""Packages that only a run (loading a model, grading, a report's figures) needs."""

CONFIG = """
steps = 20
[model]
path = "org/model"
[task]
name = "gsm8k"
train_path = "train.jsonl"
test_path = "test.jsonl"
[algorithm]
name = "dapo"
[rollout]
prompts_per_step = 4
[optim]
lr = 3e-5
"""

# the grpolab command under its real entry point; the modules it imported go to the file named first
PROBE = """
import atexit, json, runpy, sys

report = sys.argv.pop(1)
atexit.register(lambda: open(report, "w").write(json.dumps(sorted(sys.modules))))
runpy.run_module("grpolab", run_name="__main__", alter_sys=True)
"""

FIELD_LINE = "--optim.lr float, > 0 = 0.0001"  # in the field listing of every command that reads a config

ANSWERS = {  # arguments -> (exit status, a line it prints)
    "--help": (0, "train with a TOML config"),
    **{f"{command} --help": (0, FIELD_LINE) for command in ("train", "demo", "config", "probe", "bench")},
    "algorithms": (0, "dapo "),
    "config --config run.toml": (0, 'name = "dapo"'),
    "config --config run.toml --all": (0, "lr = 3e-05"),
}

REFUSALS = {  # what is refused -> (arguments, what its one error line says)
    "a mistyped field": ("train --config run.toml --optim.lrr 1", "did you mean optim.lr?"),
    "a bad value": ("train --config run.toml --optim.lr -1", "optim.lr"),
    "a rule between sections": ("demo --model.warm_start {arch='mixtral'}", "model.warm_start"),
    "an engine's": ("config --config run.toml --engine vllm --rollout.temperature 3", "vLLM engine"),
    "train without a config": ("train --algo dapo", "train needs --config"),
}


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, set[str]]]:
    """Every command of this module, run at once: arguments -> (its process, the top-level packages it imported)."""
    folder = tmp_path_factory.mktemp("cli_imports")
    (folder / "run.toml").write_text(CONFIG)
    every = [*ANSWERS, *(args for args, _ in REFUSALS.values())]
    env = {**os.environ, "COLUMNS": "100"}  # the help wraps to the terminal's width
    running = {
        args: subprocess.Popen(
            [sys.executable, "-c", PROBE, str(folder / f"modules-{i}.json"), *args.split()],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, args in enumerate(every)
    }
    done = {}
    for i, (args, process) in enumerate(running.items()):
        out, err = process.communicate(timeout=300)
        report = folder / f"modules-{i}.json"
        assert report.is_file(), f"grpolab {args}: {err[-2000:]}"
        imported = {name.split(".")[0] for name in json.loads(report.read_text())}
        done[args] = (subprocess.CompletedProcess(args, process.returncode, out, err), imported)
    return done


@pytest.mark.parametrize("args", ANSWERS)
def test_help_algorithms_and_config_import_no_heavy_package(args, commands):
    done, imported = commands[args]
    status, line = ANSWERS[args]
    assert done.returncode == status and line in done.stdout, done.stdout[-2000:] + done.stderr[-2000:]
    assert not imported & HEAVY, sorted(imported & HEAVY)


@pytest.mark.parametrize("case", REFUSALS)
def test_a_refusal_imports_no_heavy_package(case, commands):
    args, says = REFUSALS[case]
    done, imported = commands[args]
    errors = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(errors) == 1 and says in errors[0], done.stdout + done.stderr[-2000:]
    assert not imported & HEAVY, sorted(imported & HEAVY)
