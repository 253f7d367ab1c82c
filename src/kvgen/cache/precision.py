"""The precision a cache stores keys and values in: float32, float16, bfloat16, or int8 rows.

A float format stores each value as that dtype. ``int8`` stores each position's head of D values as one
row of ``D + D // 8`` int8s: the D codes, then the bytes of D / 32 float32 scales, one per 32 codes
(``value = code * scale``, ``scale = max |x| / 127`` over the 32 values), as llama.cpp's ``q8_0`` KV cache
does with float16 scales. kvgen's attention (``kvgen::attention``) reads every format as stored, a tile at
a time; :func:`decode` turns stored rows back into floats (for SDPA where that op does not run).

Example:
    >>> x = torch.randn(1, 2, 3, 64)                                   # (B, Hkv, positions, D)
    >>> stored = encode(x, torch.int8)
    >>> stored.shape, stored.dtype
    (torch.Size([1, 2, 3, 72]), torch.int8)
    >>> bool((decode(stored, 64) - x).abs().max() < 0.02)
    True
"""

from __future__ import annotations

import torch

from kvgen.kernels import kernels_available

#: the names ``kv_dtype`` takes, and the storage dtype of each
KV_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}

_GROUP = 32  # int8 values per scale
_FLOAT16_MAX = 65504.0


def kv_dtype(value: str | torch.dtype) -> torch.dtype:
    """The storage dtype named by ``value`` (a name of :data:`KV_DTYPES`, or a dtype: those and any other float
    dtype a model may compute in, stored as it is).

    Example:
        >>> kv_dtype("float16")
        torch.float16
    """
    if isinstance(value, torch.dtype) and (value in KV_DTYPES.values() or value.is_floating_point):
        return value
    if isinstance(value, str) and value.removeprefix("torch.") in KV_DTYPES:
        return KV_DTYPES[value.removeprefix("torch.")]
    raise ValueError(f"cannot store keys and values as {value!r}: choose one of {', '.join(KV_DTYPES)}")


def stored_dim(dtype: torch.dtype, head_dim: int) -> int:
    """Stored elements of one position's head of ``head_dim`` values (an int8 row carries its scales)."""
    if dtype != torch.int8:
        return head_dim
    if head_dim % _GROUP:
        raise ValueError(f"int8 keys and values take a scale per {_GROUP} values; this model's heads hold {head_dim}: "
                         "store them as float16 or bfloat16")
    return head_dim + head_dim // 8


def encode(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Keys or values ``x`` (..., D) as stored in ``dtype``: (..., :func:`stored_dim`). float16 saturates at its
    largest finite value (65504) rather than become infinite."""
    if dtype == torch.float16:
        return x.clamp(-_FLOAT16_MAX, _FLOAT16_MAX).to(dtype)
    if dtype != torch.int8:
        return x.to(dtype)
    stored_dim(dtype, x.shape[-1])
    groups = x.float().unflatten(-1, (-1, _GROUP))  # (..., D / 32, 32)
    scale = groups.abs().amax(-1, keepdim=True) / 127  # (..., D / 32, 1)
    codes = torch.where(scale > 0, groups / scale, 0.0).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat([codes.flatten(-2), scale.squeeze(-1).contiguous().view(torch.int8)], dim=-1)


def store(buffer: torch.Tensor, index: torch.Tensor, x: torch.Tensor) -> None:
    """``buffer.index_copy_(2, index, encode(x, buffer.dtype))``: keys or values ``x`` (B, H, T, D) written into
    positions ``index`` (T,) of ``buffer`` (B, H, slots, stored width). A float32 buffer takes ``index_copy_``;
    others on the CPU one C++ pass (``kvgen::kv_store_``: the same bits as :func:`encode` for finite values, where
    encode's ten torch ops a layer cost an int8 pool ~8 ms of a 16-sequence decode step of SmolLM2)."""
    if buffer.dtype != torch.float32 and x.is_cpu and x.dtype == torch.float32 and \
            not torch.compiler.is_compiling() and kernels_available():
        torch.ops.kvgen.kv_store_(buffer, index, x)
    else:
        buffer.index_copy_(2, index, encode(x, buffer.dtype))


def decode(stored: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored keys or values (..., :func:`stored_dim`) as ``dtype`` (..., ``head_dim``): int8 codes times their
    scales in float32 (the products ``kvgen::attention`` forms), then cast."""
    if stored.dtype != torch.int8:
        return stored.to(dtype)
    codes = stored[..., :head_dim].float().unflatten(-1, (-1, _GROUP))  # (..., D / 32, 32)
    scale = stored[..., head_dim:].contiguous().view(torch.float32)  # (..., D / 32)
    return (codes * scale[..., None]).flatten(-2).to(dtype)
