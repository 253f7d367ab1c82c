"""``Linear``: a linear layer whose weight streams from memory at full speed in compiled decode steps.

A decode step multiplies a few rows (one per sequence) by every weight matrix, so its speed
is how fast the weights stream from memory. MKL's ``F.linear`` streams a float32 matrix at
about half the memory bandwidth for one row, and slower for 2-8 rows. Written as one
reduction per row over the weight, inductor generates a single pass over the matrix with
one accumulator per row, vectorised along the input dimension: for one row, the 113 MB
``lm_head`` of SmolLM2 streams at about 1.3x the speed of a tensor copy on this 2-core host.
Outside compiled blocks (prefill, eager steps, ragged batches) products go through oneDNN's
matmul (:func:`matmul`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.models.decode_blocks import MAX_ROWS


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through oneDNN's matmul for float32 on the CPU outside autograd and compile. On an
    AMD EPYC (Zen 4, 2 threads) it ran 64-512 rows at 174-218 GFLOP/s where MKL's ``F.linear`` ran at
    109-197 (a 49152-row ``lm_head``: 174 vs 109), and streamed SmolLM2's layer weights for 1-8 rows
    at 14-19 GB/s where MKL streamed 8-12."""
    if (_ONEDNN_LINEAR is not None and x.is_cpu and x.dtype == weight.dtype == torch.float32
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling()):
        y = _ONEDNN_LINEAR(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")  # (rows, out)
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None


class Linear(nn.Linear):
    """``nn.Linear`` that, under ``torch.compile`` on CPU, computes a few rows as explicit dot products.

    Example:
        >>> layer = Linear(4, 3)
        >>> x = torch.randn(2, 4)
        >>> torch.allclose(torch.compile(layer)(x), x @ layer.weight.T + layer.bias, atol=1e-5)
        True
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (rows > MAX_ROWS or x.device.type != "cpu" or self.weight.dtype != torch.float32
                or not torch.compiler.is_compiling()):
            return matmul(x, self.weight, self.bias)
        x2 = x.reshape(rows, x.shape[-1])
        if rows > 1:  # as_strided makes inductor store the input once: inlined, its producer (a norm,
            # silu(gate) * up) is recomputed for every output feature, and 2-8 rows become compute-bound
            x2 = x2.contiguous()  # (a view of strided rows, e.g. the last position of a prefill, is copied)
            x2 = x2.as_strided(x2.shape, (x2.shape[1], 1))
        y = torch.stack([(self.weight * x2[r]).sum(-1) for r in range(rows)])  # (rows, out): one pass over W
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
