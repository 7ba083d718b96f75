"""The OpenAI-compatible endpoint over the rollout engine, and environment-driven rollouts
(``grpolab.rollout.endpoint``, ``grpolab.rollout.environment``), called with the real ``openai`` client (the
``[envs]`` extra's: without it those tests skip)."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import random
from dataclasses import replace

import pytest
import torch
from chat_envs import EchoGame, chatml_model_dir
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpolab.learning.batching import collate
from grpolab.models.logprobs import token_logprobs
from grpolab.rollout.base import SamplingParams
from grpolab.rollout.endpoint import TURN_STRIDE, PolicyEndpoint, RequestError, _Request, tool_calls
from grpolab.rollout.environment import EnvironmentEngine
from grpolab.rollout.hf.engine import HFEngine
from grpolab.rollout.sync_check import verify_weight_sync
from grpolab.tasks.base import Example

try:
    import openai
except ImportError:  # an optional package (the [envs] and [test] extras)
    openai = None

PARAMS = SamplingParams(max_new_tokens=24, temperature=1.0, seed=11)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    path = chatml_model_dir(tmp_path_factory.mktemp("endpoint"))
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def needs_openai() -> None:
    """Skip a test calling the endpoint (directly or through an environment) when the openai client is absent."""
    if openai is None:
        pytest.skip("needs openai, the client an environment calls the endpoint with: pip install 'grpolab[envs]'")


@pytest.fixture
def endpoint(chat_model):
    needs_openai()
    model, tokenizer = chat_model
    served = PolicyEndpoint(HFEngine(model, tokenizer), tokenizer)
    yield served
    served.close()


def ask(endpoint, key, messages, api_key=None, model="policy", **extra):
    api_key = endpoint.api_key if api_key is None else api_key
    client = openai.OpenAI(base_url=endpoint.base_url(key), api_key=api_key, max_retries=0, timeout=20)
    return client.chat.completions.create(model=model, messages=messages, **extra)


def post(endpoint, path, body=None, headers=None, raw=None):
    """A raw HTTP request (what an openai client would never send): its status and its JSON reply."""
    conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=20)
    try:
        data = raw if raw is not None else json.dumps(body).encode()
        sent = {"Authorization": f"Bearer {endpoint.api_key}", "Content-Type": "application/json"}
        sent.update(headers or {})
        conn.putrequest("POST", path)
        for name, value in sent.items():
            conn.putheader(name, value)
        if "Content-Length" not in sent:
            conn.putheader("Content-Length", str(len(data)))
        conn.endheaders(data if "Content-Length" not in sent else None)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()


def test_a_first_call_samples_the_chat_templates_prompt_as_the_engine_would(endpoint, chat_model):
    model, tokenizer = chat_model
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "say a"}]
    with endpoint.serving(PARAMS, 2, 24) as trajectories:
        reply = ask(endpoint, 1, messages, logprobs=True)
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    extra = reply.model_extra
    assert extra["prompt_token_ids"] == list(prompt)
    turn = trajectories[1].turns[0]
    assert turn.prompt_ids == list(prompt) and reply.choices[0].token_ids == turn.completion_ids
    assert reply.choices[0].message.content == tokenizer.decode(turn.completion_ids, skip_special_tokens=True)
    assert [t.logprob for t in reply.choices[0].logprobs.content] == turn.logprobs
    # the engine called directly, with the row the endpoint seeds trajectory 1's first turn with
    direct = HFEngine(model, tokenizer).generate([list(prompt)], 1, replace(PARAMS, rows=(1 * TURN_STRIDE,)))[0][0]
    assert direct.completion_ids == turn.completion_ids and direct.logprobs == turn.logprobs
    assert not trajectories[0].turns


def test_a_later_turn_continues_the_sampled_tokens_and_masks_only_the_environments(endpoint, chat_model):
    _, tokenizer = chat_model
    first = [{"role": "user", "content": "say b"}]
    with endpoint.serving(PARAMS, 1, 200) as (trajectory,):
        reply = ask(endpoint, 0, first)
        history = first + [{"role": "assistant", "content": reply.choices[0].message.content}]
        ask(endpoint, 0, history + [{"role": "user", "content": "again"}])
    one, two = trajectory.turns
    assert two.prompt_ids[: len(one.prompt_ids) + len(one.completion_ids)] == one.prompt_ids + one.completion_ids
    assert two.prompt_ids[len(one.prompt_ids) + len(one.completion_ids) :] == two.observation_ids
    # the environment's tokens: the rest of the assistant turn's end, then its message and the generation prompt
    observed = tokenizer.decode(two.observation_ids, skip_special_tokens=False)
    ended = one.completion_ids[-1] == tokenizer.eos_token_id
    assert observed == ("" if ended else "<|im_end|>") + "\n<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    completion = trajectory.completion(tokenizer)
    expected_ids = one.completion_ids + two.observation_ids + two.completion_ids
    assert completion.prompt_ids == one.prompt_ids and completion.completion_ids == expected_ids
    # token by token: 1 exactly on what the engine sampled, 0 (log-prob 0) exactly on the environment's tokens
    assert completion.policy_mask == [1] * len(one.completion_ids) + [0] * len(two.observation_ids) + [1] * len(
        two.completion_ids
    )
    assert completion.logprobs == one.logprobs + [0.0] * len(two.observation_ids) + two.logprobs
    assert completion.turns == 2


def test_samples_do_not_depend_on_the_batch_they_were_generated_in(endpoint):
    messages = [[{"role": "user", "content": f"say {c}"}] for c in "abcd"]
    with endpoint.serving(PARAMS, 4, 24):
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda k: ask(endpoint, k, messages[k]).choices[0].token_ids, range(4)))
    with endpoint.serving(PARAMS, 4, 24):
        alone = [ask(endpoint, k, messages[k]).choices[0].token_ids for k in (3, 1, 0, 2)]
    assert together == [alone[2], alone[1], alone[3], alone[0]]


def test_a_rewritten_history_restarts_the_trajectory(endpoint):
    with endpoint.serving(PARAMS, 1, 200) as (trajectory,):
        ask(endpoint, 0, [{"role": "user", "content": "say c"}])
        ask(endpoint, 0, [{"role": "user", "content": "something else"}])
    assert trajectory.restarts == 1 and len(trajectory.turns) == 1


def test_the_budget_spans_the_whole_trajectory(endpoint):
    with endpoint.serving(PARAMS, 1, 30) as (trajectory,):
        first = ask(endpoint, 0, [{"role": "user", "content": "a"}], max_tokens=50)
        assert len(first.choices[0].token_ids) <= 30
        history = [{"role": "user", "content": "a"}, {"role": "assistant", "content": first.choices[0].message.content}]
        second = ask(endpoint, 0, history + [{"role": "user", "content": "a much longer observation than the budget"}])
    assert second.choices[0].finish_reason == "length" and second.choices[0].token_ids == []
    completion = trajectory.completion(endpoint.tokenizer)
    assert completion.truncated and completion.turns == 1  # the refused turn added nothing to train


def test_bad_requests_get_one_clear_error(endpoint):
    with endpoint.serving(PARAMS, 1, 30):
        with pytest.raises(openai.NotFoundError, match="no open trajectory 5"):
            ask(endpoint, 5, [{"role": "user", "content": "a"}])
        with pytest.raises(openai.BadRequestError, match="messages must be"):
            ask(endpoint, 0, [])
    with pytest.raises(openai.NotFoundError, match="no open trajectory 0"):
        ask(endpoint, 0, [{"role": "user", "content": "a"}])


SAY = [{"role": "user", "content": "say a"}]
GOOD = {"model": "policy", "messages": SAY, "max_tokens": 8}
BAD = [  # (a request's body or raw bytes, extra headers; the status it gets)
    ({**GOOD, "max_tokens": -5}, {}, 400),
    ({**GOOD, "max_tokens": 0}, {}, 400),
    ({**GOOD, "max_completion_tokens": 2.5}, {}, 400),
    ({**GOOD, "stop": [""]}, {}, 400),
    ({**GOOD, "stop": ""}, {}, 400),
    ({**GOOD, "stop": [3]}, {}, 400),
    ({**GOOD, "n": 2}, {}, 400),
    ({**GOOD, "stream": True}, {}, 400),
    ({**GOOD, "messages": [{"role": "user", "content": {"x": 1}}]}, {}, 400),
    ({**GOOD, "messages": "say a"}, {}, 400),
    ({**GOOD, "tools": "calc"}, {}, 400),
    ({**GOOD, "model": "gpt-9"}, {}, 404),
    ({k: v for k, v in GOOD.items() if k != "model"}, {}, 400),
    ([GOOD], {}, 400),
    (b"{not json", {}, 400),
    (b"\xff\xfe", {}, 400),
    (b"[" * 100_000, {}, 400),
    (b"", {"Content-Length": "99999999999"}, 413),
    (b"", {"Content-Length": "-1"}, 400),
    (GOOD, {"Authorization": "Bearer wrong"}, 401),
    (GOOD, {"Authorization": ""}, 401),
]


def _bad(endpoint, k, body, headers):
    raw = body if isinstance(body, bytes) else None
    return post(endpoint, f"/t/{k}/v1/chat/completions", body, headers, raw)


def test_each_bad_request_gets_its_status_and_the_endpoint_still_answers_as_before(endpoint):
    with endpoint.serving(PARAMS, 1, 30):
        before = ask(endpoint, 0, SAY, max_tokens=8).choices[0].token_ids
    with endpoint.serving(PARAMS, 2, 30) as trajectories:
        for body, headers, status in BAD:
            got, reply = _bad(endpoint, 0, body, headers)
            assert (got, body, headers) == (status, body, headers) and reply["error"]["message"]
        assert _bad(endpoint, 7, GOOD, {})[0] == 404  # no such trajectory
        assert post(endpoint, "/t/0/v1/completions", GOOD)[0] == 404  # no such route
        assert not trajectories[0].turns and not trajectories[0].restarts  # a refused request changes nothing
        after = ask(endpoint, 0, SAY, max_tokens=8).choices[0].token_ids
    assert after == before and after


def test_a_wrong_or_missing_key_gets_401_and_nothing_is_generated(endpoint):
    calls = []
    generate = endpoint.engine.generate
    endpoint.engine.generate = lambda *a: calls.append(a) or generate(*a)
    with endpoint.serving(PARAMS, 1, 30) as (trajectory,):
        with pytest.raises(openai.AuthenticationError):
            ask(endpoint, 0, SAY, api_key="grpolab")
        assert _bad(endpoint, 0, GOOD, {"Authorization": f"Basic {endpoint.api_key}"})[0] == 401
        conn = http.client.HTTPConnection("127.0.0.1", endpoint.port, timeout=20)
        conn.request("GET", "/t/0/v1/models")  # no key: the model list is refused too
        assert conn.getresponse().status == 401
        conn.close()
        assert not calls and not trajectory.turns
        ask(endpoint, 0, SAY, max_tokens=4)
    assert len(calls) == 1 and len(trajectory.turns) == 1
    assert (
        len(endpoint.api_key) >= 32 and PolicyEndpoint(endpoint.engine, endpoint.tokenizer).api_key != endpoint.api_key
    )


def test_the_batcher_survives_a_call_it_cannot_sample(endpoint):
    """Past the checks (a request made inside): the call fails alone and the batcher goes on."""
    with endpoint.serving(PARAMS, 1, 30):
        before = ask(endpoint, 0, SAY, max_tokens=8).choices[0].token_ids
    with endpoint.serving(PARAMS, 1, 30):
        broken = _Request([1, 2, 3], -5, ("",), 0)
        endpoint.requests.put(broken)
        with pytest.raises(RequestError, match="max_new_tokens"):
            broken.done.result(timeout=20)
        assert ask(endpoint, 0, SAY, max_tokens=8).choices[0].token_ids == before


def test_many_concurrent_good_and_bad_requests_each_get_their_own_answer(endpoint):
    """Good calls on their own trajectories among bad calls on any, from many threads: every good one samples what
    it samples alone, every bad one gets its status."""
    count = 25
    messages = [[{"role": "user", "content": f"say {k}"}] for k in range(count)]
    with endpoint.serving(PARAMS, count, 30):
        alone = [ask(endpoint, k, messages[k], max_tokens=6).choices[0].token_ids for k in range(count)]
    jobs = [("good", k) for k in range(count)] + [("bad", i % len(BAD)) for i in range(7 * count)]
    random.Random(0).shuffle(jobs)

    def run(job):
        kind, i = job
        if kind == "good":
            return ask(endpoint, i, messages[i], max_tokens=6).choices[0].token_ids
        body, headers, _ = BAD[i]
        return _bad(endpoint, i % count, body, headers)[0]

    with endpoint.serving(PARAMS, count, 30):
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            got = list(pool.map(run, jobs))
    for (kind, i), answer in zip(jobs, got):
        assert answer == (alone[i] if kind == "good" else BAD[i][2])


def test_tool_calls_in_the_text_become_chat_completion_tool_calls():
    text = 'let me see <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> <tool_call>nope</tool_call>'
    content, calls = tool_calls(text, 3, 1)
    assert content == "let me see  <tool_call>nope</tool_call>"
    assert calls == [{"id": "call_3_1_0", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]
    assert tool_calls("plain", 0, 0) == ("plain", [])


def _engine(chat_model, game):
    needs_openai()
    model, tokenizer = chat_model
    examples = [Example(id=f"e{i}", question=f"say {c}", answer=c) for i, c in enumerate("abcdef")]
    prompts = {
        e.id: tokenizer.apply_chat_template(
            [{"role": "user", "content": e.question}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for e in examples
    }
    engine = EnvironmentEngine(HFEngine(model, tokenizer), game, tokenizer, {tuple(prompts[e.id]): e for e in examples})
    return engine, [list(prompts[e.id]) for e in examples]


def test_environment_rollouts_are_graded_by_the_environment_and_run_concurrently(chat_model):
    game = EchoGame(delay_s=0.2)
    game.max_concurrency = 3
    engine, prompts = _engine(chat_model, game)
    try:
        groups = engine.generate(prompts[:3], 2, replace(PARAMS, max_new_tokens=80))
    finally:
        engine.close()
    assert game.started == 1 and game.closed == 1 and game.peak == 3
    for group in groups:
        for completion in group:
            assert completion.turns == 2 and dict(completion.grade.components).keys() == {"hit", "size"}
            assert 0 in completion.policy_mask and completion.policy_mask[0] == 1
    # the same call again samples the same trajectories: seeded by trajectory and turn, not by arrival
    engine2, _ = _engine(chat_model, EchoGame())
    try:
        again = engine2.generate(prompts[:3], 2, replace(PARAMS, max_new_tokens=80))
    finally:
        engine2.close()
    assert [[c.completion_ids for c in g] for g in again] == [[c.completion_ids for c in g] for g in groups]


class RefusedGame(EchoGame):
    """Asks the endpoint for -5 tokens: the call is refused (400), and the rollout raises the client's error."""

    async def rollout(self, example, endpoint):
        async with endpoint.client() as client:
            messages = [{"role": "user", "content": example.question}]
            await client.chat.completions.create(model=endpoint.model, messages=messages, max_tokens=-5)


def test_a_failing_hanging_or_refused_rollout_is_a_failed_sample_of_its_kind_and_trains_nothing(chat_model):
    game = EchoGame(fail_on="say b", timeout_s=5.0)
    engine, prompts = _engine(chat_model, game)
    hung = EchoGame(delay_s=30, timeout_s=0.5)
    engine_hung, _ = _engine(chat_model, hung)
    engine_refused, _ = _engine(chat_model, RefusedGame())
    try:
        failed, ok = engine.generate(prompts[1:3], 1, replace(PARAMS, max_new_tokens=60))
        (timed_out,) = engine_hung.generate(prompts[:1], 1, PARAMS)
        (refused,) = engine_refused.generate(prompts[:1], 1, PARAMS)
    finally:
        engine.close()
        engine_hung.close()
        engine_refused.close()
    for (completion,), kind in ((failed, "environment"), (timed_out, "timeout"), (refused, "endpoint")):
        assert completion.grade.failure == kind and not completion.grade.ok
        assert completion.grade.failed == ("environment",)
        assert completion.policy_mask == [0] and completion.num_policy_tokens == 0
    assert failed[0].grade.error == "environment echo-game: RuntimeError('the environment broke')"
    assert timed_out[0].grade.error == "environment echo-game: timed out after 0.5 s"
    assert refused[0].grade.error.startswith(
        "environment echo-game: the endpoint answered a call with RequestError: max_tokens must be"
    )
    assert ok[0].grade.ok and ok[0].grade.failed == () and ok[0].turns == 2


def test_prompts_of_no_example_are_generated_by_the_wrapped_engine(chat_model):
    engine, _ = _engine(chat_model, EchoGame())
    try:
        (out,) = engine.generate([[5, 6, 7]], 1, PARAMS)
    finally:
        engine.close()
    assert out[0].grade is None and out[0].turns == 1


class Broken:
    """An engine whose generation fails (a died engine process), to see that the failure ends the call."""

    eos_token_ids = [0]

    def generate(self, prompts, n, params):
        raise RuntimeError("the engine died")

    def close(self):
        pass


def test_an_engine_failure_fails_the_run_not_just_the_rollouts(chat_model):
    needs_openai()  # the rollouts start (and call the endpoint) before the engine's failure ends them
    _, tokenizer = chat_model
    engine = EnvironmentEngine(Broken(), EchoGame(), tokenizer, {(1, 2, 3): Example(id="x", question="q", answer="a")})
    try:
        with pytest.raises(RuntimeError, match="the engine died"):
            engine.generate([[1, 2, 3]], 2, PARAMS)
    finally:
        engine.close()


def _trainer_agrees(chat_dir, groups):
    """The trainer's log-probs of every trajectory's sampled tokens equal the engine's (the sync check's test),
    and the masked tokens are exactly the environment's."""
    completions = [c for group in groups for c in group]
    batch = collate(completions, AutoTokenizer.from_pretrained(chat_dir).pad_token_id)
    observed = sum(len(c.completion_ids) - c.num_policy_tokens for c in completions)
    assert batch.token_counts()["tokens/masked_observation"] == observed > 0
    model = AutoModelForCausalLM.from_pretrained(chat_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        trainer = token_logprobs(model, batch.input_ids, batch.attention_mask).logprobs
    check = verify_weight_sync(
        batch.engine_logprobs, trainer, batch.response_mask, max_abs_diff=1e-3, mean_abs_diff=1e-4
    )
    assert check.num_tokens == batch.num_response_tokens


def _rollouts(engine, tokenizer):
    needs_openai()
    examples = [Example(id=f"e{i}", question=f"say {c}", answer=c) for i, c in enumerate("abc")]
    prompts = [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": e.question}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for e in examples
    ]
    wrapped = EnvironmentEngine(engine, EchoGame(), tokenizer, {tuple(p): e for p, e in zip(prompts, examples)})
    try:
        return wrapped.generate(prompts, 2, replace(PARAMS, max_new_tokens=60))
    finally:
        wrapped.close()


def test_the_trainer_reproduces_the_engines_logprobs_of_environment_trajectories(tmp_path):
    chat_dir = chatml_model_dir(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    model = AutoModelForCausalLM.from_pretrained(chat_dir, dtype=torch.float32)
    _trainer_agrees(chat_dir, _rollouts(HFEngine(model, tokenizer), tokenizer))


@pytest.mark.slow  # ~30 s (a vLLM engine); default tier: the same check over the hf engine (the endpoint serves any
# engine) and test_rollout_vllm.py's vLLM log-probs
def test_the_trainer_reproduces_vllms_logprobs_of_environment_trajectories(tmp_path):
    pytest.importorskip("vllm")
    from grpolab.rollout.vllm.engine import VLLMEngine

    chat_dir = chatml_model_dir(tmp_path, vllm=True)
    tokenizer = AutoTokenizer.from_pretrained(chat_dir)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    engine = VLLMEngine(chat_dir, tokenizer, dtype="float32", seed=0, max_model_len=256, enforce_eager=True)
    _trainer_agrees(chat_dir, _rollouts(engine, tokenizer))


def test_a_turn_cut_at_its_own_max_tokens_does_not_truncate_the_trajectory(endpoint):
    with endpoint.serving(PARAMS, 1, 100) as (trajectory,):
        reply = ask(endpoint, 0, [{"role": "user", "content": "a"}], max_tokens=3)
    assert len(reply.choices[0].token_ids) <= 3
    assert not trajectory.completion(endpoint.tokenizer).truncated


def test_a_sample_ending_in_the_turn_ends_first_character_still_gets_the_whole_end_token(chat_model):
    """Only the turn end's own token counts as written: a sample ending in a literal "<" does not."""
    from grpolab.rollout.endpoint import ChatTemplate

    _, tokenizer = chat_model
    template = ChatTemplate(tokenizer)
    new = [{"role": "user", "content": "x"}]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    literal = tokenizer("<", add_special_tokens=False)["input_ids"]
    after_eos = template.after_assistant(new, None, [5, eos])
    after_literal = template.after_assistant(new, None, [5, *literal])
    assert after_literal == [eos] + after_eos
    assert (
        tokenizer.decode(after_eos, skip_special_tokens=False)
        == "\n<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_ranks_share_samples_what_one_process_samples_for_those_prompts(chat_model):
    """Data parallel: a rank's call (its prompts, ``prompt_offset`` its first one's index) samples the trajectories
    one process calling with every prompt samples for them."""
    engine, prompts = _engine(chat_model, EchoGame())
    try:
        params = replace(PARAMS, max_new_tokens=40)
        whole = engine.generate(prompts[:3], 2, params)
        share = engine.generate(prompts[1:3], 2, replace(params, prompt_offset=1))
    finally:
        engine.close()
    ids = lambda groups: [[c.completion_ids for c in group] for group in groups]  # noqa: E731
    assert ids(share) == ids(whole[1:]) and ids(whole[:1]) != ids(whole[1:2])


def test_a_missing_environment_package_is_one_line_naming_the_extra():
    from grpolab.tasks.environment import import_extra, installed_version

    with pytest.raises(ValueError, match=r"^task.name 'openenv' needs no-such-dist: pip install 'grpolab\[envs\]'$"):
        installed_version("no-such-dist", "openenv")
    with pytest.raises(ValueError, match=r"^task.name 'x' needs no_such_module \(.*\): pip install 'grpolab\[envs\]'$"):
        import_extra("no_such_module", "x")
    if openai is None:  # the extra's real package, absent: the same one line
        with pytest.raises(ValueError, match=r"^task.name 'x' needs openai: pip install 'grpolab\[envs\]'$"):
            installed_version("openai", "x")
    else:
        assert installed_version("openai", "x").startswith("2.")
