"""Shared fixtures: the real default model (SmolLM2-135M-Instruct), in float32 (converted once per machine)
and as the CLI runs it (the GGUF's stored types)."""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def default_model_dir():
    from kvgen.loading.default_model import default_model_dir as convert

    return str(convert())


@pytest.fixture(scope="session")
def smollm(default_model_dir):
    import kvgen

    model = kvgen.AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    return model, kvgen.AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def smollm_gguf():
    """The default model as ``kvgen generate`` loads it: the GGUF, weights in their stored types."""
    import kvgen
    from kvgen.loading.default_model import default_gguf_path

    path = default_gguf_path()
    return kvgen.AutoModelForCausalLM.from_pretrained(path), kvgen.AutoTokenizer.from_pretrained(path)
