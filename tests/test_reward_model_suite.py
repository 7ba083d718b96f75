"""Reward models in suites and probes: a suite records each reward model's folder and the SHA-256 of its
files (hashed, not copied), a run's manifest.json records the same, a reward model changed after the suite
was prepared fails its run with one line before anything starts (the queue stops, resume goes on once the
folder is restored), and `grpolab probe` counts the reward models' memory."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from reward_model_fixtures import save_reward_model
from rich.console import Console
from suite_runs import toml_runs, write_hook, write_suite
from test_dataset_run import write_problems
from test_reward_model_run import rm_config

from grpolab.commands.cli import main
from grpolab.commands.probe import run_probe
from grpolab.common.progress import Reporter
from grpolab.config import load_config, validate_config
from grpolab.models.reward_model import RewardModel
from grpolab.studies.manifest import SuiteManifest
from grpolab.studies.suite.runner import prepare_suite
from grpolab.studies.suite.verify import reward_model_problem
from grpolab.tasks.folder_hash import model_files, model_sha256, tree_sha256
from grpolab.tasks.reward_model_spec import reward_model_spec

pytest_plugins = ["suite_fixtures"]  # the fake trainer


def rm_suite_file(tmp_path: Path, model_dir: Path, rm: str) -> Path:
    """Two one-step runs on a dataset task whose RL reward is the reward model ``rm`` (a folder)."""
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(0).shuffle(pairs)
    train, val = (
        write_problems(tmp_path / "train.jsonl", pairs[:24]),
        write_problems(tmp_path / "val.jsonl", pairs[24:28]),
    )
    base = f"""[base]
steps = 1
threads = 1
[base.model]
path = "{model_dir}"
[base.task]
name = "dataset"
train = "{train}"
validation = "{val}"
question_field = "problem"
answer_field = "result"
[[base.task.rewards]]
function = "numeric"
name = "correct"
weight = 0.0
[[base.task.rewards]]
function = "model:{rm}"
name = "rm"
options = {{ batch_size = 8 }}
[base.rollout]
prompts_per_step = 2
group_size = 4
max_new_tokens = 16
[base.optim]
micro_batch_size = 8
[base.eval]
every = 1
[base.checkpoint]
every = 1
"""
    return write_suite(tmp_path, "rm", base, toml_runs({"name": "a", "algo": "grpo"}, {"name": "b", "algo": "dr_grpo"}))


@pytest.fixture
def rm_copy(tokenizer, tmp_path) -> Path:
    """A tiny random reward model of the test's own, which the test may change."""
    return save_reward_model(tmp_path / "rm", tokenizer, max_positions=512)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_suite_records_its_reward_models_folder_and_hash_and_names_it_absolutely(
    warm_model_dir, rm_copy, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the suite file names the reward model relatively: "model:rm"
    manifest = prepare_suite(rm_suite_file(tmp_path, warm_model_dir, "rm"), tmp_path / "out", Console(quiet=True))
    files = model_files(rm_copy)
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(files)
    expected = [{"name": "rm", "path": str(rm_copy.resolve()), "sha256": tree_sha256(files), "files": files}]
    for record in manifest.runs:
        assert record.reward_models == expected
        assert record.config["task"]["rewards"][1]["function"] == f"model:{rm_copy.resolve()}"
    assert SuiteManifest.load(tmp_path / "out").runs[0].reward_models == expected
    assert not any((tmp_path / "out" / "snapshot").rglob("*.safetensors")), "hashed, not copied"
    assert reward_model_problem(manifest.runs[0], Reporter(Console(quiet=True))) is None
    # hidden entries (a clone's .git, a download's .cache) are no part of the model
    (rm_copy / ".cache").mkdir()
    (rm_copy / ".cache" / "notes").write_text("x")
    assert model_sha256(rm_copy) == expected[0]["sha256"]


@pytest.mark.parametrize(
    "change, what",
    [
        ("flip", "model.safetensors was changed"),
        ("add", "extra.bin was added"),
        ("remove", "tokenizer_config.json was removed"),
        ("folder", "the folder is missing"),
    ],
)
def test_each_kind_of_change_of_a_reward_model_is_named(change, what, warm_model_dir, rm_copy, tmp_path):
    manifest = prepare_suite(rm_suite_file(tmp_path, warm_model_dir, rm_copy), tmp_path / "out", Console(quiet=True))
    if change == "flip":
        flip_a_byte(rm_copy / "model.safetensors")
    elif change == "add":
        (rm_copy / "extra.bin").write_bytes(b"\0")
    elif change == "remove":
        (rm_copy / "tokenizer_config.json").unlink()
    else:
        shutil.rmtree(rm_copy)
    assert reward_model_problem(manifest.runs[0], Reporter(Console(quiet=True))) == (
        f"reward model {rm_copy} changed since the suite was prepared: {what}; restore it and resume, "
        "or make a new suite"
    )


FLIP_WHEN_THE_FIRST_RUN_ENDS = """
import atexit
from pathlib import Path
def flip():
    done = Path({done!r})
    if not done.exists():  # the first run process to end changes the reward model under the queue
        weights = Path({weights!r})
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
        done.touch()
atexit.register(flip)
"""


def a_changed_reward_model_fails_its_run_until_restored(
    root: Path, rm_copy: Path, tmp_path: Path, capsys, in_run_processes: Callable[[str], object]
) -> SuiteManifest:
    """``suite resume`` of the suite in ``root`` (prepared, not run) three times: with ``rm_copy``'s weights
    changed (run a fails at once, not started); restored, and changed again as run a's process ends (b fails, not
    started); restored again (both complete). ``in_run_processes(code)``: every later run process runs ``code``
    first. Returns the suite's final manifest."""
    weights = rm_copy / "model.safetensors"
    original = weights.read_bytes()
    line = (
        f"reward model {rm_copy} changed since the suite was prepared: model.safetensors was changed; "
        "restore it and resume, or make a new suite"
    )
    # changed before the suite runs: run a fails at once, b stays queued, nothing started
    flip_a_byte(weights)
    assert main(["suite", "resume", str(root)]) == 1
    out = capsys.readouterr().out
    a, b = SuiteManifest.load(root).runs
    assert (a.state, b.state) == ("failed", "queued") and a.reason == line
    assert a.exit_code is None and a.pid is None and a.command == [] and not a.attempts
    assert not Path(a.run_dir).exists() and not (root / "logs").exists(), "nothing started"
    assert f"run a: failed, not started ({line})" in out and f"suite stopped at run a (failed): {line}" in out
    # restored, resume runs a; the folder changes while a trains (when its process ends): b fails, not started
    weights.write_bytes(original)
    in_run_processes(FLIP_WHEN_THE_FIRST_RUN_ENDS.format(done=str(tmp_path / "flipped"), weights=str(weights)))
    assert main(["suite", "resume", str(root)]) == 1
    a, b = SuiteManifest.load(root).runs
    assert (a.state, b.state) == ("completed", "failed") and b.reason == line and not Path(b.run_dir).exists()
    assert weights.read_bytes() != original
    # restored again, resume finishes the suite
    weights.write_bytes(original)
    assert main(["suite", "resume", str(root)]) == 0
    manifest = SuiteManifest.load(root)
    assert [r.state for r in manifest.runs] == ["completed", "completed"]
    return manifest


@pytest.mark.slow  # default tier: the same with fake runs, and a run's record of its reward model, below
def test_a_changed_reward_model_fails_its_run_before_it_starts_and_resume_goes_on_once_restored(
    warm_model_dir, rm_copy, tmp_path, capsys, monkeypatch
):
    root = tmp_path / "out"
    prepare_suite(rm_suite_file(tmp_path, warm_model_dir, rm_copy), root, Console(quiet=True))

    def in_run_processes(code: str) -> None:
        monkeypatch.setenv("PYTHONPATH", str(write_hook(tmp_path, code)))

    manifest = a_changed_reward_model_fails_its_run_until_restored(root, rm_copy, tmp_path, capsys, in_run_processes)
    for record in manifest.runs:  # each run's own manifest.json names the same folder and SHA-256
        data = json.loads((Path(record.run_dir) / "manifest.json").read_text())["data"]
        assert data["rewards"][1]["model_dir"] == record.reward_models[0]["path"] == str(rm_copy)
        assert data["rewards"][1]["model_sha256"] == record.reward_models[0]["sha256"] == model_sha256(rm_copy)
        assert "model_dir" not in data["rewards"][0]


def test_a_changed_reward_model_fails_its_run_before_it_starts_and_resume_goes_on_once_restored_with_fake_runs(
    warm_model_dir, rm_copy, fake_runs, tmp_path, capsys
):
    root = tmp_path / "out"
    prepare_suite(rm_suite_file(tmp_path, warm_model_dir, rm_copy), root, Console(quiet=True))
    fake_runs.use()

    def in_run_processes(code: str) -> None:
        fake_runs.use(extra=code)

    manifest = a_changed_reward_model_fails_its_run_until_restored(root, rm_copy, tmp_path, capsys, in_run_processes)
    for record in manifest.runs:
        assert record.reward_models[0]["path"] == str(rm_copy)
        assert record.reward_models[0]["sha256"] == model_sha256(rm_copy)


def test_a_runs_data_record_names_its_reward_models_folder_and_hash_as_its_suite_does(
    warm_model_dir, rm_copy, tmp_path
):
    """What a run's manifest.json records of its task's data (the task's data fingerprint) names each reward
    model's folder and SHA-256 as the suite recorded them; the reward's own folder only for a reward model."""
    manifest = prepare_suite(rm_suite_file(tmp_path, warm_model_dir, rm_copy), tmp_path / "out", Console(quiet=True))
    for record in manifest.runs:
        data = load_config(record.config_file).task.build().data_fingerprint()
        assert data["rewards"][1]["model_dir"] == record.reward_models[0]["path"] == str(rm_copy)
        assert data["rewards"][1]["model_sha256"] == record.reward_models[0]["sha256"] == model_sha256(rm_copy)
        assert "model_dir" not in data["rewards"][0]


def test_the_probe_counts_the_reward_models_memory(warm_model_dir, rm_copy, tmp_path):
    cfg = rm_config(
        warm_model_dir,
        rm_copy,
        tmp_path / "unused",
        tmp_path,
        **{"rollout.prompts_per_step": 2, "rollout.group_size": 4, "rollout.max_new_tokens": 8},
    )
    report = run_probe(cfg, tmp_path / "probe.json")
    rm = RewardModel.load(reward_model_spec(f"model:{rm_copy}", "rm", 1.0, {}), torch.device("cpu"))
    held = report["parameters"]["bytes"]
    weights = sum(t.numel() * t.element_size() for t in rm.model.parameters())
    buffers = sum(t.numel() * t.element_size() for t in rm.model.buffers())  # the rotary frequencies
    assert held["reward_models"] == weights + buffers and weights > 1000 * buffers
    assert held["total"] == sum(v for k, v in held.items() if k != "total")
    plain = run_probe(
        validate_config({**cfg.model_dump(mode="json"), "task": {"name": "arithmetic"}}), tmp_path / "plain.json"
    )
    assert plain["parameters"]["bytes"]["reward_models"] is None
