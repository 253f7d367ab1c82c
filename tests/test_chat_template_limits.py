"""A chat template comes from a model file: one that loops, recurses or explodes is a ChatTemplateError within
the render's bounds, never a hang or an exhausted machine. Real templates render as before (test_tokenizer)."""

import time

import pytest

from kvgen import chat_template
from kvgen.chat_template import ChatTemplateError

MESSAGES = [{"role": "user", "content": "hi"}]
BAD = {
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran longer"),
    "recursive loop": ("{% for x in range(100000) recursive %}{% if loop.depth < 3 %}{{ loop(range(100000)) }}"
                       "{% endif %}{% endfor %}", "ran longer"),
    "repeated text": ("{{ 'a' * 1000000000 }}", "a repeated sequence of 1,000,000,000"),
    "repeated list": ("{% set x = [0] * 1000000000 %}", "a repeated sequence"),
    "power": ("{{ 2 ** 1000000000 }}", "a power of bits"),
    "doubling with +": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                        "{% endfor %}", "a joined sequence"),
    "doubling with ~": ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                        "{% endfor %}", "a joined text"),
    "center filter": ("{{ 'x'|center(1000000000) }}", "a center width"),
    "center method": ("{{ 'x'.center(1000000000) }}", "a center width"),
    "indent": ("{{ 'a\nb'|indent(1000000000) }}", "a indent width"),
    "replace": ("{% set s = 'a' * 1000000 %}{{ s.replace('a', s) }}", "a replaced string"),
    "replace filter": ("{% set s = 'a' * 1000000 %}{{ s|replace('a', s) }}", "a replaced string"),
    "format": ("{{ '{:>1000000000}'.format('x') }}", "a format width"),
    "format filter": ("{{ '%1000000000s'|format('x') }}", "a format width"),
    "recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recurses without end"),
    "output": ("{% for i in range(100000) %}{% for j in range(100) %}{{ 'a' * 50 }}{% endfor %}{% endfor %}",
               "a rendered text"),
}


@pytest.mark.parametrize("name", BAD)
def test_a_template_that_loops_or_explodes_is_an_error(monkeypatch, smollm_gguf, name):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 0.5)
    source, message = BAD[name]
    _, tokenizer = smollm_gguf
    start = time.monotonic()
    with pytest.raises(ChatTemplateError, match=message):
        tokenizer.apply_chat_template(MESSAGES, chat_template=source, tokenize=False)
    assert time.monotonic() - start < 5  # 0.5 s of rendering, then the error


def test_the_output_limit_grows_with_the_inputs(smollm_gguf):
    """A long conversation renders: the limit is 4M characters plus 4x the inputs' size."""
    _, tokenizer = smollm_gguf
    long = [{"role": "user", "content": "word " * 1_000_000}]  # 5M characters
    text = tokenizer.apply_chat_template(long, tokenize=False)
    assert text.count("word ") == 1_000_000


def test_ordinary_templates_still_compute(smollm_gguf):
    _, tokenizer = smollm_gguf
    source = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ m.content|upper ~ '!' "
              "}}{% endfor %}{{ '%d'|format(ns.n * 1000000) }}|{{ 'ab' * 3 }}|{{ 2 ** 10 }}|{{ 'x'|center(5) }}|")
    assert tokenizer.apply_chat_template(MESSAGES * 2, chat_template=source, tokenize=False) == \
        "HI!HI!2000000|ababab|1024|  x  |"
