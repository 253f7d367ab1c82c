"""Tool calls (OpenAI's ``tools`` and ``tool_choice``): what the chat template is shown, the grammar that forces
a call, and the calls read back from a reply.

``tool_choice``:

* ``"auto"`` (the default with tools): the model decides. Calls are read from its reply where it writes them as
  Hermes and Qwen2.5 do, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, or as Llama 3.x does, a
  reply that is one JSON object ``{"name": ..., "parameters": {...}}``; only calls of offered tools count.
* ``"required"``: one call or more (one with ``parallel_tool_calls: false``), the reply held to a JSON array of
  calls by a grammar (:mod:`kvgen.grammar`).
* ``{"type": "function", "function": {"name": ...}}``: that function, the reply held to its parameters' schema.
* ``"none"``: no call; the tools are not shown to the model.

Example:
    >>> tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    >>> plan = ToolPlan.of(tools, "auto", parallel=True)
    >>> plan.read('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')[1][0]["function"]
    {'name': 'add', 'arguments': '{"a": 1}'}
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from kvgen.grammar import GrammarError, schema_grammar

_TAGGED = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_OPEN = "<tool_call>"


class ToolError(ValueError):
    """``tools`` or ``tool_choice`` that cannot be served; ``param`` names which."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolPlan:
    """A chat request's tools: those shown to the template, the grammar forcing calls (None: the model decides)."""

    functions: dict[str, dict]  # name -> OpenAI's function (name, description, parameters)
    shown: list[dict] | None  # the template's ``tools``
    grammar: str | None
    forced: str | None  # "required", or the name of the function forced

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice, parallel: bool) -> ToolPlan | None:
        """The plan of a request's ``tools`` and ``tool_choice`` (None without tools); :class:`ToolError` if wrong."""
        if not tools:
            if tool_choice not in (None, "none", "auto"):
                raise ToolError("tool_choice needs tools", "tool_choice")
            return None
        functions = {}
        for tool in tools:
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(function, dict) or tool.get("type") != "function" or \
                    not isinstance(function.get("name"), str) or not function["name"]:
                raise ToolError('each tool must be {"type": "function", "function": {"name": ..., "parameters": '
                                '{...}}}', "tools")
            if not isinstance(function.get("parameters", {}), dict):
                raise ToolError(f"the parameters of {function['name']!r} must be a JSON schema object", "tools")
            functions[function["name"]] = function
        choice = tool_choice or "auto"
        if choice == "none":
            return cls(functions, None, None, None)
        if choice == "auto":
            return cls(functions, tools, None, None)
        arguments = lambda f: f.get("parameters") or {"type": "object"}  # noqa: E731
        if choice == "required":
            calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"const": name}, "arguments": arguments(f)},
                 "required": ["name", "arguments"], "additionalProperties": False} for name, f in functions.items()]}}
            if not parallel:
                calls["maxItems"] = 1
            return cls(functions, tools, _grammar(calls), "required")
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
        if name not in functions:
            raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                            f'{{"name": ...}}}} naming an offered tool, not {tool_choice!r}', "tool_choice")
        return cls(functions, tools, _grammar(arguments(functions[name])), name)

    def read(self, reply: str) -> tuple[str | None, list[dict]]:
        """(content, tool_calls) of a whole reply: OpenAI's ``tool_calls`` (``arguments`` a JSON string)."""
        if self.forced is not None:
            calls = json.loads(reply)
            pairs = [(c["name"], c["arguments"]) for c in calls] if self.forced == "required" else [(self.forced, calls)]
            return None, [_call(name, args) for name, args in pairs]
        if self.shown is None:
            return reply, []
        calls = [c for c in map(self._parse, _TAGGED.findall(reply)) if c is not None]
        if calls:
            content = _TAGGED.sub("", reply).strip()
            return content or None, calls
        whole = self._parse(reply.strip()) if reply.strip().startswith("{") else None
        return (None, [whole]) if whole is not None else (reply, [])

    def _parse(self, text: str) -> dict | None:
        try:
            call = json.loads(text)
        except ValueError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self.functions:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        return _call(call["name"], arguments)

    def held(self, text: str) -> int:
        """How much of a streamed reply's ``text`` so far may go out as content: none of a forced call, nothing
        from a call's opening tag (or what may become one) on, nothing of a reply that opens like a JSON call."""
        if self.forced is not None or (self.shown is not None and text.lstrip().startswith("{")):
            return 0
        if self.shown is None:
            return len(text)
        at = text.find(_OPEN)
        if at >= 0:
            return at
        return next((len(text) - k for k in range(len(_OPEN) - 1, 0, -1) if text.endswith(_OPEN[:k])), len(text))


def _grammar(schema: dict) -> str:
    try:
        return schema_grammar(schema)
    except GrammarError as error:
        raise ToolError(f"the tool's parameters cannot be compiled: {error}", "tools") from None


def _call(name: str, arguments) -> dict:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages as chat templates read them: an assistant's tool call arguments as objects, not JSON text
    (as transformers' templates expect them)."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            calls = [{**call, "function": {**call.get("function", {}),
                                           "arguments": _as_object(call.get("function", {}).get("arguments"))}}
                     for call in calls]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def _as_object(arguments):
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments
