"""torch's ``scaled_dot_product_attention`` for the models' torch path, kept off cuDNN's backend in eager GPU runs;
``flex_attention`` where the mask is a block-sparse ``BlockMask`` (a paged pool read block by block).

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
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from kvgen.cache.precision import decode

NOT_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def backends_for(device: torch.device) -> list[SDPBackend] | None:
    """The backends an eager call on ``device`` may take, or None: torch's own choice."""
    return NOT_CUDNN if device.type == "cuda" and not torch.compiler.is_compiling() else None


def scaled_dot_product_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 mask: torch.Tensor | BlockMask | None, is_causal: bool, scale: float | None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` of q (B, H, T, D) over k/v (B, Hkv, S, D), off cuDNN where
    :func:`backends_for` says so; :func:`block_sparse_attention` for a ``BlockMask``. Keys and values stored in
    another precision than the queries' (a cache's ``kv_dtype``) are turned into the queries' dtype first."""
    if isinstance(mask, BlockMask):
        return block_sparse_attention(q, k, v, mask, scale)
    if k.dtype != q.dtype:
        k, v = decode(k, q.shape[-1], q.dtype), decode(v, q.shape[-1], q.dtype)
    backends = backends_for(q.device)
    with contextlib.nullcontext() if backends is None else sdpa_kernel(backends):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=enable_gqa)


def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float | None,
                           softcap: float | None = None) -> torch.Tensor:
    """Attention of q (1, H, T, D) over a paged pool k/v (1, Hkv, slots, D) through ``flex_attention``, reading
    only the blocks ``mask`` lists (:func:`kvgen.masks.paged_block_mask`), scores soft-capped by ``softcap``
    (``tanh(s / cap) * cap``, Gemma 2) where given: (1, H, T, D). On a GPU, the compiled kernel with 16-row and
    one-block tiles (as vLLM's flex backend); elsewhere torch's eager flex_attention, which computes every slot's
    score and applies the mask function to them (the same result, for tests and small pools)."""
    if k.dtype != q.dtype:
        k, v = decode(k, q.shape[-1], q.dtype), decode(v, q.shape[-1], q.dtype)
    score_mod = None if softcap is None else functools.partial(_softcap, cap=softcap)
    if not q.is_cuda:
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale,
                              enable_gqa=q.shape[1] != k.shape[1])
    options = {"BLOCK_M": mask.BLOCK_SIZE[0], "BLOCK_N": mask.BLOCK_SIZE[1], "FORCE_USE_FLEX_ATTENTION": True}
    return _compiled_flex()(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale,
                            enable_gqa=q.shape[1] != k.shape[1], kernel_options=options)


def _softcap(score, b, h, q, kv, cap: float):
    return torch.tanh(score / cap) * cap


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, fullgraph=True)
