"""OpenEnv environments (``task.name = "openenv"``): a real openenv-core server (``tests/openenv_envs.py``, built
from OpenEnv's base classes) started as a subprocess by grpolab, its episodes read as examples, stepped by
rollouts; a server that does not start is refused in one line with its log's tail and left running nowhere;
a step that hangs fails the rollout instead of hanging it."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request

from grpolab.tasks.configs import build_task
from grpolab.tasks.datasets import file_sha256
from grpolab.tasks.environment import Endpoint
from grpolab.tasks.openenv_env import REWARD_TERM, OpenEnvTask

TESTS = Path(__file__).resolve().parent


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def on_path():
    """``tests/`` on the server subprocess's path (it imports ``openenv_envs``)."""
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(TESTS), old) if p)
    yield
    if old is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = old


@pytest.fixture(scope="module")
def guess(on_path):
    task = build_task(
        {"name": "openenv", "app": "openenv_envs:GuessEnvironment", "n_train": 3, "n_val": 2, "seed": 5}
        | {"system": "Play the game.", "max_turns": 3, "step_timeout_s": 2.0}
    )
    assert isinstance(task, OpenEnvTask)
    yield task
    task.environment.close()


class ScriptedChat:
    """A small OpenAI-compatible chat-completions server on 127.0.0.1 whose replies come from ``script(messages)``
    -> (text, finish_reason); it records each request's messages."""

    def __init__(self, script):
        self.script, self.requests = script, []
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def complete(request: Request):
            body = await request.json()
            self.requests.append(body["messages"])
            text, finish = self.script(body["messages"])
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            return {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"], "choices": [choice]}

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        self.endpoint = Endpoint(f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1", "policy", 256)

    def close(self):
        self.server.should_exit = True
        self.thread.join(5)


def _rollout(task, example, script):
    chat = ScriptedChat(script)
    try:
        grade = asyncio.run(task.environment.rollout(example, chat.endpoint))
    finally:
        chat.close()
    return grade, chat.requests


def test_episodes_are_seeds_read_from_the_real_server(guess):
    val, train = guess.validation_examples(), guess.train_examples()
    assert [e.id for e in val] == ["val-5", "val-6"] and [e.id for e in train] == ["train-7", "train-8", "train-9"]
    assert [e.question for e in val] == [f"Game {s}: guess my number from 1 to 4. Reply with a number." for s in (5, 6)]
    env = guess.environment
    assert env.server.running and env.action_field == "guess" and env.max_concurrency == 8
    fingerprint = guess.data_fingerprint()
    assert fingerprint["environment"]["name"] == "openenv_envs:GuessEnvironment"
    assert fingerprint["environment"]["version"] == "0.3.0"
    assert fingerprint["environment"]["settings"]["max_turns"] == 3
    assert fingerprint["app_source_sha256"] == file_sha256(TESTS / "openenv_envs.py")
    assert fingerprint["train_rows"] == 3 and fingerprint["validation_rows"] == 2


def test_a_rollout_steps_the_episode_until_done(guess):
    """Guesses 1, 2, 3, 4 in turn: the secret of seed 5 is found, the rewards summed, each observation a user turn."""
    example = guess.validation_examples()[0]
    secret = __import__("random").Random(5).randint(1, 4)
    replies = iter(["1", "2", "3", "4"])
    grade, requests = _rollout(guess, example, lambda messages: (next(replies), "stop"))
    assert len(requests) == min(secret, 3)
    assert requests[0] == [
        {"role": "system", "content": "Play the game."},
        {"role": "user", "content": example.question},
    ]
    if secret > 1:
        assert requests[1][-2:] == [{"role": "assistant", "content": "1"}, {"role": "user", "content": "No, higher."}]
    found = secret <= 3
    assert grade.answer_reward == float(found) and grade.total == float(found)
    assert grade.components == ((REWARD_TERM, float(found)),) and grade.format_reward == 1.0
    assert grade.extracted.startswith("done" if found else "max_turns")


def test_end_reasons_max_turns_and_length(guess):
    example = guess.train_examples()[0]
    grade, requests = _rollout(guess, example, lambda messages: ("banana", "stop"))
    assert len(requests) == 3 and grade.extracted.startswith("max_turns after 3 turns")
    assert requests[-1][-1] == {"role": "user", "content": "That is not a number."}
    assert (grade.reward, grade.answer_reward, grade.format_reward) == (0.0, 0.0, 1.0)
    grade, requests = _rollout(guess, example, lambda messages: ("1 2 3", "length"))
    assert len(requests) == 1 and grade.extracted.startswith("length after 1 turns")
    assert grade.format_reward == 0.0


def test_a_step_that_hangs_times_out(guess):
    """The step's answer never comes: the rollout raises within step_timeout_s (the endpoint's wrapper scores it 0
    with the term ``environment`` failed), and the server still serves the next episode."""
    example = guess.train_examples()[1]
    started = time.monotonic()
    with pytest.raises(TimeoutError):
        _rollout(guess, example, lambda messages: ("hang", "stop"))
    assert time.monotonic() - started < 10
    grade, _ = _rollout(guess, example, lambda messages: ("banana", "stop"))
    assert grade.extracted.startswith("max_turns")


def test_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="not an import path"):
        build_task({"name": "openenv", "app": "no colon"})
    with pytest.raises(ValueError, match="observation_field or task.observation_template, not both"):
        build_task({"name": "openenv", "app": "m:E", "observation_field": "a", "observation_template": "{a}"})


def test_a_server_that_fails_to_start_is_refused_and_gone(on_path):
    task = build_task({"name": "openenv", "app": "openenv_envs:NotAnEnvironment"})
    with pytest.raises(ValueError) as err:
        task.train_examples()
    first, *tail = str(err.value).splitlines()
    assert "OpenEnv server openenv_envs:NotAnEnvironment exited with code 1 before it answered" in first
    assert any("neither an OpenEnv Environment class nor an ASGI app" in line for line in tail)
    assert task.environment.server.process is None


def test_a_server_that_never_answers_is_stopped(on_path, tmp_path, monkeypatch):
    (tmp_path / "slow_env.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ['PYTHONPATH']}")
    task = build_task({"name": "openenv", "app": "slow_env:Environment", "startup_timeout_s": 1.5})
    server = task.environment.server
    pids = []
    original = server._healthy

    def healthy():
        pids.append(server.pid)
        return original()

    server._healthy = healthy
    with pytest.raises(ValueError, match=r"did not answer /health within 1.5 s \(task.startup_timeout_s\)"):
        task.environment.start()
    assert not pids or not _alive(pids[0])
