"""Chat templates: jinja2 templates rendered in a sandbox, with the helpers transformers gives them.

Example:
    >>> compile_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").render(messages=[{"content": "hi"}])
    'hi'
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, namespace=_TemplateNamespace,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)
