"""A run whose rollouts an environment drives: a task class of the user's own (``chat_envs:EchoTask``) with an
``Environment``, trained by ``grpolab train`` through the endpoint over the hf engine."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
from chat_envs import chatml_model_dir

from grpolab.commands.cli import main
from grpolab.run.resume import check_data


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return chatml_model_dir(tmp_path_factory.mktemp("envrun"))


def train(chat_dir, out, *extra):
    return main(
        [
            "train",
            "--model",
            str(chat_dir),
            "--output-dir",
            str(out),
            "--steps",
            "2",
            "--task.name",
            "chat_envs:EchoTask",
            "--rollout.prompts_per_step",
            "2",
            "--rollout.group_size",
            "2",
            "--rollout.max_new_tokens",
            "40",
            "--eval.every",
            "2",
            "--threads",
            "1",
            *extra,
        ]
    )


def test_an_environment_task_trains_with_its_terms_logged_and_its_identity_in_the_manifest(
    tmp_path, chat_dir, monkeypatch, caplog
):
    key = "endpoint-key-" + "k" * 30  # the endpoint's random key, known here: the rollouts send it, no file holds it
    monkeypatch.setattr("grpolab.rollout.endpoint.secrets", SimpleNamespace(token_urlsafe=lambda n: key))
    out = tmp_path / "run"
    with caplog.at_level(logging.DEBUG):
        assert train(chat_dir, out) == 0
    assert key not in caplog.text
    for path in out.rglob("*"):
        assert not path.is_file() or key.encode() not in path.read_bytes(), path
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "reward_mean" in line]
    assert len(steps) == 2
    for record in steps:
        assert {"reward/hit", "reward/size"} <= record.keys() and record.get("reward/environment_failed", 0) == 0
        assert abs(record["reward_mean"] - (record["reward/hit"] + 0.5 * record["reward/size"])) < 1e-6
        # the environment's message between the two turns is masked out of the loss
        assert record["tokens/masked_observation"] > 0 and record["metric_tokens"] == record["tokens/policy"]
        assert record["tokens/policy"] + record["tokens/masked_observation"] == record["response_tokens"]
    items = [json.loads(line) for line in (out / "eval" / "step_000002.jsonl").read_text().splitlines()]
    assert len(items) == 4 and all(item["turns"] == 2 for item in items)
    data = json.loads((out / "manifest.json").read_text())["data"]
    assert data["environment"] == {"name": "echo-game", "version": "1", "settings": {"turns": 2}}
    assert data["train_rows"] == 8 and len(data["train_sha256"]) == 64


def test_a_resume_refuses_another_environment(tmp_path):
    from grpolab.config import ConfigError

    recorded = {"environment": {"name": "echo-game", "version": "1", "settings": {"turns": 2}}, "train_rows": 8}
    journal = SimpleNamespace(data={"data": recorded}, run_dir=tmp_path)
    check_data(journal, dict(recorded))
    with pytest.raises(ConfigError, match="environment"):
        check_data(journal, {**recorded, "environment": {**recorded["environment"], "version": "2"}})


def test_async_rollouts_of_an_environment_at_staleness_0_equal_sync_ones(tmp_path, chat_dir):
    """The environment drives the engine process of async rollouts as it drives the run's own engine."""
    runs = {}
    for mode in ("sync", "async"):
        out = tmp_path / mode
        assert train(chat_dir, out, "--rollout.mode", mode, "--rollout.max_staleness", "0") == 0
        lines = (out / "metrics.jsonl").read_text().splitlines()
        runs[mode] = [json.loads(line)["reward_mean"] for line in lines if "reward_mean" in line]
    assert runs["async"] == runs["sync"]
