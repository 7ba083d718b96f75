"""An OpenAI-compatible chat-completions endpoint over a rollout engine, on the loopback address.

Environments (verifiers, OpenEnv, agent harnesses) generate by calling a chat-completions client. During an
environment's rollouts grpolab serves the policy that way: ``POST /t/<trajectory>/v1/chat/completions`` (and
``GET /t/<trajectory>/v1/models``), one URL prefix per trajectory, so that every call on it is a turn of that
trajectory.

Token in, token out. The first call's prompt is the tokenizer's chat template over the request's messages
(``tools`` passed to the template); each later call of the trajectory must extend the previous call's
messages with the assistant's reply and then new messages (the environment's observations, tool results):
its prompt is then the previous prompt's tokens, the tokens the engine sampled, the end of the assistant
turn as the template writes it, and the new messages as the template renders them after an assistant turn.
Nothing sampled is ever re-tokenised, so the trajectory trains on exactly the engine's tokens; the tokens in
between are the environment's (``Turn.observation_ids``), masked out of the loss. A call that does not extend
the previous one (the environment rewrote its history) starts the trajectory anew: its earlier turns are
dropped from training (``Trajectory.restarts`` counts them).

Sampling is the run's (``SamplingParams`` of the ``serving`` block): temperature, top-p, top-k and seed; a
request's own sampling arguments are ignored except ``max_tokens`` / ``max_completion_tokens`` and ``stop``.
A trajectory's turns and the messages between them share one token budget, ``max_new_tokens``. Every request
is seeded by its trajectory's global index and its turn (``SamplingParams.rows``): what it samples does not
depend on which other requests shared its batch, or on when they arrived.

Every request must carry the endpoint's key (``api_key``: random, one per endpoint, never logged) as
``Authorization: Bearer KEY`` and name the endpoint's model; it is checked whole before anything is generated.
Errors are OpenAI-style JSON (``{"error": {"message", "type", "code"}}``): 401 without the right key, 413 for a
body over ``max_body_bytes`` (from its ``Content-Length``, before reading it), 404 for an unknown route,
trajectory or model, 400 for anything else the request gets wrong (its reason as the message), 500 when the
engine fails. A refused request changes nothing of its trajectory.

Requests arriving together are generated in one engine call (the batcher waits ``linger_s`` after the last
arrival); a failure inside a batch fails the calls it concerns, never the batcher. Replies carry the
completion's token ids (``choices[0].token_ids``, the prompt's as ``prompt_token_ids``, as vLLM's server does)
and, when asked, per-token log-probs.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from hmac import compare_digest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from grpolab.models.prompt_tokens import tokenize_prompts
from grpolab.rollout.base import Completion, RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)
TURN_STRIDE = 4096  # a request's seeding row: its trajectory's global index * TURN_STRIDE + its turn
_SENTINEL = "\u2063grpolab\u2063"  # an assistant content no template alters, to find where the content ends
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
MAX_BODY_BYTES = 32 << 20  # a request body's largest size (checked from its Content-Length)
MAX_STOPS = 16  # stop strings one request may add


class EndpointStopped(RuntimeError):
    """The endpoint no longer serves (``PolicyEndpoint.check_alive``)."""


class RequestError(ValueError):
    """A request the endpoint refuses: its HTTP status (400 unless said), the message as the error."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.kind, self.code = status, kind, code

    def payload(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": self.kind, "param": None, "code": self.code}}


def _positive_int(body: dict[str, Any], name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"{name} must be an integer >= 1, got {json.dumps(value)[:64]}")
    return value


def check_request(body: Any, model_name: str) -> tuple[list[dict[str, Any]], list | None, int | None, tuple[str, ...]]:
    """A chat-completions body checked whole (RequestError: why not): its messages, tools, max tokens and stop
    strings."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError("model must be a non-empty string")
    if model != model_name:
        raise RequestError(
            f"the model {model[:64]!r} does not exist: this endpoint serves {model_name!r}", 404, code="model_not_found"
        )
    if body.get("stream"):
        raise RequestError("streaming is not served: call without stream")
    if body.get("n") not in (None, 1):
        raise RequestError("n must be 1 (one trajectory per URL)")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise RequestError("messages must be a non-empty list of message objects")
    for i, message in enumerate(messages):
        if not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}].role must be a string")
        if not isinstance(message.get("content"), (str, list, type(None))):
            raise RequestError(f"messages[{i}].content must be a string, a list of parts or null")
    tools = body.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError("tools must be a list of tool objects")
    if not isinstance(body.get("logprobs", False), (bool, type(None))):
        raise RequestError("logprobs must be a boolean")
    asked = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > MAX_STOPS or not all(isinstance(s, str) and s for s in stop):
        raise RequestError(f"stop must be a non-empty string or a list of at most {MAX_STOPS} non-empty strings")
    return messages, tools, asked, tuple(stop)


@dataclass
class Turn:
    """One call of a trajectory: its prompt (the tokens before this turn's sample), what was sampled.

    observation_ids: the tokens between the previous turn's sample and this one's (the environment's
        messages); empty on a trajectory's first turn.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    observation_ids: list[int] = field(default_factory=list)


@dataclass
class Trajectory:
    """The calls one trajectory made, in order; ``turns`` holds those since its last restart."""

    index: int
    budget: int
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the last request's
    restarts: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    error: str | None = None  # the first call of it the endpoint refused or failed: why (its rollout's failure)

    def used(self, prompt_ids: list[int]) -> int:
        """Tokens of the budget a prompt of this trajectory has used (all after its first turn's prompt)."""
        return len(prompt_ids) - len(self.turns[0].prompt_ids) if self.turns else 0

    def completion(self, tokenizer: Any) -> Completion | None:
        """The trajectory as one trained sequence: the first turn's prompt, then every sample (policy mask 1)
        and the environment's tokens between them (mask 0, log-prob 0); None without a turn."""
        turns = list(self.turns)
        while turns and not turns[-1].completion_ids:  # a last call refused for want of budget samples nothing
            turns.pop()
        if not turns:
            return None
        ids: list[int] = []
        logprobs: list[float] = []
        mask: list[int] = []
        for turn in turns:
            ids += turn.observation_ids + turn.completion_ids
            logprobs += [0.0] * len(turn.observation_ids) + turn.logprobs
            mask += [0] * len(turn.observation_ids) + [1] * len(turn.completion_ids)
        # truncated: the trajectory's budget ran out (a turn cut at its own max_tokens is not)
        exhausted = self.used(turns[-1].prompt_ids) + len(turns[-1].completion_ids) >= self.budget
        finish = "length" if exhausted or len(turns) < len(self.turns) else "stop"
        return Completion(
            prompt_ids=list(turns[0].prompt_ids),
            completion_ids=ids,
            logprobs=logprobs,
            finish_reason=finish,
            text=tokenizer.decode(ids, skip_special_tokens=True),
            policy_mask=mask,
            turns=len(turns),
        )


@dataclass
class _Request:
    prompt_ids: list[int]
    max_new_tokens: int
    stop: tuple[str, ...]
    row: int
    done: Future = field(default_factory=Future)


class ChatTemplate:
    """The tokenizer's chat template as the endpoint uses it: whole prompts, the end of an assistant turn, and
    new messages as they follow an assistant turn."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None):
        self.tokenizer, self.kwargs = tokenizer, dict(template_kwargs or {})
        base = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}]
        text = self.render(base, None, generation_prompt=False)
        self.turn_end = text[text.rindex(_SENTINEL) + len(_SENTINEL) :]  # e.g. "<|im_end|>\n"
        self._base = base

    def render(self, messages: list[dict[str, Any]], tools: list | None, generation_prompt: bool) -> str:
        extra = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt, **extra, **self.kwargs
        )

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, messages: list[dict[str, Any]], tools: list | None) -> list[int]:
        """A first call's prompt tokens, as the trainer tokenises a task's prompt (``tokenize_prompts``)."""
        return tokenize_prompts(self.tokenizer, [self.render(messages, tools, generation_prompt=True)])[0]

    def after_assistant(self, messages: list[dict[str, Any]], tools: list | None, sampled: list[int]) -> list[int]:
        """The tokens that follow an assistant turn that sampled ``sampled`` when ``messages`` come next: the rest
        of the turn's end (what the sample did not write of it, e.g. the newline after an EOS), then the messages
        and the generation prompt."""
        head = self.render(self._base, tools, generation_prompt=False)
        whole = self.render(self._base + messages, tools, generation_prompt=True)
        if not whole.startswith(head):
            raise RequestError("the chat template renders earlier turns differently once messages follow")
        end = self.turn_end
        first = self.encode(end)[:1]
        if sampled and sampled[-1:] == first:  # the sample wrote the turn end's first token (its EOS): not again
            end = end[len(self.tokenizer.decode(first, skip_special_tokens=False)) :]
        return self.encode(end + whole[len(head) :])


def tool_calls(text: str, trajectory: int, turn: int) -> tuple[str, list[dict[str, Any]]]:
    """The ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks of ``text`` as chat-completion tool
    calls, and the text without them; a block that is not such JSON stays in the text."""
    calls, kept = [], text
    for match in _CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            name, arguments = call["name"], call.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue
        if not isinstance(name, str):
            continue
        calls.append(
            {
                "id": f"call_{trajectory}_{turn}_{len(calls)}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
        )
        kept = kept.replace(match.group(0), "", 1)
    return (kept.strip() if calls else text), calls


class PolicyEndpoint:
    """Serves ``engine`` as OpenAI-compatible chat completions on 127.0.0.1 (a free port) until ``close``, to
    clients sending ``api_key`` (a random key of this endpoint's own).

    ``serving(params, count, budget, first_index)`` opens ``count`` trajectories sampled with ``params`` (its seed),
    the first seeded as global trajectory ``first_index``; ``base_url(k)`` is trajectory k's URL prefix.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        model_name: str = "policy",
        template_kwargs: dict[str, Any] | None = None,
        linger_s: float = 0.005,
        max_body_bytes: int = MAX_BODY_BYTES,
    ):
        self.engine, self.tokenizer, self.model_name, self.linger_s = engine, tokenizer, model_name, linger_s
        self.max_body_bytes = max_body_bytes
        self.api_key = secrets.token_urlsafe(32)  # what a client must send (``Endpoint.api_key``); never logged
        self.template = ChatTemplate(tokenizer, template_kwargs)
        self.params: SamplingParams | None = None
        self.trajectories: dict[int, Trajectory] = {}
        self.warned = False  # about a rewritten history
        self.engine_error: Exception | None = None  # the first engine failure while serving
        self.requests: queue.Queue[_Request | None] = queue.Queue()
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.threads = [
            threading.Thread(target=self.server.serve_forever, name="endpoint-http", daemon=True),
            threading.Thread(target=self._batches, name="endpoint-batcher", daemon=True),
        ]
        for thread in self.threads:
            thread.start()

    def base_url(self, trajectory: int) -> str:
        return f"http://127.0.0.1:{self.port}/t/{trajectory}/v1"

    def check_alive(self) -> None:
        """Raise ``EndpointStopped`` when the endpoint no longer serves (its HTTP server or its batcher stopped): no
        later rollout can reach the policy."""
        stopped = [t.name for t in self.threads if not t.is_alive()]
        if stopped:
            raise EndpointStopped(
                f"the policy endpoint on port {self.port} stopped serving ({', '.join(stopped)} ended)"
            )

    @contextmanager
    def serving(
        self, params: SamplingParams, count: int, budget: int, first_index: int = 0
    ) -> Iterator[list[Trajectory]]:
        """Trajectories 0..count-1 open for calls (sampled with ``params``, ``budget`` tokens each, seeded as the
        global trajectories ``first_index`` + k) inside the block; calls on them afterwards are refused. The
        engine's first failure inside it is raised at its end."""
        self.params, self.engine_error = params, None
        opened = [Trajectory(first_index + k, budget) for k in range(count)]
        self.trajectories = dict(enumerate(opened))
        try:
            yield opened
        finally:
            self.trajectories = {}
        if self.engine_error is not None:  # an engine that failed fails the run, not just the rollouts
            raise self.engine_error

    def close(self) -> None:
        """Stop serving (in-flight requests are answered with an error)."""
        self.server.shutdown()
        self.server.server_close()
        self.requests.put(None)

    # ---- one request -------------------------------------------------------------------------------
    def chat(self, key: int, body: Any) -> dict[str, Any]:
        """The reply to one chat-completions request of trajectory ``key`` (RequestError: refused, nothing done)."""
        trajectory = self.trajectories.get(key)
        try:
            return self._chat(key, trajectory, body)
        except Exception as err:
            if trajectory is not None and trajectory.error is None:
                trajectory.error = f"the endpoint answered a call with {type(err).__name__}: {err}"
            raise

    def _chat(self, key: int, trajectory: Trajectory | None, body: Any) -> dict[str, Any]:
        messages, tools, asked, stop = check_request(body, self.model_name)
        params = self.params
        if trajectory is None or params is None:
            raise RequestError(f"no open trajectory {key}", 404, code="not_found")
        with trajectory.lock:  # one call of a trajectory at a time
            prompt_ids, observation = self._prompt(trajectory, messages, tools)
            left = trajectory.budget - trajectory.used(prompt_ids)
            turn = len(trajectory.turns)
            if left <= 0:
                sample = Completion(prompt_ids, [], [], "length", "")
            else:
                request = _Request(
                    prompt_ids,
                    min(asked or left, left),
                    tuple(dict.fromkeys(params.stop_strings + stop)),
                    trajectory.index * TURN_STRIDE + turn + trajectory.restarts,
                )
                self.requests.put(request)
                sample = request.done.result()
            trajectory.turns.append(
                Turn(prompt_ids, sample.completion_ids, sample.logprobs, sample.finish_reason, observation)
            )
            trajectory.messages = [dict(m) for m in messages]
        return self._reply(trajectory.index, turn, prompt_ids, sample, body, tools)

    def _prompt(
        self, trajectory: Trajectory, messages: list[dict[str, Any]], tools: list | None
    ) -> tuple[list[int], list[int]]:
        """This call's prompt tokens and, for a later turn, the environment's tokens it adds."""
        before = trajectory.messages
        extends = (
            trajectory.turns
            and len(messages) > len(before) + 1
            and messages[: len(before)] == before
            and messages[len(before)].get("role") == "assistant"
        )
        if extends:
            last = trajectory.turns[-1]
            try:
                observation = self.template.after_assistant(messages[len(before) + 1 :], tools, last.completion_ids)
            except RequestError:
                observation = None
            if observation is not None:
                return last.prompt_ids + last.completion_ids + observation, observation
        try:
            prompt_ids = self.template.prompt(messages, tools)
        except Exception as err:  # the request's messages or tools, not the endpoint: refused before any change
            raise RequestError(f"the chat template cannot render the messages: {type(err).__name__}: {err}") from None
        if trajectory.turns:  # a rewritten history: the trajectory starts again from this call
            if not self.warned:
                self.warned = True
                logger.warning(
                    "an environment's call did not extend its trajectory's previous call (a rewritten history): the "
                    "trajectory starts again from it and its earlier turns are not trained (said once)"
                )
            trajectory.restarts += len(trajectory.turns)
            trajectory.turns = []
        return prompt_ids, []

    def _reply(
        self, index: int, turn: int, prompt_ids: list[int], sample: Completion, body: dict, tools: list | None
    ) -> dict[str, Any]:
        text = self.tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
        content, calls = tool_calls(text, index, turn) if tools else (text, [])
        finish = "tool_calls" if calls else sample.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        choice: dict[str, Any] = {
            "index": 0,
            "message": message,
            "finish_reason": finish,
            "token_ids": list(sample.completion_ids),
        }
        if body.get("logprobs"):
            choice["logprobs"] = {
                "content": [
                    {
                        "token": self.tokenizer.convert_ids_to_tokens(token),
                        "logprob": logprob,
                        "bytes": None,
                        "top_logprobs": [],
                    }
                    for token, logprob in zip(sample.completion_ids, sample.logprobs)
                ]
            }
        return {
            "id": f"chatcmpl-{index}-{turn}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [choice],
            "prompt_token_ids": list(prompt_ids),
            "usage": {
                "prompt_tokens": len(prompt_ids),
                "completion_tokens": len(sample.completion_ids),
                "total_tokens": len(prompt_ids) + len(sample.completion_ids),
            },
        }

    # ---- batching ----------------------------------------------------------------------------------
    def _batches(self) -> None:
        """Generate waiting requests together: those with the same stop strings, after ``linger_s`` of quiet."""
        pending: list[_Request] = []
        while True:
            try:
                item = self.requests.get(timeout=None if not pending else self.linger_s)
            except queue.Empty:
                item = ...
            if item is None:
                for request in pending:
                    request.done.set_exception(RequestError("the endpoint closed"))
                return
            if item is not ...:
                pending.append(item)
                continue
            stop = pending[0].stop
            batch = [r for r in pending if r.stop == stop]
            pending = [r for r in pending if r.stop != stop]
            try:
                self._generate(batch)
            except Exception as err:  # a fault of the batch's calls (never the batcher's): they fail, others go on
                logger.exception("endpoint: a batch of %d calls failed", len(batch))
                for request in batch:
                    if not request.done.done():
                        request.done.set_exception(err)

    def _generate(self, batch: list[_Request]) -> None:
        kept = []
        for request in batch:  # each call's own settings first: one that cannot be sampled fails alone
            try:
                replace(self.params, max_new_tokens=request.max_new_tokens, stop_strings=request.stop)
            except Exception as err:
                request.done.set_exception(RequestError(str(err)))
            else:
                kept.append(request)
        if not kept:
            return
        batch = kept
        params = replace(
            self.params,
            max_new_tokens=max(r.max_new_tokens for r in batch),
            stop_strings=batch[0].stop,
            rows=tuple(r.row for r in batch),
            prompt_offset=0,
        )
        try:
            out = self.engine.generate([r.prompt_ids for r in batch], 1, params)
        except Exception as err:  # every waiting call fails, and the caller of ``serving`` raises it afterwards
            self.engine_error = self.engine_error or err
            for request in batch:
                request.done.set_exception(err)
            return
        for request, (sample,) in zip(batch, out):
            cut = request.max_new_tokens
            if len(sample.completion_ids) > cut:  # a longer budget was shared with the batch: cut at its own
                ids, logprobs = sample.completion_ids[:cut], sample.logprobs[:cut]
                sample = replace(sample, completion_ids=ids, logprobs=logprobs, finish_reason="length")
            request.done.set_result(sample)


class _Server(ThreadingHTTPServer):
    request_queue_size = 256  # many environments' calls may connect at once

    def handle_error(self, request: Any, client_address: Any) -> None:  # a client gone mid-reply: not the server's
        logger.debug("endpoint: a connection failed", exc_info=True)


def _handler(endpoint: PolicyEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class's name)
            logger.debug("endpoint: " + format, *args)

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:  # a body left unread: the connection cannot carry another request
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)

        def _route(self) -> tuple[int, str]:
            match = re.fullmatch(r"/t/(\d{1,18})/v1/(chat/completions|models)/?", self.path.split("?")[0])
            if match is None:
                raise RequestError(f"no route {self.path[:200]}", 404, code="not_found")
            return int(match.group(1)), match.group(2)

        def _authorize(self) -> None:
            scheme, _, key = (self.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() != "bearer" or not compare_digest(key.strip().encode(), endpoint.api_key.encode()):
                raise RequestError(
                    "a missing or wrong API key (Authorization: Bearer KEY)",
                    401,
                    "authentication_error",
                    "invalid_api_key",
                )

        def _read(self) -> bytes:
            """The request's body, its size checked from its Content-Length before it is read."""
            if self.headers.get("Transfer-Encoding"):
                raise RequestError("a chunked body is not read: send a Content-Length")
            length = self.headers.get("Content-Length", "0").strip()
            if not length.isdigit():
                raise RequestError(f"Content-Length must be a non-negative integer, got {length[:32]!r}")
            if int(length) > endpoint.max_body_bytes:
                raise RequestError(
                    f"a body of {length[:32]} bytes is over the endpoint's {endpoint.max_body_bytes}", 413
                )
            return self.rfile.read(int(length))

        def _serve(self, post: bool) -> None:
            unread = post  # a body left unread: the connection closes after the reply
            try:
                data = self._read() if post else b""
                unread = False
                key, what = self._route()
                self._authorize()
                if what != ("chat/completions" if post else "models"):
                    raise RequestError(f"no route {self.command} {self.path[:200]}", 404, code="not_found")
                if not post:
                    model = {"id": endpoint.model_name, "object": "model", "owned_by": "grpolab"}
                    return self._send(200, {"object": "list", "data": [model]})
                try:
                    body = json.loads(data) if data else None
                except (ValueError, RecursionError) as err:  # UnicodeDecodeError is a ValueError
                    raise RequestError(f"the body is not JSON: {type(err).__name__}: {err}"[:300]) from None
                self._send(200, endpoint.chat(key, body))
            except RequestError as err:
                self.close_connection = self.close_connection or unread
                self._send(err.status, err.payload())
            except Exception as err:  # the engine failed: the environment's call fails, the run does not
                self.close_connection = self.close_connection or unread
                self._send(500, {"error": {"message": f"{type(err).__name__}: {err}", "type": "server_error"}})

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self._serve(post=False)

        def do_POST(self) -> None:  # noqa: N802
            self._serve(post=True)

    return Handler
