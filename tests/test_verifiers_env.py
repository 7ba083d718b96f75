"""verifiers 0.4 environments as a task (``task.name = "verifiers"``, ``grpolab.tasks.verifiers_env``): environments
written in verifiers' own API (``vf_single``, ``vf_multi``, ``vf_tools`` in this folder), their rollouts run by
verifiers through grpolab's endpoint (``grpolab.rollout.environment``) over a tiny real model."""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from chat_envs import CHATML, chatml_model_dir, chatml_tokenizer
from conftest import run_config
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.rollout.base import Completion, SamplingParams
from grpolab.rollout.environment import EnvironmentEngine
from grpolab.rollout.hf.engine import HFEngine
from grpolab.tasks import build_task
from grpolab.tasks.verifiers_env import VerifiersError, VerifiersTaskConfig

pytest.importorskip("verifiers.v1")
PARAMS = SamplingParams(max_new_tokens=90, temperature=1.0, seed=5)
TURN = {"agent": {"sampling": {"max_tokens": 10}}}  # each model turn's cap (the seat's own sampling setting)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = chatml_model_dir(tmp_path_factory.mktemp("vf"))
    return path, AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def verifiers_task(tokenizer, **settings):
    task = VerifiersTaskConfig(**settings).build()
    task.bind_tokenizer(tokenizer)
    return task


def prompt_ids(task, tokenizer, examples):
    return [tokenizer(task.prompt(e), add_special_tokens=False)["input_ids"] for e in examples]


def environment_engine(engine, task, tokenizer, examples):
    """The run's environment engine for ``task`` (its examples found by their prompts' tokens), and a list that
    receives each call's trajectories as the endpoint recorded them."""
    ids = prompt_ids(task, tokenizer, examples)
    wrapped = EnvironmentEngine(engine, task.environment, tokenizer, {tuple(p): e for p, e in zip(ids, examples)})
    return wrapped, ids, recording(wrapped)


def recording(wrapped):
    """A list that receives the trajectories of each generation call of ``wrapped`` (an ``EnvironmentEngine``), as
    its endpoint recorded them (its own ``serving`` context, observed)."""
    recorded: list = []
    serving = wrapped.endpoint.serving

    @contextmanager
    def observed(*args, **kwargs):
        with serving(*args, **kwargs) as trajectories:
            recorded.append(trajectories)
            yield trajectories

    wrapped.endpoint.serving = observed
    return recorded


class ScriptedEngine:
    """An engine that writes a fixed reply to each prompt (``reply(prompt text) -> text``) then EOS, log-prob 0:
    the endpoint and verifiers run for real, only the sampler is scripted (a tool call a random model would
    never write)."""

    def __init__(self, tokenizer, reply):
        self.tokenizer, self.reply = tokenizer, reply
        self.eos_token_ids = [tokenizer.eos_token_id]

    def generate(self, prompts, n, params):
        out = []
        for prompt in prompts:
            text = self.reply(self.tokenizer.decode(prompt, skip_special_tokens=False))
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"][: params.max_new_tokens - 1]
            ids = ids + [self.tokenizer.eos_token_id]
            out.append([Completion(list(prompt), ids, [0.0] * len(ids), "stop", text) for _ in range(n)])
        return out

    def sync_weights(self, weights):
        pass

    def close(self):
        pass


# ---- settings, data, errors ---------------------------------------------------------------------------
def test_a_taskset_becomes_train_and_validation_examples_with_stable_ids_and_a_fingerprint():
    task = VerifiersTaskConfig(environment="vf_single", args={"size": 10}, validation_size=3).build()
    train, val = task.train_examples(), task.validation_examples()
    assert [e.id for e in train] == [f"sum-{i}" for i in range(7)] and [e.id for e in val] == [
        "sum-7",
        "sum-8",
        "sum-9",
    ]
    assert train[1].question == "7 + 4" and train[1].answer == "11" and train[1].fields["system_prompt"]
    again = VerifiersTaskConfig(environment="vf_single", args={"size": 10}, validation_size=3).build()
    assert again.data_fingerprint() == task.data_fingerprint()
    fingerprint = task.data_fingerprint()
    assert fingerprint["environment"]["name"] == "vf_single" and fingerprint["environment"]["version"] == "0.4.0"
    assert fingerprint["environment"]["settings"]["args"] == {"size": 10} and fingerprint["train_rows"] == 7
    (source,) = fingerprint["sources"]  # the environment's code, by file and SHA-256
    assert source["module"] == "vf_single" and source["file"].endswith("vf_single.py") and len(source["sha256"]) == 64
    other = VerifiersTaskConfig(environment="vf_single", args={"size": 10, "offset": 1}, validation_size=3).build()
    assert other.data_fingerprint()["train_sha256"] != fingerprint["train_sha256"]
    # the validation split as its own taskset: the taskset's arguments, updated
    split = VerifiersTaskConfig(environment="vf_single", args={"size": 6}, eval_args={"offset": 50, "size": 2}).build()
    assert len(split.train_examples()) == 6 and [e.id for e in split.validation_examples()] == ["sum-50", "sum-51"]
    # a [task] table names it
    built = build_task({"name": "verifiers", "environment": "vf_single"})
    assert built.name == "verifiers" and built.environment.name == "vf_single" and built.environment.timeout_s == 300.0


def test_a_resume_refuses_the_environment_once_its_code_changed(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from grpolab.config import ConfigError
    from grpolab.run.resume import check_data

    module = tmp_path / "vf_edited.py"  # an environment of the user's, edited between the start and the resume
    module.write_text((Path(__file__).parent / "vf_single.py").read_text())
    monkeypatch.syspath_prepend(str(tmp_path))
    started = VerifiersTaskConfig(environment="vf_edited").build().data_fingerprint()
    journal = SimpleNamespace(data={"data": json.loads(json.dumps(started))}, run_dir=tmp_path)
    check_data(journal, VerifiersTaskConfig(environment="vf_edited").build().data_fingerprint())  # the same: goes on
    module.write_text(module.read_text().replace("weight=0.25", "weight=0.5"))
    monkeypatch.delitem(sys.modules, "vf_edited")
    with pytest.raises(ConfigError, match="sources_sha256"):
        check_data(journal, VerifiersTaskConfig(environment="vf_edited").build().data_fingerprint())


def test_bad_environments_are_refused_with_what_to_do():
    with pytest.raises(ValueError, match="top-level module name"):
        VerifiersTaskConfig(environment="tests.vf_single")
    assert VerifiersTaskConfig(environment="someone/vf_single@0.1.2").environment == "someone/vf_single@0.1.2"
    with pytest.raises(VerifiersError, match="not found"):
        VerifiersTaskConfig(environment="no_such_env_module").build()
    with pytest.raises(VerifiersError, match="unique TaskData.id|validation_size 20"):
        VerifiersTaskConfig(environment="vf_single", validation_size=20).build()
    for harness in ("codex", "bash"):  # an agent program, a shell tool: not the chat loop grpolab runs
        with pytest.raises(VerifiersError, match=f"harness '{harness}'.*drop the seat's harness"):
            VerifiersTaskConfig(environment="vf_single", env_args={"agent": {"harness": {"id": harness}}}).build()
    VerifiersTaskConfig(environment="vf_single", env_args={"agent": {"harness": {"id": "null"}}}).build()
    with pytest.raises(VerifiersError, match=r"2 seats \(assistant, user\).*one trajectory per rollout"):
        VerifiersTaskConfig(environment="vf_single", env_args={"id": "user-sim"}).build()  # verifiers' modeled user
    with pytest.raises(
        VerifiersError, match=r"^verifiers environment 'vf_single': task.args.size: Input should be a valid"
    ):
        VerifiersTaskConfig(environment="vf_single", args={"size": "many"}).build()
    with pytest.raises(VerifiersError, match="task.env_args.agent.max_turns"):
        VerifiersTaskConfig(environment="vf_single", env_args={"agent": {"max_turns": "x"}}).build()


def test_without_verifiers_installed_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers.v1", None)  # as if the package were absent
    with pytest.raises(VerifiersError, match=r"pip install 'grpolab\[envs\]'"):
        VerifiersTaskConfig(environment="vf_single").build()


# ---- rollouts through the endpoint --------------------------------------------------------------------
def test_single_turn_rewards_are_terms_with_their_weights_and_a_raising_reward_fails_alone(chat_model):
    _, _, tokenizer = chat_model
    task = verifiers_task(
        tokenizer, environment="vf_single", args={"size": 10}, validation_size=2, format_term="formatted"
    )
    examples = task.train_examples()[:4]  # "0 + 1", "7 + 4" (its faulty reward raises), "4 + 7", "1 + 0"

    def reply(prompt):  # the right sum for the first two, a wrong one unformatted for the rest
        question = prompt.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
        a, b = int(question[0]), int(question[-1])
        return f"<answer>{a + b}</answer>" if question in ("0 + 1", "7 + 4") else "9"

    engine, ids, recorded = environment_engine(ScriptedEngine(tokenizer, reply), task, tokenizer, examples)
    try:
        groups = engine.generate(ids, 1, PARAMS)
    finally:
        engine.close()
    grades = [g[0].grade for g in groups]
    assert [dict(g.components) for g in grades] == [
        {"correct": 1.0, "formatted": 1.0, "faulty": 1.0},
        {"correct": 1.0, "formatted": 1.0, "faulty": 0.0},
        {"correct": 0.0, "formatted": 0.0, "faulty": 1.0},
        {"correct": 0.0, "formatted": 0.0, "faulty": 1.0},
    ]
    assert [g.total for g in grades] == [1.25, 1.25, 0.0, 0.0]  # correct x 1 + formatted x 0.25 + faulty x 0
    assert [g.failed for g in grades] == [(), ("faulty",), (), ()]
    assert [g.answer_reward for g in grades] == [1.0, 1.0, 0.0, 0.0]  # the heaviest reward is the correctness
    assert [g.format_reward for g in grades] == [1.0, 1.0, 0.0, 0.0]  # format_term's value
    for (completion,), prompt, trajectory in zip(groups, ids, recorded[0]):
        assert trajectory.turns[0].prompt_ids == prompt  # the task's prompt is the first call's
        assert completion.policy_mask == [1] * len(completion.completion_ids) and completion.turns == 1


def test_multi_turn_observations_are_masked_token_by_token(chat_model):
    _, model, tokenizer = chat_model
    from vf_multi import GuessEnv, _digit, feedback

    task = verifiers_task(tokenizer, environment="vf_multi", env_args=TURN, validation_size=2, max_concurrency=4)
    GuessEnv.peak = 0
    examples = task.train_examples()[:3]
    engine, ids, recorded = environment_engine(HFEngine(model, tokenizer), task, tokenizer, examples)
    try:
        groups = engine.generate(ids, 2, PARAMS)
    finally:
        engine.close()
    turn_end = "<|im_end|>"
    multi = 0
    for (example, group), trajectories in zip(zip(examples, groups), [recorded[0][i : i + 2] for i in (0, 2, 4)]):
        for completion, trajectory in zip(group, trajectories):
            turns = list(trajectory.turns)
            while turns and not turns[-1].completion_ids:  # a last call refused for want of budget trains nothing
                turns.pop()
            assert trajectory.restarts == 0 and completion.turns == len(turns) >= 1
            ids_, mask = [], []
            for k, turn in enumerate(turns):
                ids_ += turn.observation_ids + turn.completion_ids
                mask += [0] * len(turn.observation_ids) + [1] * len(turn.completion_ids)
                if k:  # the environment's message: the feedback on the previous guess, as the template renders it
                    sampled = tokenizer.decode(turns[k - 1].completion_ids, skip_special_tokens=False)
                    guess = _digit(tokenizer.decode(turns[k - 1].completion_ids, skip_special_tokens=True))
                    tail = f"\n<|im_start|>user\n{feedback(guess, example.answer)}{turn_end}\n<|im_start|>assistant\n"
                    observed = tokenizer.decode(turn.observation_ids, skip_special_tokens=False)
                    # before it, what the sample left unwritten of its turn's end (nothing after an EOS)
                    assert observed.endswith(tail) and (sampled + observed[: -len(tail)]).endswith(turn_end)
            assert completion.completion_ids == ids_ and completion.policy_mask == mask
            assert completion.logprobs == [lp for t in turns for lp in [0.0] * len(t.observation_ids) + t.logprobs]
            multi += len(turns) > 1
            terms = dict(completion.grade.components)
            assert terms.keys() == {"solved", "quick", "guessed"} and terms["quick"] == 1 / len(trajectory.turns)
            assert completion.grade.total == pytest.approx(
                terms["solved"] + 0.5 * terms["quick"] + 0.1 * terms["guessed"]
            )
    assert multi >= 3  # most games went on past the first guess
    assert GuessEnv.peak == 4  # the six games ran four at a time (max_concurrency)


@pytest.fixture
def tool_servers(monkeypatch):
    """verifiers serves a toolset as ``python -m MODULE`` (this folder on its path) and leaves the port file its
    server wrote in /tmp: the ones this test made are removed."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    before = set(Path("/tmp").glob("vf-port-*"))
    yield
    for leftover in set(Path("/tmp").glob("vf-port-*")) - before:
        leftover.unlink(missing_ok=True)


def test_a_tool_environment_offers_its_tool_and_its_results_and_turns_are_masked(tool_servers):
    tokenizer = chatml_tokenizer()
    tokenizer.chat_template = (
        "{%- if tools %}{{- '<|im_start|>tools\\n' + (tools | tojson) + '<|im_end|>\\n' }}{%- endif %}" + CHATML
    )
    task = verifiers_task(tokenizer, environment="vf_tools", env_args={"followups": 1}, validation_size=2)
    (example,) = task.train_examples()[:1]  # "What is 10 + 20?"
    assert [t["function"]["name"] for t in task.tools(example)] == ["calc_add"]
    assert task.tools(example)[0]["function"]["parameters"]["required"] == ["a", "b"]

    def reply(prompt):  # a tool call, then the tool's result as the answer; again when asked again
        last = prompt.split("<|im_start|>")[-2]
        if last.startswith("tool\n"):
            return "It is " + last[len("tool\n") :].split("<|im_end|>")[0]
        return '<tool_call>{"name": "calc_add", "arguments": {"a": 10, "b": 20}}</tool_call>'

    engine, ids, recorded = environment_engine(ScriptedEngine(tokenizer, reply), task, tokenizer, [example])
    try:
        ((completion,),) = engine.generate(ids, 1, replace(PARAMS, max_new_tokens=400))
    finally:
        engine.close()
    (trajectory,) = recorded[0]
    assert completion.grade.components == (("correct", 1.0),) and completion.grade.failed == ()
    # call, answer, call, answer: one trajectory (the env's replayed conversation extends it exactly)
    assert trajectory.restarts == 0 and completion.turns == len(trajectory.turns) == 4
    said = [tokenizer.decode(t.observation_ids, skip_special_tokens=False) for t in trajectory.turns]
    tool, user = "\n<|im_start|>tool\n30<|im_end|>\n<|im_start|>assistant\n", "\n<|im_start|>user\nagain, please"
    assert said == ["", tool, user + "<|im_end|>\n<|im_start|>assistant\n", tool]  # the tool's result, the env's turn
    assert completion.policy_mask == [
        m for t in trajectory.turns for m in [0] * len(t.observation_ids) + [1] * len(t.completion_ids)
    ]
    assert tokenizer.decode(trajectory.turns[-1].completion_ids, skip_special_tokens=True) == "It is 30"
    assert trajectory.turns[0].prompt_ids == ids[0]  # the prompt, tool schema included, is the first call's
    assert '"name": "calc_add"' in task.prompt(example)


def test_a_hanging_or_failing_environment_fails_its_rollout_and_the_others_go_on(chat_model):
    _, model, tokenizer = chat_model
    hung = verifiers_task(tokenizer, environment="vf_multi", env_args={**TURN, "hang_s": 30}, timeout_s=1.0)
    broken = verifiers_task(tokenizer, environment="vf_multi", env_args={**TURN, "broken": True})
    fine = verifiers_task(tokenizer, environment="vf_multi", env_args=TURN)
    out = []
    for task in (hung, broken, fine):
        engine, ids, _ = environment_engine(HFEngine(model, tokenizer), task, tokenizer, task.train_examples()[:1])
        try:
            ((completion,),) = engine.generate(ids, 1, PARAMS)
        finally:
            engine.close()
        out.append(completion)
    timed_out, failed, ok = out
    for completion in (timed_out, failed):  # past timeout_s, or the env's run raised: 0, and nothing trained
        assert completion.grade.failed == ("environment",) and completion.grade.reward == 0
        assert completion.policy_mask == [0]
    assert ok.grade.failed == () and ok.num_policy_tokens > 0


# ---- a training step ------------------------------------------------------------------------------------
def test_a_multi_turn_environment_trains_a_step_on_its_sampled_tokens_only(chat_model, tmp_path):
    from grpolab.learning.batching import collate
    from grpolab.run.step import rl_step
    from grpolab.run.trainer import Trainer

    path, _, tokenizer = chat_model
    cfg = run_config(
        path,
        tmp_path / "run",
        {
            "steps": 1,
            "task.name": "verifiers",
            "task.environment": "vf_multi",
            "task.env_args": TURN,
            "task.validation_size": 2,
            "rollout.prompts_per_step": 2,
            "rollout.group_size": 4,
            "rollout.max_new_tokens": 60,
            "optim.lr": 1e-2,
        },
    )
    trainer = Trainer(cfg)
    try:
        recorded = recording(trainer.parts.collector.engine)  # the run's own environment engine
        before = [p.detach().clone() for p in trainer.parts.policy.model.parameters()]
        seen = []
        record = rl_step(trainer.parts, 1, on_rollout=seen.append)
        after = list(trainer.parts.policy.model.parameters())
    finally:
        trainer.close()
    completions = seen[0].flat()
    (trajectories,) = recorded  # the step's one generation call
    assert len(trajectories) == len(completions) == 8
    batch = collate(completions, tokenizer.pad_token_id)
    for row, (completion, trajectory) in enumerate(zip(completions, trajectories)):
        turns = [t for t in trajectory.turns if t.completion_ids]  # a call refused for want of budget adds nothing
        assert trajectory.restarts == 0 and completion.prompt_ids == turns[0].prompt_ids
        start, ids = len(completion.prompt_ids), [i for t in turns for i in t.observation_ids + t.completion_ids]
        assert batch.input_ids[row, start : start + len(ids)].tolist() == ids  # the trained tokens: the endpoint's
        # token by token: 1 exactly on what the engine sampled, 0 exactly on the environment's messages
        sampled = [m for t in turns for m in [0.0] * len(t.observation_ids) + [1.0] * len(t.completion_ids)]
        assert batch.response_mask[row, start : start + len(ids)].tolist() == sampled
        assert batch.response_mask[row, :start].sum() == 0 and batch.response_mask[row, start + len(ids) :].sum() == 0
    observed = sum(len(c.policy_mask) - sum(c.policy_mask) for c in completions)
    assert observed > 0 and record["tokens/masked_observation"] == observed
    assert record["tokens/policy"] == sum(sum(c.policy_mask) for c in completions)
    assert {"reward/solved", "reward/quick", "reward/guessed"} <= record.keys() and record["actual_updates"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, after))  # the step updated the policy


def test_the_reward_terms_and_weights_are_the_environments_and_named_terms_must_exist():
    task = VerifiersTaskConfig(environment="vf_single", answer_term="formatted").build()
    assert task.reward_weights() == {"correct": 1.0, "faulty": 0.0, "formatted": 0.25}
    with pytest.raises(VerifiersError, match="task.format_term 'shape' is not a reward.*correct, faulty, formatted"):
        VerifiersTaskConfig(environment="vf_single", format_term="shape").build()
