"""OpenEnv environments (``task.name = "openenv"``): a real openenv-core server (``tests/openenv_envs.py``, built
from OpenEnv's base classes) started as a subprocess by grpolab, its episodes read as examples, stepped by
rollouts; a server that does not start is refused in one line with its log's tail and left running nowhere;
a step that hangs fails the rollout instead of hanging it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from chat_envs import chatml_model_dir, chatml_tokenizer
from test_multiturn import ScriptedEngine
from transformers import AutoModelForCausalLM

from grpolab.commands.cli import main
from grpolab.models.prompt_tokens import tokenize_prompts
from grpolab.rollout.base import SamplingParams
from grpolab.rollout.environment import task_engine
from grpolab.rollout.hf.engine import HFEngine
from grpolab.tasks.configs import build_task
from grpolab.tasks.datasets import file_sha256
from grpolab.tasks.openenv_env import REWARD_TERM, ActionRejected, OpenEnvEnvironment, OpenEnvTask, OpenEnvTaskConfig

TESTS = Path(__file__).resolve().parent


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.fixture(scope="module")
def guess():
    task = build_task(
        {"name": "openenv", "app": "openenv_envs:GuessEnvironment", "n_train": 3, "n_val": 2, "seed": 5}
        | {"system": "Play the game.", "max_turns": 3, "step_timeout_s": 2.0, "max_reply_tokens": 8}
    )
    assert isinstance(task, OpenEnvTask)
    task.bind_tokenizer(chatml_tokenizer())
    task.environment.start()  # started here, it serves every test of the module (reading examples stops no server)
    yield task
    task.environment.close()


def _guesses(context: str) -> str:
    """The scripted policy: 1, 2, 3, ... one guess per turn (the turn read from the chat so far)."""
    return f"{context.count('<|im_start|>assistant')}<|im_end|>"


def _generate(task, inner, examples, n=1, budget=200):
    """``n`` rollouts of each example through grpolab's environment engine and the real endpoint over ``inner``."""
    tokenizer = task.tokenizer
    every = task.train_examples() + task.validation_examples()
    ids = dict(zip([e.id for e in every], tokenize_prompts(tokenizer, [task.prompt(e) for e in every])))
    engine = task_engine(inner, task, tokenizer, ids, every)
    try:
        groups = engine.generate([ids[e.id] for e in examples], n, SamplingParams(max_new_tokens=budget, seed=3))
    finally:
        engine.endpoint.close()  # not engine.close(): the module's server serves the next test too
    return groups, ids


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


def test_a_rollout_steps_the_episode_until_done_its_observations_masked(guess):
    """The scripted policy guesses 1, 2, 3 through the endpoint: the secret of seed 5 is found on its turn, the
    reward is the summed step rewards, and the trajectory trains on exactly the policy's tokens: each observation
    (the chat template's user turn around the environment's hint) is masked out, token by token."""
    example = guess.validation_examples()[0]
    secret = random.Random(5).randint(1, 4)
    tokenizer = guess.tokenizer
    ((completion,),), ids = _generate(guess, ScriptedEngine(tokenizer, _guesses), [example])
    grade = completion.grade
    assert completion.prompt_ids == ids[example.id]  # the task's prompt is the endpoint's first call
    assert tokenizer.decode(completion.prompt_ids).startswith("<|im_start|>system\nPlay the game.<|im_end|>")
    turns = min(secret, 3)
    assert completion.turns == turns
    expected, mask = [], []
    for turn in range(1, turns + 1):
        reply = tokenizer(f"{turn}<|im_end|>", add_special_tokens=False)["input_ids"]
        expected, mask = expected + reply, mask + [1] * len(reply)
        if turn < turns:
            hint = "higher" if turn < secret else "lower"
            seen = f"\n<|im_start|>user\nNo, {hint}.<|im_end|>\n<|im_start|>assistant\n"
            observed = tokenizer(seen, add_special_tokens=False)["input_ids"]
            expected, mask = expected + observed, mask + [0] * len(observed)
    assert completion.completion_ids == expected and completion.policy_mask == mask
    found = secret <= 3
    assert grade.answer_reward == float(found) and grade.reward == float(found)
    assert grade.components == ((REWARD_TERM, float(found)),) and grade.format_reward == 1.0
    assert grade.extracted.startswith(f"{'done' if found else 'max_turns'} after {turns} turns")


def test_end_reasons_max_turns_and_length(guess):
    example = guess.train_examples()[0]
    ((completion,),), _ = _generate(guess, ScriptedEngine(guess.tokenizer, lambda c: "banana<|im_end|>"), [example])
    assert completion.turns == 3 and completion.grade.extracted.startswith("max_turns after 3 turns")
    assert "That is not a number." in guess.tokenizer.decode(completion.completion_ids)
    assert (completion.grade.reward, completion.grade.answer_reward, completion.grade.format_reward) == (0, 0, 1)
    # the first reply is cut at max_reply_tokens (8) and stepped; the second meets the end of the 20-token budget
    long = ScriptedEngine(guess.tokenizer, lambda c: "1" * 100)
    ((completion,),), _ = _generate(guess, long, [example], budget=20)
    assert completion.grade.extracted == "length after 2 turns, last action '11111111'"
    assert completion.grade.format_reward == 0.0 and completion.truncated


def test_a_step_that_hangs_fails_the_rollout_and_the_server_goes_on(guess):
    """The step's answer never comes: the rollout fails within step_timeout_s (term ``environment``, reward 0,
    nothing trained), the other rollouts of the call are graded, and the server serves the next episodes."""
    hang = ScriptedEngine(guess.tokenizer, lambda c: ("hang" if "Game 8" in c else "banana") + "<|im_end|>")
    started = time.monotonic()
    (hung,), (fine,) = _generate(guess, hang, guess.train_examples()[1:3])[0]
    assert time.monotonic() - started < 15
    assert hung.grade.failed == ("environment",) and hung.grade.reward == 0 and hung.num_policy_tokens == 0
    assert fine.grade.failed == () and fine.grade.extracted.startswith("max_turns")


def test_a_real_tiny_model_plays_through_the_endpoint(guess, tmp_path):
    """A random tiny chat model's replies (at most max_reply_tokens each) are stepped as guesses; whatever it
    says, every masked span is an observation of the environment's and the rest is what the engine sampled."""
    model_dir = chatml_model_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = guess.tokenizer
    groups, _ = _generate(guess, HFEngine(model, tokenizer), guess.validation_examples(), n=2, budget=60)
    for group in groups:
        for completion in group:
            assert completion.grade.failed == () and dict(completion.grade.components).keys() == {REWARD_TERM}
            assert completion.turns >= 1 and completion.policy_mask[0] == 1
            spans, span = [], []
            for token, mask in zip(completion.completion_ids, completion.policy_mask):
                if mask == 0:
                    span.append(token)
                elif span:
                    spans, span = spans + [tokenizer.decode(span)], []
            assert len(spans) == completion.turns - 1
            assert all("<|im_start|>user\n" in s and s.endswith("<|im_start|>assistant\n") for s in spans)


def test_a_json_action_is_parsed_or_rejected(guess):
    async def step(action):
        async with guess.environment.client() as env:
            await env.reset(seed=1)
            return await env.step(action)

    with pytest.raises(ActionRejected, match="valid string"):  # the real server's validation error: the policy's fault
        asyncio.run(step({"guess": 3}))
    assert asyncio.run(step({"guess": "0"})).observation["message"] == "No, higher."
    env = OpenEnvEnvironment(OpenEnvTaskConfig(app="m:E", action_format="json"))
    assert env.action('```json\n{"guess": "3"}\n```') == {"guess": "3"}
    with pytest.raises(ActionRejected, match="not JSON"):
        env.action("three")
    with pytest.raises(ActionRejected, match="not an object"):
        env.action("[3]")


def test_settings_are_refused_in_one_line():
    with pytest.raises(ValueError, match="not an import path"):
        build_task({"name": "openenv", "app": "no colon"})
    with pytest.raises(ValueError, match="observation_field or task.observation_template, not both"):
        build_task({"name": "openenv", "app": "m:E", "observation_field": "a", "observation_template": "{a}"})


def test_a_server_that_never_answers_is_stopped(tmp_path, monkeypatch):
    (tmp_path / "slow_env.py").write_text("import time\ntime.sleep(600)\n")
    monkeypatch.syspath_prepend(tmp_path)  # the server imports what the run imports
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


def _servers_of(parent: int) -> list[int]:
    """The pids of the OpenEnv server processes ``parent`` started that still run."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            words = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"grpolab.tasks.openenv_server" in words and str(parent).encode() in words and _alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def _train_args(model_dir, out, app="openenv_envs:GuessEnvironment"):
    settings = {
        "model.path": model_dir,
        "output_dir": out,
        "steps": 1,
        "task.name": "openenv",
        "task.app": app,
        "task.n_train": 4,
        "task.n_val": 2,
        "task.max_turns": 2,
        "task.max_reply_tokens": 6,
        "rollout.prompts_per_step": 2,
        "rollout.group_size": 2,
        "rollout.max_new_tokens": 120,
        "optim.micro_batch_size": 4,
        "eval.every": 1,
    }
    return ["train"] + [f"--{key}={value}" for key, value in settings.items()]


def test_a_training_run_steps_the_server_and_stops_it(tmp_path, monkeypatch, capsys):
    """``grpolab train`` with task.name "openenv" on a tiny chat model: one step of rollouts the server graded, its
    reward term logged, the environment's identity in the manifest; no server left running after the run. A resume
    after the environment's source changed is refused, and leaves no server either."""
    shutil.copy(TESTS / "openenv_envs.py", tmp_path / "guess_game.py")  # an environment module the test may edit
    monkeypatch.syspath_prepend(tmp_path)
    out, before = tmp_path / "run", _servers_of(os.getpid())  # the module's own server may run
    assert main(_train_args(chatml_model_dir(tmp_path), out, app="guess_game:GuessEnvironment")) == 0
    assert _servers_of(os.getpid()) == before
    step = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "reward_mean" in line][0]
    assert step[f"reward/{REWARD_TERM}_failed"] == 0 and f"reward/{REWARD_TERM}" in step
    manifest = json.loads((out / "manifest.json").read_text())
    environment = manifest["data"]["environment"]
    assert environment["name"] == "guess_game:GuessEnvironment" and environment["version"] == "0.3.0"
    assert environment["settings"]["max_turns"] == 2
    records = [json.loads(line) for line in (out / "eval" / "step_000001.jsonl").read_text().splitlines()]
    assert len(records) == 2 and all(r["rewards"].keys() == {REWARD_TERM} for r in records)
    assert all(r["extracted"].startswith(("max_turns after 2 turns", "done")) for r in records)

    with (tmp_path / "guess_game.py").open("a") as module:
        module.write("# an edit: another environment\n")
    metrics = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", "--resume", str(out), "--steps", "2"]) == 2
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert "the task's data or environment changed since the run started" in line and "app_source_sha256" in line
    assert (out / "metrics.jsonl").read_text() == metrics and _servers_of(os.getpid()) == before


def test_a_server_that_exits_mid_run_stops_the_run_in_one_line_with_its_resume_command(tmp_path, monkeypatch, capsys):
    """The server process dies at its first episode step: the rollouts' failures are not scored as zeros for the
    rest of the run (which then ended 'done', exit 0): the run stops with one line naming the server's exit and
    how to resume, and no server is left."""
    (tmp_path / "dying_game.py").write_text(
        "import os\nfrom openenv_envs import GuessEnvironment\n\n\n"
        "class DyingEnvironment(GuessEnvironment):\n"
        "    def step(self, action, timeout_s=None, **kwargs):\n"
        "        os._exit(3)\n"
    )
    monkeypatch.syspath_prepend(tmp_path)
    out, before = tmp_path / "run", _servers_of(os.getpid())
    assert main(_train_args(chatml_model_dir(tmp_path), out, app="dying_game:DyingEnvironment")) == 2
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert "the OpenEnv server of dying_game:DyingEnvironment" in line and "exited with code 3 mid-run" in line
    assert f"grpolab train --resume {out}" in line
    assert _servers_of(os.getpid()) == before


def test_a_run_whose_server_fails_to_start_is_one_error_and_leaves_nothing(tmp_path, capsys):
    out, before = tmp_path / "run", _servers_of(os.getpid())
    code = main(_train_args(chatml_model_dir(tmp_path), out, app="openenv_envs:NotAnEnvironment"))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("error:")]
    assert code == 2 and not out.exists() and _servers_of(os.getpid()) == before
    assert "OpenEnv server openenv_envs:NotAnEnvironment exited with code 1 before it answered" in lines[0]
    assert any("neither an OpenEnv Environment class nor an ASGI app" in line for line in lines[1:])


def test_an_environment_without_concurrent_sessions_runs_one_episode_at_a_time():
    task = build_task({"name": "openenv", "app": "openenv_envs:SoloGuessEnvironment", "max_concurrency": 6})
    try:
        task.environment.start()
        assert task.environment.server.sessions == 1 and task.environment.max_concurrency == 1
    finally:
        task.environment.close()
    assert task.environment.server.process is None


def test_a_server_whose_parent_is_killed_exits_by_itself():
    """The run's process killed outright (no atexit, no close): its server sees its parent gone and exits, removing
    the temporary folder of its log."""
    script = (
        "from grpolab.tasks.openenv_process import ServerProcess\n"
        "s = ServerProcess('openenv_envs:GuessEnvironment', None, None, 1, 60)\n"
        "s.start()\nprint(s.pid, s.folder, flush=True)\nimport time; time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}  # grpolab and tests/
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
    )
    try:
        pid, folder = parent.stdout.readline().decode().split()
        server = int(pid)
        assert _alive(server)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 10
    while _alive(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(server) and not Path(folder).exists()
