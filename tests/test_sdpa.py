"""kvgen.models.sdpa: eager CUDA calls keep off cuDNN's attention (a graph built per key count); elsewhere torch
chooses. The GPU side runs in tests/test_cuda.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from kvgen.models import sdpa


def test_eager_cuda_calls_take_every_backend_but_cudnn():
    assert SDPBackend.CUDNN_ATTENTION not in sdpa.backends_for(torch.device("cuda"))
    assert {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH} <= set(
        sdpa.backends_for(torch.device("cuda", 0)))
    assert sdpa.backends_for(torch.device("cpu")) is None


def test_compiled_calls_leave_the_choice_to_torch(monkeypatch):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert sdpa.backends_for(torch.device("cuda")) is None


def test_the_cpu_result_is_torch_s():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 16, generator=g)
    k, v = torch.randn(2, 2, 9, 16, generator=g), torch.randn(2, 2, 9, 16, generator=g)
    mask = torch.rand(2, 1, 5, 9, generator=g) > 0.3
    mask[..., 0] = True
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3, enable_gqa=True)
    assert torch.equal(sdpa.scaled_dot_product_attention(q, k, v, mask, False, 0.3, True), want)
