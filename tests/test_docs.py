"""The documentation's Python examples run: each file's ``python`` blocks in order, in one namespace, against the
packaged SmolLM2-135M-Instruct (its GGUF for ``path``, ``"model.gguf"``, ``model`` and ``small_model``, its
float32 folder for ``folder``) and,
for the ``openai`` client's examples, a ``kvgen serve`` of it. An example that no longer runs fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_server import Server

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def examples(path: Path) -> list[str]:
    return BLOCK.findall(path.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def server():
    """``kvgen serve`` of the packaged model under the name the examples use (tests/test_server.py's ``Server``)."""
    from kvgen.loading.default_model import default_gguf_path

    s = Server(default_gguf_path(), "--kv-cache-memory", "64MB", name="SmolLM2-135M-Instruct")  # (later flags win)
    yield s.url
    s.close()


def test_every_documentation_file_has_examples_or_none_by_design():
    assert {p.name for p in DOCS if examples(p)} == {"README.md", "caches.md", "serving.md", "speculative.md",
                                                     "weights.md"}


@pytest.mark.parametrize("doc", [p for p in DOCS if examples(p)], ids=lambda p: p.name)
def test_the_examples_run(doc, server, tmp_path, monkeypatch):
    import copy
    import json

    import torch

    import kvgen
    from kvgen.loading.default_model import default_gguf_path, default_model_dir

    monkeypatch.chdir(tmp_path)  # the files the examples save
    path = str(default_gguf_path())
    tokenizer = kvgen.AutoTokenizer.from_pretrained(path)
    prompt = tokenizer("The river ran under the old bridge, and the river ran on", return_tensors="pt").input_ids
    namespace = {"json": json, "copy": copy, "torch": torch, "kvgen": kvgen, **{n: getattr(kvgen, n) for n in kvgen.__all__},
                 "path": path, "folder": str(default_model_dir()), "INITIAL_PROMPT": "You are a helpful assistant. ",
                 "small_model": kvgen.AutoModelForCausalLM.from_pretrained(path), "tokenizer": tokenizer,
                 "model": kvgen.AutoModelForCausalLM.from_pretrained(path),  # (for guides that start from one)
                 "ids": prompt[0].tolist() if doc.name == "serving.md" else prompt,
                 "ids_a": prompt[0, :5].tolist(), "ids_b": prompt[0, :9].tolist(), "ids_c": prompt[0].tolist()}
    for source in examples(doc):
        source = source.replace('"model.gguf"', repr(path)).replace("http://127.0.0.1:8000", server)
        exec(compile(source, f"{doc.name} example", "exec"), namespace)  # noqa: S102 - the docs' own code
