"""Shared fixtures: the real default model (SmolLM2-135M-Instruct, converted once per machine)."""

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
