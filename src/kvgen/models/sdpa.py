"""torch's ``scaled_dot_product_attention`` for the models' torch path, kept off cuDNN's backend in eager GPU runs.

torch picks cuDNN's attention first for float16/bfloat16 on Hopper GPUs, and cuDNN builds an execution graph
for each new key count: an eager decode step, one key longer than the last, builds one every step. Eager CUDA
calls take flash, memory-efficient or math attention instead (a random 16-layer Llama in float16, 32 steps at
8,192 keys on an H200: 13.1 -> 91.8 tok/s); under ``torch.compile`` (fixed shapes, CUDA graphs) and on other
devices torch chooses as usual.

Example:
    >>> q = k = v = torch.randn(1, 2, 3, 8)
    >>> scaled_dot_product_attention(q, k, v, None, True, 8 ** -0.5).shape
    torch.Size([1, 2, 3, 8])
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from kvgen.cache.precision import decode

NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def backends_for(device: torch.device) -> list[SDPBackend] | None:
    """The backends an eager call on ``device`` may take, or None: torch's own choice."""
    return NOT_CUDNN if device.type == "cuda" and not torch.compiler.is_compiling() else None


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                                 is_causal: bool, scale: float | None, enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of q (B, H, T, D) over k/v (B, Hkv, S, D), off cuDNN where
    :func:`backends_for` says so. Keys and values stored in another precision than the queries' (a cache's
    ``kv_dtype``) are turned into the queries' dtype first."""
    if k.dtype != q.dtype:
        k, v = decode(k, q.shape[-1], q.dtype), decode(v, q.shape[-1], q.dtype)
    backends = backends_for(q.device)
    with contextlib.nullcontext() if backends is None else sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)
