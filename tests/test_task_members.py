"""The task contract's members are typed, with defaults: every built-in task inherits ``Task``, a plain task
class of a user's own gets the defaults through ``PlainTask``, and nothing in the package probes a task for a
member."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import get_type_hints

import pytest
from conftest import GSM8K_DIR

import grpolab
from grpolab.models.tinymodel import WarmStartSettings
from grpolab.tasks import BUILT_IN, Example, Task, build_task
from grpolab.tasks.base import OPTIONAL_MEMBERS, REQUIRED_MEMBERS, PlainTask
from grpolab.tasks.reward_model_spec import RewardModelSpec
from grpolab.tools import Toolset

PROBE = re.compile(r"\b(getattr|hasattr)\(\s*(self\.|parts\.|cfg\.)?(task|t)\b")
"""A look-up of a member by name on a task or its settings (``getattr(task, "toolset", None)``)."""


def test_no_package_module_probes_a_task_for_a_member():
    package = Path(grpolab.__file__).parent
    found = [
        f"{path.relative_to(package)}:{n}: {line.strip()}"
        for path in sorted(package.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if PROBE.search(line)
    ]
    assert found == []


def test_every_member_of_the_contract_is_typed():
    hints = get_type_hints(Task)
    for member in REQUIRED_MEMBERS + OPTIONAL_MEMBERS:
        value = getattr(Task, member, None)
        if callable(value):
            assert "return" in get_type_hints(value), member
        else:
            assert member in hints, member


# The built-in tasks over an environment package (the [envs] extra), each checked where its package is installed
ENVIRONMENT_PACKAGES = {"openenv": "openenv-core", "verifiers": "verifiers", "reasoning_gym": "reasoning-gym"}


def built_in_task(tmp_path: Path, name: str) -> Task:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"question": f"{i}+{i}", "answer": str(2 * i)}) + "\n" for i in range(6)))
    settings = {
        "arithmetic": {"n_train": 4, "n_val": 2},
        "calculator": {"n_train": 4, "n_val": 2},
        "chat_arithmetic": {"n_val": 2},
        "gsm8k": {
            "train_path": str(GSM8K_DIR / "train.jsonl"),
            "test_path": str(GSM8K_DIR / "test.jsonl"),
            "n_train": 2,
            "n_val": 2,
        },
        "dataset": {"train": str(rows), "validation_size": 2},
        "openenv": {"app": "openenv_envs:GuessEnvironment"},
        "verifiers": {"environment": "vf_single", "validation_size": 2},  # a verifiers environment (tests/vf_single.py)
        "reasoning_gym": {"generators": [{"name": "gcd"}], "n_train": 4, "n_val": 2, "prompt": "r1_zero"},
        "code": {"n_train": 4, "validation": "generated", "n_val": 2},
    }
    assert set(settings) == set(BUILT_IN)
    return build_task({"name": name, **settings[name]})


@pytest.mark.parametrize("name", sorted(BUILT_IN))
def test_every_built_in_task_is_a_task_with_typed_members(tmp_path, name):
    package = ENVIRONMENT_PACKAGES.get(name)
    if package is not None and not installed(package):
        pytest.skip(f"task.name '{name}' needs {package}: pip install 'grpolab[envs]'")
    if name == "code" and shutil.which("bwrap") is None:
        pytest.skip("task.name 'code' needs bubblewrap (apt-get install bubblewrap)")
    task = built_in_task(tmp_path, name)
    assert isinstance(task, Task) and task.name == name
    assert task.toolset is None or isinstance(task.toolset, Toolset)
    assert isinstance(task.reward_models, Sequence)
    assert all(isinstance(spec, RewardModelSpec) for spec in task.reward_models)
    assert isinstance(task.warm_start_overrides, Mapping)
    WarmStartSettings(**task.warm_start_overrides)
    # chat_arithmetic's prompts need a tokenizer's chat template first; openenv's examples come from the server
    # its first examples start (tests/test_openenv.py)
    if name not in ("chat_arithmetic", "openenv"):
        assert isinstance(task.prompt_template(), str)
        assert isinstance(task.messages(task.validation_examples()[0]), list)
        assert task.data_fingerprint() is None or isinstance(task.data_fingerprint(), dict)
    if name == "arithmetic":
        assert build_task({"name": "arithmetic"}).data_fingerprint() is None  # the manifest records "data": null


def installed(distribution: str) -> bool:
    try:
        version(distribution)
    except PackageNotFoundError:
        return False
    return True


def test_a_plain_task_class_gets_the_defaults_and_keeps_its_own_members():
    task = build_task({"name": "custom_task:CountdownTask", "n": 4})
    assert isinstance(task, PlainTask) and task.name == "countdown"
    example = task.validation_examples()[0]
    assert (task.toolset, tuple(task.reward_models), dict(task.warm_start_overrides)) == (None, (), {})
    assert task.data_fingerprint() is None
    assert task.messages(example) == [{"role": "user", "content": "4-1=<think>"}]
    assert task.prompt_template() == "{question}=<think>"
    assert task.grade_batch([(" <answer> 3 </answer>", example, False)]) == [
        task.grade(" <answer> 3 </answer>", example, False)
    ]
    task.bind_tokenizer(object())  # a no-op

    class Own:  # a plain class with some optional members of its own
        name = "own"
        toolset = Toolset(["calculator"])
        warm_start_overrides = {"steps": 5}

        def train_examples(self) -> list[Example]:
            return []

        validation_examples = train_examples

        def prompt(self, example: Example) -> str:
            return "p"

        def grade(self, completion, example, truncated):
            raise RuntimeError("a user's bug")

        def data_fingerprint(self) -> dict:
            return {"rows": 0}

    own = PlainTask(Own())
    assert own.toolset is Own.toolset and own.warm_start_overrides == {"steps": 5}
    assert own.data_fingerprint() == {"rows": 0}
    assert own.grade_batch([("x", Example("a", "q", "1"), False)])[0].failed == ("grade",)  # scored 0, counted
