"""Decode-time RMSNorm and attention in kvgen's C++ kernels, for eager decode steps on the CPU.

A decode step's norms and attention are tiny: in eager mode their cost is kernel launches
and thread wake-ups (``F.rms_norm`` runs as ~8 ATen ops, SDPA's CPU kernel is built for long
queries), not arithmetic. For float32 CPU inputs of at most ``MAX_ROWS`` query rows, outside
``torch.compile``, these run one C++ op each (``torch.ops.kvgen.rms_norm`` / ``attention``);
anything else goes to torch. Results equal torch's up to float32 rounding order.

Example:
    >>> x = torch.randn(1, 1, 64)
    >>> torch.allclose(rms_norm(x, torch.ones(64), 1e-6), F.rms_norm(x, (64,), torch.ones(64), 1e-6), atol=1e-6)
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvgen.kernels import kernels_available
from kvgen.models.decode_blocks import MAX_ROWS


def _native(x: torch.Tensor, rows: int) -> bool:
    return (rows <= MAX_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
            and not torch.compiler.is_compiling() and not torch.is_grad_enabled() and kernels_available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, weight.shape, weight, eps)`` over the last dim of ``x``."""
    if _native(x, x.numel() // x.shape[-1]) and weight.dtype == torch.float32:
        return torch.ops.kvgen.rms_norm(x.contiguous(), weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
              scale: float, softcap: float | None = None) -> torch.Tensor | None:
    """Attention of ``q`` (B, H, T, D) over ``k``/``v`` (B, Hkv, S, D): (B, H, T, D), or None when the
    native op does not apply (then the caller runs its torch path). ``mask``: bool, True where allowed."""
    if is_causal or q.shape[-1] % 16 or (mask is not None and mask.dtype != torch.bool) \
            or not _native(q, q.shape[0] * q.shape[2]):
        return None
    return torch.ops.kvgen.attention(q, k, v, mask, scale, softcap or 0.0)
