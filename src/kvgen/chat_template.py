"""Chat templates: jinja2 templates rendered in a sandbox, with the helpers transformers gives them, and bounded.

A template comes from a model file, its variables from clients. :func:`render_chat_template` stops
a render that runs past :data:`RENDER_SECONDS` or writes more than :data:`MAX_CHARS` characters
(plus four times the size of its inputs) with a :class:`ChatTemplateError`: every loop step, call,
attribute lookup and operator of the template checks the render's budget, and ``*``, ``+``, ``**``
and the padding, replacing and indenting helpers refuse results past it before building them.

Example:
    >>> template = compile_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    >>> render_chat_template(template, messages=[{"content": "hi"}])
    'hi'
"""

from __future__ import annotations

import contextvars
import json
import re
import time
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

RENDER_SECONDS = 5.0  # real templates render in milliseconds
MAX_CHARS = 4_000_000  # ~1M tokens; a render may write this plus 4x its inputs' size
_STEP_FILTER, _CONCAT_FILTER = "_kvgen_step", "_kvgen_concat"


class ChatTemplateError(jinja2.exceptions.TemplateError):
    """A chat template that loops, recurses or writes past the render's bounds."""


class _Budget:
    """The time and size one render may take."""

    def __init__(self, seconds: float, chars: int):
        self.deadline, self.chars = time.monotonic() + seconds, chars

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"the chat template ran longer than {RENDER_SECONDS:g} s (a loop that does not "
                                    "end?); fix the template")

    def size(self, count: int, what: str) -> None:
        if count > self.chars:
            raise ChatTemplateError(f"the chat template would build {what} of {count:,}, past this render's limit "
                                    f"of {self.chars:,} characters or items; fix the template")


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)


def _tick() -> _Budget | None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.tick()
    return budget


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple)) else 0


def _check_sizes(name: str, args: tuple, kwargs: dict, target: Any = None) -> None:
    """Refuse a padding, indenting or replacing call whose result would be past the budget."""
    budget = _tick()
    if budget is None:
        return
    if name == "format":  # widths live in the format string: "{:>1000000000}", "%1000000000s"
        for width in re.findall(r"\d+", target if isinstance(target, str) else ""):
            budget.size(int(width), "a format width")
        return
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool):
            budget.size(value, f"a {name} width")
    if name == "replace" and isinstance(target, str) and len(args) >= 2 and isinstance(args[0], str):
        budget.size(len(target) + (target.count(args[0]) if args[0] else len(target) + 1) * _length(args[1]),
                    "a replaced string")


_SIZED_METHODS = {"center", "ljust", "rjust", "zfill", "expandtabs", "replace"}
_SIZED_FILTERS = {"center", "indent", "replace", "tojson", "format"}


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every loop step, call, lookup and operator checked against the render's budget."""

    intercepted_binops = frozenset(["*", "+", "**"])

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):  # `for x in items` -> `for x in items|_kvgen_step`
            loop.iter = nodes.Filter(loop.iter, _STEP_FILTER, [], [], None, None, lineno=loop.lineno)
        for parent in tree.find_all(nodes.Node):  # `a ~ b` -> `[a, b]|_kvgen_concat`
            for field, value in parent.iter_fields():
                if isinstance(value, nodes.Concat):
                    setattr(parent, field, _sized_concat(value))
                elif isinstance(value, list):
                    value[:] = [_sized_concat(v) if isinstance(v, nodes.Concat) else v for v in value]
        return tree

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        budget = _tick()
        if budget is not None:
            if operator == "*" and isinstance(right, int) and _length(left) or \
                    operator == "*" and isinstance(left, int) and _length(right):
                budget.size(max(_length(left), _length(right)) * max(left if isinstance(left, int) else 0,
                                                                     right if isinstance(right, int) else 0),
                            "a repeated sequence")
            elif operator == "+":
                budget.size(_length(left) + _length(right), "a joined sequence")
            elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                budget.size(abs(left).bit_length() * right, "a power of bits")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        name = getattr(__obj, "__name__", "")
        if name in _SIZED_METHODS and isinstance(getattr(__obj, "__self__", None), str):
            _check_sizes(name, args, kwargs, __obj.__self__)
        else:
            _tick()
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        if getattr(value, "__name__", None) in ("format", "format_map") and isinstance(getattr(value, "__self__", None),
                                                                                       str):
            _check_sizes("format", (), {}, value.__self__)  # jinja wraps str.format when it is looked up
        return super().wrap_str_format(value)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)


def _sized_concat(node: nodes.Concat) -> nodes.Filter:
    return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), _CONCAT_FILTER, [], [], None, None,
                        lineno=node.lineno)


@jinja2.pass_context  # never folded at compile time
def _concat(context, items: list) -> str:
    """``a ~ b``: the texts joined, refused past the render's budget before joining."""
    texts = [str(item) for item in items]
    budget = _tick()
    if budget is not None:
        budget.size(sum(map(len, texts)), "a joined text")
    return "".join(texts)


@jinja2.pass_context
def _steps(context, items: Any):
    """Each loop's items, checking the render's budget at every step."""
    for item in items:
        _tick()
        yield item


def _sized(name: str, filter_function):
    """``filter_function`` refusing results past the render's budget before building them.

    It takes the context, so jinja never runs it at compile time (outside any render's budget).
    """
    kind = getattr(filter_function, "jinja_pass_arg", None)  # jinja's pass_environment / pass_eval_context

    @jinja2.pass_context
    def checked(context, value, *args, **kwargs):
        _check_sizes(name, args, kwargs, value)
        if kind is None:
            return filter_function(value, *args, **kwargs)
        first = {"context": context, "eval_context": context.eval_ctx, "environment": context.environment}[kind.name]
        return filter_function(first, value, *args, **kwargs)

    return checked


class _TemplateNamespace(jinja2.utils.Namespace):
    """jinja's ``namespace()`` without underscore attributes, so templates cannot reach CPython internals."""

    def __setitem__(self, name: str, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")
        super().__setitem__(name, value)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in a sandbox with transformers' helpers (``tojson``, ``raise_exception``, ...)."""

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # no constant folding: it would run `'x'|center(10**9)` at compile time, outside any render's budget
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols],
                              optimized=False)
    env.filters["tojson"] = tojson
    env.filters.update({name: _sized(name, env.filters[name]) for name in _SIZED_FILTERS})
    env.filters.update({_STEP_FILTER: _steps, _CONCAT_FILTER: _concat})
    env.globals.update(raise_exception=raise_exception, namespace=_TemplateNamespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


def render_chat_template(template: jinja2.Template, **variables: Any) -> str:
    """Render ``template`` within :data:`RENDER_SECONDS` and :data:`MAX_CHARS` (plus 4x the inputs' size)."""
    inputs = len(json.dumps(variables, default=str))
    budget = _Budget(RENDER_SECONDS, MAX_CHARS + 4 * inputs)
    token = _BUDGET.set(budget)
    try:
        out, size = [], 0
        for chunk in template.generate(**variables):
            size += len(chunk)
            budget.size(size, "a rendered text")
            out.append(chunk)
        return "".join(out)
    except RecursionError:
        raise ChatTemplateError("the chat template recurses without end; fix the template") from None
    except MemoryError:
        raise ChatTemplateError("the chat template needs more memory than this machine has; fix the template") from None
    finally:
        _BUDGET.reset(token)
