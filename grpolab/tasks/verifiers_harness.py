"""The chat loop a verifiers 0.4 seat runs in grpolab: verifiers' tool-less ``null`` chat program, in process.

verifiers runs a seat's harness as a program (a ``uv`` script in a sandbox or subprocess) that reaches the
model through the rollout's interception server. Its own ``Harness.launch`` contract allows the loop to run
in process instead, as long as every model call goes through that endpoint: this is that loop. It sends
non-streaming chat completions (grpolab's endpoint answers whole), calls the task's MCP tool servers for the
model's tool calls, and asks the rollout's tool gate first when the rollout has one. Imported only when a
``task.name = "verifiers"`` run builds its environment (verifiers is an optional dependency).
"""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

from verifiers.v1.clients import ModelContext
from verifiers.v1.dialects.chat import message_to_wire, parse_message
from verifiers.v1.harnesses.null.harness import NullHarness
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.task import TaskData
from verifiers.v1.trace import Trace

__all__ = ["InProcessChatHarness"]


def wire(message: Any) -> dict[str, Any]:
    """A message (a chat dict or a verifiers message) as verifiers writes it on the wire when it replays a
    conversation (``Harness.resume``): every call of a trajectory then extends the previous one exactly (the
    endpoint compares them), within a segment and across the env's turns."""
    return message_to_wire(parse_message(message) if isinstance(message, dict) else message)


def initial_messages(system_prompt: str | None, prompt: Any) -> list[dict[str, Any]]:
    """The first call's messages (wire dicts): the system prompt, then the prompt (a string: one user turn)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system_prompt}] if system_prompt else []
    if isinstance(prompt, str):
        messages.append({"role": "user", "content": prompt})
    elif prompt is not None:
        messages.extend(prompt)
    return [wire(m) for m in messages]


def tool_schemas(tools: list[Any], server: str) -> list[dict[str, Any]]:
    """OpenAI function schemas of MCP ``tools`` (``mcp.types.Tool``) of the server named ``server``, named as
    verifiers' chat program names them (``{server}_{tool}``), keys sorted (``canonical``)."""
    return [
        canonical(
            {
                "type": "function",
                "function": {
                    "name": f"{server}_{t.name}" if server else t.name,
                    "description": t.description or "",
                    "parameters": t.input_schema,
                },
            }
        )
        for t in tools
    ]


def canonical(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its keys sorted at every level: a chat template renders a schema in its keys' order, and a
    schema listed from an in-memory server and one received from a served one order them differently."""
    return json.loads(json.dumps(schema, sort_keys=True))


class InProcessChatHarness(NullHarness):
    """verifiers' ``null`` seat (a plain chat loop with the task's MCP tools) run in process, non-streaming."""

    async def setup(self, runtime: Runtime) -> None:
        """Nothing to install: the loop runs here."""

    async def launch(
        self,
        ctx: ModelContext,
        trace: Trace,
        runtime: Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: TaskData,
        tool_interception_url: str | None = None,
    ) -> ProgramResult:
        import httpx
        import openai

        system_prompt, prompt = self.resolve_prompt(data)
        messages = initial_messages(system_prompt, prompt)
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, timeout=None)
        gate = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)) if tool_interception_url else None
        try:
            async with AsyncExitStack() as stack:
                servers_cfg = {
                    name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()
                }
                tools, dispatch, servers = (
                    await connect_mcp({"mcpServers": servers_cfg}, stack) if servers_cfg else ([], {}, {})
                )
                tools = [canonical(t) for t in tools]  # as the task's prompt renders them
                while True:
                    kwargs: dict[str, Any] = {"model": ctx.model, "messages": messages}
                    if tools:
                        kwargs["tools"] = tools
                    completion = await client.chat.completions.create(**kwargs)
                    message = completion.choices[0].message
                    messages.append(wire(message.model_dump(exclude_none=True)))
                    if not message.tool_calls:
                        break
                    for call in message.tool_calls:
                        result = await self._tool_result(call, dispatch, servers, gate, tool_interception_url, secret)
                        messages.append(wire(result))
        except openai.APIError as err:
            # A refused turn (a limit, a @stop) or a failed model call ends the program; verifiers reads a
            # stopped trace's non-zero exit as expected, any other as the harness failing.
            return ProgramResult(exit_code=1, stdout="", stderr=f"{type(err).__name__}: {err}")
        finally:
            await client.close()
            if gate is not None:
                await gate.aclose()
        return ProgramResult(exit_code=0, stdout="", stderr="")

    @staticmethod
    async def _tool_result(
        call: Any,
        dispatch: dict[str, tuple[str, str]],
        servers: dict[str, Any],
        gate: Any,
        gate_url: str | None,
        secret: str,
    ) -> dict[str, Any]:
        """The tool message answering ``call``: the gate's denial, an error the model can read, or the tool's
        result (as verifiers' chat program words them)."""
        name = call.function.name
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError as err:
            arguments, content = None, f"error: invalid JSON in tool arguments ({err}); resend the call with valid JSON"
        if gate is not None and gate_url:
            response = await gate.post(
                gate_url,
                headers={"Authorization": f"Bearer {secret}"},
                json={"tool_call_id": call.id, "name": name, "arguments": arguments},
            )
            response.raise_for_status()
            decision = response.json()
            if decision["action"] == "stop":
                raise RuntimeError(decision["reason"])
            if decision["action"] == "deny":
                return decision["message"]
        if arguments is None:
            pass
        elif not isinstance(arguments, dict):
            content = f"error: tool arguments must be a JSON object, got {type(arguments).__name__}"
        elif name in dispatch:
            content = await call_mcp(servers, dispatch, name, arguments)
        else:
            content = f"error: unknown tool {name!r}"
        return {"role": "tool", "tool_call_id": call.id, "name": name, "content": content}
