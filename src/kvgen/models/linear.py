"""``Linear``: a linear layer whose weight streams from memory at full speed in compiled decode steps.

A decode step multiplies a few rows (one per sequence) by every weight matrix, so its speed
is how fast the weights stream from memory. MKL's ``F.linear`` streams a float32 matrix at
about half the memory bandwidth for one row, and slower for 2-8 rows. Written as one
reduction per row over the weight, inductor generates a single pass over the matrix with
one accumulator per row, vectorised along the input dimension: for one row, the 113 MB
``lm_head`` of SmolLM2 streams at about 1.3x the speed of a tensor copy on this 2-core host.
Outside compiled blocks (prefill, eager steps, ragged batches) products go through oneDNN's
matmul (:func:`matmul`), which reorders the weight into its blocked layout at every call; a
layer that :meth:`Linear.pack` gave a reordered copy skips that (:func:`pack_weights`: the
continuous-batching engine packs its model's weights while it runs).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.models.decode_blocks import MAX_ROWS


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, through oneDNN's matmul for float32 on the CPU outside autograd and compile (with
    ``packed``, the weight in oneDNN's layout, when given). On an AMD EPYC (Zen 4, 2 threads) it ran
    64-512 rows at 174-218 GFLOP/s where MKL's ``F.linear`` ran at 109-197 (a 49152-row ``lm_head``:
    174 vs 109), and streamed SmolLM2's layer weights for 1-8 rows at 14-19 GB/s where MKL streamed 8-12."""
    if (_ONEDNN_LINEAR is not None and x.is_cpu and x.dtype == weight.dtype == torch.float32
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling()):
        y = _ONEDNN_LINEAR(x.reshape(-1, x.shape[-1]), weight if packed is None else packed, bias, "none", [], "")
        return y.view(*x.shape[:-1], weight.shape[0])  # (..., out)
    return F.linear(x, weight, bias)


def pack_weights(model: nn.Module, pack: bool = True) -> int:
    """:meth:`Linear.pack` every :class:`Linear` of ``model`` (``pack=False``: drop the copies); returns the
    bytes the copies take. SmolLM2-135M's layers (30 x 4 products and the ``lm_head``, float32, AMD EPYC
    Zen 4, 2 threads): 14 rows 83 -> 29 ms, 64 rows 171 -> 96 ms, 256 rows 517 -> 345 ms."""
    total = 0
    for module in model.modules():
        if isinstance(module, Linear):
            total += module.pack() if pack else module.unpack()
    return total


_ONEDNN_LINEAR = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None

# oneDNN builds a matmul for every new input shape, and two caches keep it: ideep's (LRU_CACHE_CAPACITY) and
# oneDNN's own (ONEDNN_PRIMITIVE_CACHE_CAPACITY), 1,024 each by default, each entry holding ~0.5-2 MB at these
# sizes. A server, whose prefill steps take any number of rows, grew by hundreds of MB (SmolLM2, Zen 3: 352 ->
# 892 MB over 1,280 requests; bounded at 64: flat at ~610 MB, as fast). Only both bounds together bound it; 0
# crashes ideep. Read at the first oneDNN product, so a product run before kvgen's import keeps the defaults.
ONEDNN_CACHE_CAPACITY = 64
for _variable in ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY"):
    os.environ.setdefault(_variable, str(ONEDNN_CACHE_CAPACITY))


class Linear(nn.Linear):
    """``nn.Linear`` that, under ``torch.compile`` on CPU, computes a few rows as explicit dot products.

    Example:
        >>> layer = Linear(4, 3)
        >>> x = torch.randn(2, 4)
        >>> torch.allclose(torch.compile(layer)(x), x @ layer.weight.T + layer.bias, atol=1e-5)
        True
    """

    _onednn: tuple[int, int, torch.Tensor] | None = None  # (weight's data_ptr, its _version, reordered copy)

    def pack(self) -> int:
        """Keep a copy of the float32 CPU weight in oneDNN's blocked layout for eager products, which then
        skip reordering it at every call (a second copy of the weight; :meth:`unpack` drops it). A weight
        changed in place or replaced later is packed again at its next product. Returns the copy's bytes."""
        if _ONEDNN_LINEAR is None or self.weight.device.type != "cpu" or self.weight.dtype != torch.float32:
            return 0
        packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), 16)
        self._onednn = (self.weight.data_ptr(), self.weight._version, packed)
        return self.weight.nbytes

    def unpack(self) -> int:
        self._onednn = None
        return 0

    # The fused C++ decode ops (kvgen.models.native, kvgen.models.decode_stack) read a float32 CPU weight in place as
    # rows of kvgen's F32 format, through the attributes a QuantizedLinear gives them (formats, _segments,
    # takes_qmatmul). SmolLM2 in float32, 2 threads, decode steps as one op instead of compiled blocks: 19-20 ->
    # 37 tok/s on a Xeon with AMX (the compiled products streamed 11 GB/s of the 30 its memory gives).
    formats = (0,)  # GGML's F32

    @property
    def _segments(self) -> list[torch.Tensor]:
        return [self.weight]

    def takes_qmatmul(self, rows: int) -> bool:
        """Whether the fused ops take ``rows`` rows: as many as a compiled block (oneDNN is faster beyond)."""
        return rows <= MAX_ROWS

    def runs_fused(self) -> bool:
        """Whether the fused decode ops can read this layer (float32 rows on the CPU, no bias)."""
        w = self.weight
        return (self.bias is None and w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2
                and w.stride(1) == 1 and w.shape[1] % 32 == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (rows > MAX_ROWS or x.device.type != "cpu" or self.weight.dtype != torch.float32
                or not torch.compiler.is_compiling()):
            packed = None if torch.compiler.is_compiling() else self._onednn
            if packed is not None and (packed[0], packed[1]) != (self.weight.data_ptr(), self.weight._version):
                self.pack()  # the weight changed since it was packed
                packed = self._onednn
            return matmul(x, self.weight, self.bias, None if packed is None else packed[2])
        x2 = x.reshape(rows, x.shape[-1])
        if rows > 1:  # as_strided makes inductor store the input once: inlined, its producer (a norm,
            # silu(gate) * up) is recomputed for every output feature, and 2-8 rows become compute-bound
            x2 = x2.contiguous()  # (a view of strided rows, e.g. the last position of a prefill, is copied)
            x2 = x2.as_strided(x2.shape, (x2.shape[1], 1))
        y = torch.stack([(self.weight * x2[r]).sum(-1) for r in range(rows)])  # (rows, out): one pass over W
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
