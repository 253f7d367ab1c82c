"""Linear and embedding layers over weights kept in their stored formats (:mod:`kvgen.models.packed`).

Inputs of at most :data:`QMATMUL_ROWS` rows (decode steps, batched decoding, short chunks) run
``torch.ops.kvgen.qmatmul``: one pass over the stored bytes per 8 rows (AVX2: 2, its integer dot products 4;
AVX-512 VNNI's of more than 8 rows: 16), each block decoded in registers and multiplied by those rows
(``d * sum(q * x) + m * sum(x)`` per group, float32 accumulation). With AVX-512 VNNI, weights of 4-6 bits
in tiles of 16 rows take exact integer dot products of their stored values with the rows rounded to 21 bits
and a sign per block of 32 values (at most 2^-22 of the block's largest value off): 1.4-1.8x faster per
thread than widening every value to float32; so do kvgen's int8 and int4 weights (quantized at load). With AVX2
alone, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K and Q8_0 tiles take the same sums by vpmaddubsw (Zen 3: 1.0-1.6x at 1 and 4
rows) for up to 9 rows (Q6_K and Q8_0: 4, Q4_K: 7); from :func:`~kvgen.kernels.panel_rows` rows on, each tile is
dequantized once into float32 panels multiplied by float32 multiply-adds, which share vpmaddubsw's two pipes on Zen
3 (16 rows 1.15-1.45x, 64 rows 1.3-1.75x the integer sums over SmolLM2's and Qwen2.5's layers, 2 threads), prefills
included (1.1-1.6x dequantize + oneDNN at 128-512 rows: :func:`any_rows_formats`). Where the CPU has AMX (Intel's
tile unit), products of 16 rows or more take the same integer sums 16 input rows by 16 weight rows per instruction,
the same bits, and BF16 weights take AMX's bfloat16 products with the rows split exactly into three bfloat16 parts
(:func:`~kvgen.kernels.tile_formats`).
Larger inputs (prefill) are compute-bound: the weight is dequantized into a scratch buffer
reused by every layer, exactly as gguf dequantizes it, then multiplied by the float32 matmul,
except where the integer dot products are faster at any number of rows (:func:`any_rows_formats`).
Both paths compute with the weights a float32 model would hold, up to float32 rounding order, but for a prompt's rows
on AVX2 without AVX-512 VNNI, whose Q4_K products take 16-bit inputs (:mod:`kvgen.kernels.prompt_rows`).
On a GPU (any device but the CPU) every format stays in its stored bytes in device memory (GGUF blocks, kvgen's
int8 and int4, F16, BF16) and each product decodes it with torch operations into the input's dtype before its
matmul (:func:`~kvgen.models.packed.dequantize_on_device`, the CPU kernels' values bit for bit). GGUF segments in
tiles of 16 rows (the CPU's layout) go back to GGUF rows when a layer leaves the CPU, and into tiles again when it
comes back (:meth:`_Packed._apply`).
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.nn import functional as F

from kvgen.kernels import integer_dot_formats, integer_dot_instruction, panel_rows, prefill_inputs, tile_formats
from kvgen.kernels.prompt_rows import rows_kind
from kvgen.models.linear import matmul
from kvgen.models.packed import TILED, PackedWeight, dequantize_on_device, tile_rows, untile_rows

#: most rows the one-pass product takes; more are dequantized and multiplied by the float32 matmul.
#: Over SmolLM2's and Gemma 3's layers (AMD EPYC Zen 4, 2 threads) the one-pass product was faster up to
#: 64-128 rows with AVX-512 (8 rows a pass over the weight). (AVX2's integer tiles take their float32 panels at any
#: number of rows: :func:`any_rows_formats`.)
QMATMUL_ROWS = 64

@functools.cache
def any_rows_formats() -> frozenset[int]:
    """Formats whose one-pass product beats dequantize + float32 matmul at any number of rows: the integer
    dot products of AVX-512 VNNI (Zen 4, 2 threads, Gemma 3's and SmolLM2's layers at 512 rows: 200-240
    GFLOP/s against 185-198 for dequantize + oneDNN), except Q6_K's (groups of 16 values: 145) and kvgen's
    int8 and int4 tiles (a Xeon with AMX, 2 threads, 3072 x 576 at 512 rows: 263-302 against 324-358;
    SmolLM2 in int8, prefill of 512 tokens: 858-914 tok/s against 982-1018). With AMX's tile products
    (:func:`~kvgen.kernels.tile_formats`): every integer dot format but Q6_K, and BF16. With AVX2 alone, every
    format of its integer tiles: their float32 panels (:func:`~kvgen.kernels.panel_rows`) need no dequantized copy
    of the weight (AMD EPYC Zen 3, SmolLM2's, Qwen2.5-Coder-0.5B's and a Qwen2.5-1.5B's layers: 1.1-1.6x dequantize
    + oneDNN at 128-512 rows, even at 1,024-2,048; prefill of 512 tokens 1.03-1.35x)."""
    if tile_formats():  # (Q6_K keeps vpdpbusd: 142-221 GFLOP/s at 512 rows against 263-295 for dequantize + oneDNN)
        return tile_formats()
    if panel_rows() > 0:
        return integer_dot_formats()
    if integer_dot_instruction() != "vpdpbusd":
        return frozenset()
    return integer_dot_formats() - {2014, 3008, 3032, 3064, 3128}


def prompt_products_differ(formats) -> bool:
    """Whether products of a prompt's rows by weights in ``formats`` differ from the exact ones that rows of generated
    tokens take: Q4_K's tiles (2012) where a prompt's inputs are 16-bit (:func:`~kvgen.kernels.prefill_inputs`)."""
    return 2012 in formats and prefill_inputs() == "int16"


def products_rows_kind(rows: int, *layers: nn.Module) -> bool | torch.Tensor:
    """:func:`~kvgen.kernels.prompt_rows.rows_kind` of products of ``rows`` input rows by ``layers``' weights
    (stored-precision layers carry their ``formats``; others, a split model's wrappers, mark their own products): a mask
    (both kinds of rows) only where their products differ (:func:`prompt_products_differ`), else False for it (every
    row exact)."""
    kind = rows_kind(rows)
    if isinstance(kind, bool) or prompt_products_differ({f for layer in layers for f in getattr(layer, "formats", ())}):
        return kind
    return False


_scratch = torch.empty(0)  # float32 scratch for prefill: the largest dequantized weight so far


def _dequantized(weight: PackedWeight) -> torch.Tensor:
    """``weight`` dequantized into the shared scratch buffer (valid until the next call)."""
    global _scratch
    n, k = weight.shape
    if _scratch.numel() < n * k:
        _scratch = torch.empty(n * k)
    return weight.dequantize(out=_scratch[: n * k].view(n, k))


class _Packed(nn.Module):
    """Holds a :class:`PackedWeight` as buffers ``packed_0``, ``packed_1``, ... (one per segment)."""

    def __init__(self, weight: PackedWeight):
        super().__init__()
        self.weight = weight

    @property
    def weight(self) -> PackedWeight:
        return PackedWeight(list(zip(self.formats, self._segments)), self.in_features)

    @weight.setter
    def weight(self, weight: PackedWeight) -> None:  # also tying: share another layer's stored weight
        if not isinstance(weight, PackedWeight):
            raise TypeError(f"{type(self).__name__} holds a PackedWeight; cannot assign a {type(weight).__name__}")
        self.formats = [format for format, _ in weight.segments]
        self.in_features = weight.in_features
        self._segment_names = [f"packed_{i}" for i in range(len(weight.segments))]
        for name in [n for n in self._buffers if n.startswith("packed_")]:
            del self._buffers[name]
        for i, (_, data) in enumerate(weight.segments):
            self.register_buffer(f"packed_{i}", data)

    def _apply(self, fn, recurse=True):
        """``module.to(device)`` and the like: off the CPU, segments in tiles of 16 rows go back to GGUF rows (which
        :func:`~kvgen.models.packed.dequantize_on_device` and row lookups read); back on the CPU, into tiles again."""
        super()._apply(fn, recurse)
        on_cpu = self._segments[0].device.type == "cpu"
        if not on_cpu and any(format in TILED for format in self.formats):
            self.weight, self._tiled_on_cpu = untile_rows(self.weight), True
        elif on_cpu and self.__dict__.pop("_tiled_on_cpu", False):
            self.weight = tile_rows(self.weight)
        return self

    @property
    def _segments(self) -> list[torch.Tensor]:
        buffers = self._buffers
        return [buffers[name] for name in self._segment_names]


class QuantizedLinear(_Packed):
    """``nn.Linear`` whose weight stays in its stored format (GGUF blocks, int8, int4, float16, bfloat16).

    Example:
        >>> import gguf, numpy as np
        >>> w = np.random.randn(64, 32).astype(np.float32)
        >>> raw = torch.from_numpy(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))
        >>> layer = QuantizedLinear(PackedWeight([(8, raw)], in_features=32))
        >>> layer(torch.randn(1, 32)).shape
        torch.Size([1, 64])
    """

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None):
        super().__init__(weight)
        self.out_features = weight.out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def takes_qmatmul(self, rows: int) -> bool:
        """Whether a CPU product of ``rows`` rows is the one-pass ``kvgen::qmatmul`` (else dequantize + matmul)."""
        if rows <= QMATMUL_ROWS:
            return True
        # (BF16's tile products take weights of a multiple of 16 rows: others would take the one-pass product)
        return any_rows_formats().issuperset(self.formats) and all(
            format != 30 or segment.shape[0] % 16 == 0 for format, segment in zip(self.formats, self._segments))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":  # GPU: decoded by torch operations, then x's matmul
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return F.linear(x, self.weight.dequantize().to(x.dtype), bias)
        rows = x.numel() // self.in_features
        x2 = x.reshape(rows, self.in_features)  # (rows, in)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.float().contiguous()
        if self.takes_qmatmul(rows):
            y = self._qmatmul(x2, products_rows_kind(rows, self))  # (rows, out)
            if self.bias is not None:
                y = y + self.bias
        else:
            y = matmul(x2, _dequantized(self.weight), self.bias)
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def _qmatmul(self, x: torch.Tensor, prompt: bool | torch.Tensor) -> torch.Tensor:
        """``kvgen::qmatmul`` of x (rows, in): its prompt rows (:mod:`kvgen.kernels.prompt_rows`) as the prompt's, the
        others as generated tokens'; where both kinds are there (a mask: :func:`products_rows_kind`), as two
        products."""
        if isinstance(prompt, bool):
            return torch.ops.kvgen.qmatmul(x, self._segments, self.formats, prompt)
        y = x.new_empty(x.shape[0], self.out_features)  # (rows, out)
        y[prompt] = torch.ops.kvgen.qmatmul(x[prompt], self._segments, self.formats, True)
        y[~prompt] = torch.ops.kvgen.qmatmul(x[~prompt], self._segments, self.formats, False)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"format={self.weight.format_name}, bias={self.bias is not None}"


class QuantizedEmbedding(_Packed):
    """``nn.Embedding`` whose table stays in its stored format; looked-up rows are dequantized.

    Example:
        >>> import gguf, numpy as np
        >>> raw = torch.from_numpy(gguf.quants.quantize(np.ones((10, 32), np.float32), gguf.GGMLQuantizationType.Q8_0))
        >>> QuantizedEmbedding(PackedWeight([(8, raw)], in_features=32))(torch.tensor([[1, 2]])).shape
        torch.Size([1, 2, 32])
    """

    def __init__(self, weight: PackedWeight):
        super().__init__(weight)
        if len(weight.segments) != 1:
            raise ValueError("an embedding table is stored in one format")
        self.num_embeddings, self.embedding_dim = weight.shape

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        format, data = self.formats[0], self._buffers[self._segment_names[0]]  # (no PackedWeight built per step)
        flat = ids.reshape(-1)
        if ids.device.type != "cpu":
            out = dequantize_on_device(format, data.index_select(0, flat), self.embedding_dim)
        else:  # one op: the rows (a tiled row with its tile), ids checked against the table
            out = torch.ops.kvgen.embedding(data, flat, self.embedding_dim, format)
        return out.reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, format={self.weight.format_name}"
