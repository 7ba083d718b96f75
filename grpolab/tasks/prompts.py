"""Prompt formats: how an example's fields become the prompt string the model continues.

* ``r1_zero``: the r1_zero template with the question inserted (GUIDE section 3).
* ``chat``: the tokenizer's own chat template (``apply_chat_template``) over an optional system
  message and one user message, with the generation prompt appended; ``chat_template_kwargs`` go to
  the template (e.g. ``{enable_thinking = false}`` for Qwen3's thinking switch). The user message is
  ``template`` filled in (default ``"{question}"``). Needs ``bind_tokenizer`` before use.
* ``template``: a user format string, the whole prompt.

With tools (``grpolab.tools.Toolset``), ``r1_zero`` prompts carry ``Toolset.instruction()`` before the
question, ``chat`` prompts pass the tools' schemas to the template (``apply_chat_template(tools=...)``,
which Qwen3's and Llama 3's templates render), and ``template`` prompts may place the instruction with
``{tools}``.

Templates name fields as ``{name}``: ``question`` and every field of the data row. ``{{`` and ``}}``
are literal braces, and any other brace is literal too, so ``"... within \\boxed{}."`` needs no
escaping.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any, Literal

from grpolab.tasks.r1_zero import R1_ZERO_TEMPLATE, r1_zero_prompt

PromptFormat = Literal["r1_zero", "chat", "template"]
_FIELD = re.compile(r"\{\{|\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")


def template_fields(template: str) -> list[str]:
    """The field names ``template`` refers to, in order of first use."""
    return list(dict.fromkeys(m.group(1) for m in _FIELD.finditer(template) if m.group(1)))


def fill_template(template: str, fields: Mapping[str, Any]) -> str:
    """``template`` with each ``{name}`` replaced by ``str(fields[name])`` (KeyError when one is missing)."""

    def substitute(match: re.Match) -> str:
        token = match.group(0)
        if token in ("{{", "}}"):
            return token[0]
        return str(fields[match.group(1)])

    return _FIELD.sub(substitute, template)


class PromptBuilder:
    """Renders prompts of one format; chat prompts only once ``bind_tokenizer`` has been called."""

    def __init__(
        self,
        format: PromptFormat,
        template: str | None = None,
        system: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        toolset: Any = None,
    ):
        if format == "template" and not template:
            raise ValueError("prompt format 'template' needs prompt.template, e.g. \"Q: {question}\\nA:\"")
        if format == "r1_zero" and (template or system or chat_template_kwargs):
            raise ValueError(
                "prompt format 'r1_zero' is fixed; prompt.template / system / chat_template_kwargs "
                "apply to 'chat' or 'template'"
            )
        if format == "template" and (system or chat_template_kwargs):
            raise ValueError("prompt.system and prompt.chat_template_kwargs apply to format 'chat' only")
        self.format, self.system = format, system
        self.template = template or "{question}"
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.toolset, self.tokenizer = toolset, None
        self.template_shows_tools = False  # (chat) known once the tokenizer is bound
        self.tools_note = toolset.instruction() if toolset is not None else ""

    @property
    def fields(self) -> list[str]:
        """Row fields every example must have."""
        return (
            ["question"]
            if self.format == "r1_zero"
            else [f for f in template_fields(self.template) if not (f == "tools" and self.toolset is not None)]
        )

    def bind_tokenizer(self, tokenizer: Any) -> None:
        """The tokenizer whose chat template renders chat prompts (refused when it has none)."""
        if self.format == "chat":
            if not getattr(tokenizer, "chat_template", None):
                raise ValueError(
                    "prompt format 'chat' needs a tokenizer with a chat template; this model's "
                    "tokenizer has none (use prompt.format 'r1_zero' or 'template')"
                )
            self.tokenizer = tokenizer
            self.template_shows_tools = self.toolset is not None and self._shows_tools()

    def _shows_tools(self) -> bool:
        """Whether the chat template renders its ``tools`` argument (many, e.g. SmolLM2's, ignore it: the tools'
        instruction then goes into the user's message instead)."""
        probe = [{"role": "user", "content": "?"}]
        bare = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        shown = self.tokenizer.apply_chat_template(
            probe, tokenize=False, add_generation_prompt=True, tools=self.toolset.schemas()
        )
        return shown != bare

    def messages(self, fields: Mapping[str, Any]) -> list[dict[str, str]]:
        """The chat messages of one example: [system], user (ending in the tools' instruction when the chat
        template does not show its tools)."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        content = fill_template(self.template, fields)
        if self.toolset is not None and not self.template_shows_tools:
            content = f"{content}\n\n{self.tools_note.strip()}"
        return system + [{"role": "user", "content": content}]

    def render(self, fields: Mapping[str, Any]) -> str:
        """The prompt string for one example's ``fields`` (``question`` plus the row's fields)."""
        if self.format == "r1_zero":
            return r1_zero_prompt(str(fields["question"]), self.tools_note)
        if self.format == "template":
            return fill_template(self.template, {**fields, "tools": self.tools_note} if self.toolset else fields)
        if self.tokenizer is None:
            raise RuntimeError("chat prompts are rendered once the model's tokenizer is bound (bind_tokenizer)")
        tools = {"tools": self.toolset.schemas()} if self.toolset is not None else {}
        return self.tokenizer.apply_chat_template(
            self.messages(fields), tokenize=False, add_generation_prompt=True, **tools, **self.chat_template_kwargs
        )

    def describe(self) -> str:
        """How prompts are made, as text (for the snapshot and the fingerprint); for chat prompts the
        tokenizer's chat template itself once bound."""
        if self.format == "r1_zero":
            return R1_ZERO_TEMPLATE if self.toolset is None else r1_zero_prompt("{question}", self.tools_note)
        if self.format == "template":
            return self.template + (f"\n[tools]\n{self.tools_note}" if self.toolset is not None else "")
        tools = {"tools": self.toolset.schemas()} if self.toolset is not None else {}
        return json.dumps(
            {
                "format": "chat",
                "system": self.system,
                "user": self.template,
                "chat_template_kwargs": self.chat_template_kwargs,
                **tools,
                **({"tools_in_user_message": not self.template_shows_tools} if tools else {}),
                "chat_template": getattr(self.tokenizer, "chat_template", None),
            },
            sort_keys=True,
            ensure_ascii=False,
            indent=1,
        )
