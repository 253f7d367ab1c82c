"""Quantized storage for :class:`~kvgen.cache.quantized.QuantizedLayer`, one class per backend.

A *store* holds the quantized tokens of one tensor (the keys or the values) of one layer,
oldest first, always a whole number of blocks. It is appended to in blocks of
:attr:`block_tokens` tokens, dequantizes everything it holds into a caller's buffer, and
supports the cache's editing operations (crop, batch reordering, repetition).

* :class:`KiviStore` is kvgen's own backend, in plain PyTorch, following the KIVI paper
  (Liu et al., 2024): keys are quantized per channel (each group spans ``q_group_size``
  tokens of one channel), values per token (each group spans ``q_group_size`` channels of
  one token), asymmetric min/max with float16 scales and zero points, and the codes of a
  block are packed along the token axis into ``uint8`` (two 4-bit or four 2-bit codes per
  byte), so that unpacking is a few wide integer operations over contiguous memory.
* :class:`LibraryStore` wraps optimum-quanto or HQQ: one library call per block, the
  library's own grouping (``axis``), exact batch reordering through a row map.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvgen.cache.base import map_nested
from kvgen.cache.codec import register_persistable, register_policy

#: workspace request: (name, shape, dtype, device) -> a scratch tensor of that shape
Scratch = Callable[[str, tuple, torch.dtype, torch.device], torch.Tensor]

_MASKS = {2: 0x03, 4: 0x0F, 8: 0xFF}


def scale_dtype(dtype: torch.dtype) -> torch.dtype:
    """Scales and zero points are 16-bit: bfloat16 for bfloat16 tensors (same range), float16 otherwise."""
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


def _wide_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (uint8, last dim contiguous) viewed with the widest integer type its rows allow."""
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if t.shape[-1] % size == 0 and all(s % size == 0 for s in t.stride()[:-1]) and \
                t.storage_offset() % size == 0:
            return t.view(dtype)
    return t


def _repeated_mask(nbits: int, dtype: torch.dtype) -> int:
    """The ``nbits`` low-bit mask repeated in every byte of an integer of ``dtype``."""
    width = {torch.int64: 8, torch.int32: 4, torch.int16: 2, torch.uint8: 1}[dtype]
    return int.from_bytes(bytes([_MASKS[nbits]]) * width, "little")


def pack(codes: torch.Tensor, nbits: int) -> torch.Tensor:
    """Pack codes (..., 8 // nbits, m) uint8 into (..., m) bytes: slot p goes to bits [p * nbits, (p + 1) * nbits)."""
    per_byte = 8 // nbits
    if per_byte == 1:
        return codes[..., 0, :].contiguous()
    packed = codes[..., 0, :].clone()
    for p in range(1, per_byte):
        packed |= codes[..., p, :] << (nbits * p)
    return packed


def unpack(packed: torch.Tensor, nbits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse of :func:`pack`: (..., m) bytes -> (..., 8 // nbits, m) codes, written to ``out`` when given."""
    if out is None:
        out = packed.new_empty(*packed.shape[:-1], 8 // nbits, packed.shape[-1])
    unpacker(packed, out, nbits)()
    return out


def unpacker(packed: torch.Tensor, out: torch.Tensor, nbits: int) -> Callable[[], None]:
    """A function that unpacks ``packed`` (..., m) into ``out`` (..., 8 // nbits, m), views prepared once.

    Works on wide integer views (8 bytes at a time); ``>>`` on a signed type drags sign bits
    into the top byte, but only into bits that the per-byte mask removes.
    """
    if nbits == 8:
        return lambda: out[..., 0, :].copy_(packed)
    src, dst = _wide_view(packed), _wide_view(out)
    if src.dtype != dst.dtype:  # odd sizes: stay with bytes
        src, dst = packed, out
    mask = _repeated_mask(nbits, src.dtype)
    slots = [(p * nbits, dst[..., p, :]) for p in range(8 // nbits)]

    def run() -> None:
        for shift, slot in slots:
            if shift == 0:
                torch.bitwise_and(src, mask, out=slot)
            else:
                torch.bitwise_right_shift(src, shift, out=slot)
                slot.bitwise_and_(mask)

    return run


#: (low cut, high cut) pairs tried for 2-bit keys: fractions of each slice's range cut off at the bottom
#: and the top (see :func:`minmax_quantize`); (0, 0) is plain min/max, so the search never does worse
KEY_RANGE_CUTS = tuple((a / 20, b / 20) for a in range(7) for b in range(7))


def minmax_quantize(x: torch.Tensor, dim: int, nbits: int, sdtype: torch.dtype,
                    range_cuts: tuple[tuple[float, float], ...] = ((0.0, 0.0),)
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of ``x`` with one scale and zero point per slice along ``dim``.

    Returns ``(codes uint8 like x, scale, zero)`` with ``scale``/``zero`` reduced over ``dim``
    (kept as size 1) in ``sdtype``; ``x ~= codes * scale + zero``. Codes are computed with the
    rounded 16-bit scale and zero point, so dequantization sees exactly what was quantized.
    With several ``range_cuts`` ``(a, b)``, each slice's range ``[lo, hi]`` is narrowed to
    ``[lo + a (hi - lo), hi - b (hi - lo)]`` for every pair and the pair with the least squared
    error is kept per slice (outliers clip, the rest get finer steps).
    """
    qmax = (1 << nbits) - 1
    x = x.float()
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    if len(range_cuts) > 1:
        lo, hi = _search_range(x.movedim(dim, -1).contiguous(), lo.movedim(dim, -1), hi.movedim(dim, -1),
                               range_cuts, qmax, sdtype)
        lo, hi = lo.movedim(-1, dim), hi.movedim(-1, dim)
    scale, zero = ((hi - lo) / qmax).to(sdtype), lo.to(sdtype)
    s = scale.float()
    inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))  # constant slice: every code 0, value = zero
    codes = ((x - zero.float()) * inv).round_().clamp_(0, qmax)
    return codes.to(torch.uint8), scale, zero


#: floats of scratch per pass of :func:`_search_range` (4 MB: its passes stay in L2/L3)
_SEARCH_SCRATCH = 1 << 20


def _search_range(x, lo, hi, range_cuts, qmax, sdtype):
    """The ``(low, high)`` of least squared error per slice among ``range_cuts``; slices along the last dim of ``x``.

    The error of a candidate is ``scale**2 * sum((codes - t)**2)`` with ``t = (x - zero) / scale``. Every
    candidate is weighed on a few slices at a time, ``_SEARCH_SCRATCH`` floats per pass, so the passes run from the
    cache (a model's weights at load, a prefill's keys): one pass per candidate over a whole tensor ran 2-3x slower.
    """
    n = x.shape[-1]
    xs, los, his = x.reshape(-1, n), lo.reshape(-1, 1), hi.reshape(-1, 1)  # (S, n), (S, 1), (S, 1)
    cuts = torch.tensor(range_cuts, dtype=torch.float32, device=x.device)  # (C, 2)
    a, b = cuts[:, :1, None], cuts[:, 1:, None]  # (C, 1, 1)
    best_lo, best_hi = torch.empty_like(los), torch.empty_like(his)  # (S, 1)
    rows = max(1, _SEARCH_SCRATCH // (n * len(range_cuts)))
    for r in range(0, xs.shape[0], rows):
        l, h = los[r:r + rows], his[r:r + rows]  # (R, 1)
        span = h - l
        low, high = l + a * span, h - b * span  # (C, R, 1)
        s, z = ((high - low) / qmax).to(sdtype).float(), low.to(sdtype).float()
        t = (xs[r:r + rows] - z).mul_(torch.where(s > 0, 1.0 / s, torch.zeros_like(s)))  # (C, R, n)
        codes = t.round().clamp_(0, qmax).sub_(t)
        error = torch.linalg.vecdot(codes, codes)[..., None] * s.square()  # (C, R, 1)
        pick = error.argmin(0, keepdim=True)  # (1, R, 1)
        best_lo[r:r + rows], best_hi[r:r + rows] = low.gather(0, pick)[0], high.gather(0, pick)[0]
    return best_lo.view_as(lo), best_hi.view_as(hi)


def _grow(t: torch.Tensor | None, dim: int, needed: int, unit: int) -> torch.Tensor:
    """``t`` with at least ``needed`` entries along ``dim``: grows by max(unit, 1/8) to bound slack and copies."""
    have = t.shape[dim]
    if needed <= have:
        return t
    new = max(needed, have + max(unit, have // 8))
    shape = list(t.shape)
    shape[dim] = new
    bigger = t.new_empty(shape)
    bigger.narrow(dim, 0, have).copy_(t)
    return bigger


class KiviStore:
    """KIVI storage of keys (``per_channel=True``) or values (``per_channel=False``).

    Blocks of ``group`` tokens. Per (batch, head), block ``b`` stores
    ``codes[b]``: (group // per_byte * D) bytes, byte ``(j, d)`` holding the codes of tokens
    ``j + p * group // per_byte`` (p = 0..per_byte-1) of channel ``d``; keys have one scale and
    zero point per (block, channel), values one per (token, channel group of ``value_group``).
    """

    #: capacity grows in steps of at least this many tokens (bounds the unused slack)
    GROW_TOKENS = 256

    def __init__(self, nbits: int, group: int, per_channel: bool):
        self.nbits, self.group, self.per_channel = nbits, group, per_channel
        self.per_byte = 8 // nbits
        self.block_tokens = group
        self.reset()

    def reset(self) -> None:
        self.blocks = 0
        self.codes: torch.Tensor | None = None  # (B, H, capacity_blocks, group // per_byte * D) uint8
        self.scale: torch.Tensor | None = None  # keys (B, H, cap_blocks, D); values (B, H, cap_tokens, D // vg)
        self.zero: torch.Tensor | None = None
        self.value_group = 0

    @property
    def length(self) -> int:
        return self.blocks * self.group

    # -- quantize ----------------------------------------------------------------------------------
    def append(self, x: torch.Tensor) -> None:
        """Quantize and store ``x`` (B, H, n, D), ``n`` a multiple of ``group``."""
        b, h, n, d = x.shape
        g, k = self.group, n // self.group
        if n % g:
            raise ValueError(f"KiviStore.append takes whole blocks of {g} tokens, got {n}")
        sdtype = scale_dtype(x.dtype)
        if self.per_channel:
            # 2-bit keys: per-channel ranges searched for the least error (values keep min/max: clipping
            # their outliers costs more than it saves, measured on SmolLM2 + KJV)
            cuts = KEY_RANGE_CUTS if self.nbits == 2 else ((0.0, 0.0),)
            codes, scale, zero = minmax_quantize(x.reshape(b, h, k, g, d), 3, self.nbits, sdtype, cuts)
            scale, zero = scale.squeeze(3), zero.squeeze(3)  # (B, H, k, D)
            self._ensure(b, h, d, k, sdtype, x.device, scale_rows=k, scale_cols=d)
            rows = slice(self.blocks, self.blocks + k)
        else:
            vg = self.value_group or min(g, d)
            if d % vg:
                raise ValueError(
                    f"the kivi backend quantizes values in groups of q_group_size={self.group} channels, which "
                    f"must divide head_dim={d}; choose a q_group_size that divides {d}"
                )
            self.value_group = vg
            codes, scale, zero = minmax_quantize(x.reshape(b, h, n, d // vg, vg), 4, self.nbits, sdtype)
            scale, zero = scale.squeeze(4), zero.squeeze(4)  # (B, H, n, D // vg)
            self._ensure(b, h, d, k, sdtype, x.device, scale_rows=n, scale_cols=d // vg)
            rows = slice(self.length, self.length + n)
        # (B, H, k, group, D) -> (B, H, k, per_byte, group // per_byte * D): slot p = tokens p*group/per_byte...
        codes = codes.reshape(b, h, k, self.per_byte, g // self.per_byte * d)
        self.codes[:, :, self.blocks:self.blocks + k] = pack(codes, self.nbits)
        self.scale[:, :, rows] = scale
        self.zero[:, :, rows] = zero
        self.blocks += k

    def _ensure(self, b, h, d, k, sdtype, device, scale_rows, scale_cols) -> None:
        row_bytes = self.group // self.per_byte * d
        if self.codes is None:
            self.codes = torch.empty(b, h, k, row_bytes, dtype=torch.uint8, device=device)
            self.scale = torch.empty(b, h, scale_rows, scale_cols, dtype=sdtype, device=device)
            self.zero = torch.empty_like(self.scale)
            return
        if self.codes.shape[:2] != (b, h) or self.codes.shape[3] != row_bytes:
            raise ValueError(
                f"new keys/values have batch {b}, {h} heads and head_dim {d} but the quantized cache holds batch "
                f"{self.codes.shape[0]}, {self.codes.shape[1]} heads; use one cache per batch shape"
            )
        unit = max(1, self.GROW_TOKENS // self.group)
        self.codes = _grow(self.codes, 2, self.blocks + k, unit)
        scale_unit = unit if self.per_channel else unit * self.group
        needed = (self.blocks + k) * (1 if self.per_channel else self.group)
        self.scale = _grow(self.scale, 2, needed, scale_unit)
        self.zero = _grow(self.zero, 2, needed, scale_unit)

    # -- dequantize --------------------------------------------------------------------------------
    def dequantize_into(self, out: torch.Tensor, scratch: Scratch | None = None) -> None:
        """Write the dequantized tokens into ``out`` (B, H, length, D), any float dtype, last dim contiguous."""
        self.dequantizer(out, scratch)()

    def dequantizer(self, out: torch.Tensor, scratch: Scratch | None = None) -> Callable[[], None]:
        """A function that writes the dequantized tokens into ``out``, with every view prepared once.

        Valid until the store changes (append, crop, batch operations): a decode step only
        runs the arithmetic (3-5 wide integer ops, one conversion, one or two float ops).
        """
        k = self.blocks
        if k == 0:
            return lambda: None
        b, h, n, d = out.shape
        packed = self.codes[:, :, :k]  # (B, H, k, row_bytes)
        unpack_codes = None
        if self.per_byte == 1:
            codes = packed
        else:
            shape = (b, h, k, self.per_byte, packed.shape[-1])
            codes = scratch("codes", shape, torch.uint8, out.device) if scratch else packed.new_empty(shape)
            unpack_codes = unpacker(packed, codes, self.nbits)  # slot p: tokens p * group / per_byte ...
        as_tokens = codes.view(b, h, n, d)  # unpacked codes in token order
        if self.per_channel:
            o = out.view(b, h, k, self.group, d)
            scale, zero = self.scale[:, :, :k, None], self.zero[:, :, :k, None]  # (B, H, k, 1, D)
        else:
            vg = self.value_group
            o = out.view(b, h, n, d // vg, vg)
            scale, zero = self.scale[:, :, :n, :, None], self.zero[:, :, :n, :, None]  # (B, H, n, D // vg, 1)
        per_channel, dtype = self.per_channel, out.dtype

        def run() -> None:
            if unpack_codes is not None:
                unpack_codes()
            out.copy_(as_tokens)  # uint8 -> float
            if per_channel:  # one fused pass; a scale broadcast along the last dim is faster as mul + add
                torch.addcmul(zero.to(dtype), o, scale.to(dtype), out=o)
            else:
                o.mul_(scale.to(dtype)).add_(zero.to(dtype))

        return run

    # -- editing -----------------------------------------------------------------------------------
    def crop(self, n: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Keep the first ``n`` tokens; return the dequantized ones past the last whole block (B, H, r, D)."""
        if n >= self.length:
            return None
        keep = n // self.group
        tail = None
        if n % self.group:
            b, h = self.codes.shape[:2]
            full = torch.empty(b, h, self.length, self._dim(), dtype=dtype, device=self.codes.device)
            self.dequantize_into(full)
            tail = full[:, :, keep * self.group:n].clone()
        self.blocks = keep
        return tail

    def _dim(self) -> int:
        return self.codes.shape[3] * self.per_byte // self.group

    def batch_select(self, indices: torch.Tensor) -> None:
        if self.codes is not None:
            indices = indices.to(self.codes.device)
            self.codes, self.scale, self.zero = (t.index_select(0, indices) for t in (self.codes, self.scale,
                                                                                     self.zero))

    def batch_repeat(self, repeats: int) -> None:
        if self.codes is not None:
            self.codes, self.scale, self.zero = (t.repeat_interleave(repeats, dim=0) for t in (self.codes,
                                                                                              self.scale, self.zero))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero) if t is not None)

    def map_tensors(self, fn) -> None:
        """Replace codes, scales and zero points by ``fn(tensor)`` (offloading moves the store with it)."""
        if self.codes is not None:
            self.codes, self.scale, self.zero = fn(self.codes), fn(self.scale), fn(self.zero)


# -- optional libraries ----------------------------------------------------------------------------
def _missing(backend: str, package: str, extra: str, error: ImportError) -> ImportError:
    found = "" if error.name and error.name.split(".")[0] in (package, package.split("-")[0]) \
        else f" (it is installed, but importing it failed: {error})"
    return ImportError(
        f"the {backend!r} backend of QuantizedCache needs the {package} package{found}: pip install {package} "
        f"(or pip install 'kvgen[{extra}]'); kvgen's own backend needs nothing extra: backend='kivi'"
    )


class QuantoBackend:
    """optimum-quanto's group-wise quantizer (what transformers' ``QuantoQuantizedCache`` uses)."""

    name = "quanto"

    def __init__(self, nbits: int, group: int):
        try:
            from optimum.quanto import MaxOptimizer, qint2, qint4
        except ImportError as error:
            raise _missing("quanto", "optimum-quanto", "quanto", error) from error
        self.qtype = qint4 if nbits == 4 else qint2
        self.optimizer = MaxOptimizer()
        self.group = group

    def quantize(self, x: torch.Tensor, axis: int):
        from optimum.quanto import quantize_weight

        x = x.contiguous()
        scale, shift = self.optimizer(x, self.qtype, axis, self.group)
        return quantize_weight(x, self.qtype, axis, scale, shift, self.group)

    def dequantize(self, q) -> torch.Tensor:
        return q.dequantize()

    def copy(self, q):
        return _clone_subclass(q)

    def nbytes(self, q) -> int:
        return _subclass_nbytes(q)


def _clone_subclass(t: torch.Tensor) -> torch.Tensor:
    """Deep copy of a tensor subclass that flattens into inner tensors (quanto's QTensors can't be deep-copied)."""
    if type(t) is torch.Tensor:
        return t.clone()
    names, meta = t.__tensor_flatten__()
    return type(t).__tensor_unflatten__({n: _clone_subclass(getattr(t, n)) for n in names}, meta, t.size(),
                                        t.stride())


def _subclass_nbytes(t: torch.Tensor) -> int:
    if type(t) is torch.Tensor:
        return t.numel() * t.element_size()
    names, _ = t.__tensor_flatten__()
    return sum(_subclass_nbytes(getattr(t, n)) for n in names)


class HQQBackend:
    """HQQ's half-quadratic quantizer (what transformers' ``HQQQuantizedCache`` uses)."""

    name = "hqq"

    def __init__(self, nbits: int, group: int):
        try:
            from hqq.core.quantize import Quantizer
        except ImportError as error:
            raise _missing("hqq", "hqq", "hqq", error) from error
        self.quantizer, self.nbits, self.group = Quantizer, nbits, group

    def quantize(self, x: torch.Tensor, axis: int):
        return self.quantizer.quantize(x.contiguous(), axis=axis, device=x.device, compute_dtype=x.dtype,
                                       nbits=self.nbits, group_size=self.group)

    def dequantize(self, q) -> torch.Tensor:
        return self.quantizer.dequantize(*q)

    def copy(self, q):
        data, meta = q
        return data.clone(), {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in meta.items()}

    def nbytes(self, q) -> int:
        data, meta = q
        return sum(t.numel() * t.element_size() for t in [data, *meta.values()] if isinstance(t, torch.Tensor))


class LibraryStore:
    """Blocks quantized by an external library, one library call per block.

    Batch reordering is exact and lazy: each block keeps a row map applied after
    dequantization, so no block is ever re-quantized (the reference skipped reordering
    its quantized part instead).
    """

    def __init__(self, backend, axis: int, block_tokens: int):
        self.backend, self.axis, self.block_tokens = backend, axis, block_tokens
        self.reset()

    def reset(self) -> None:
        self.blocks: list[list] = []  # [quantized, n_tokens, rows (LongTensor) or None]
        self.length = 0

    def append(self, x: torch.Tensor) -> None:
        """Quantize ``x`` (B, H, n, D) in blocks of ``block_tokens`` (so a crop returns less than a block)."""
        for start in range(0, x.shape[2], self.block_tokens):
            part = x[:, :, start:start + self.block_tokens]
            self.blocks.append([self.backend.quantize(part, self.axis), part.shape[2], None])
            self.length += part.shape[2]

    def _block(self, entry) -> torch.Tensor:
        q, _, rows = entry
        x = self.backend.dequantize(q)  # (B_stored, H, n, D)
        return x if rows is None else x.index_select(0, rows.to(x.device))

    def dequantize_into(self, out: torch.Tensor, scratch: Scratch | None = None) -> None:
        start = 0
        for entry in self.blocks:
            out[:, :, start:start + entry[1]] = self._block(entry)
            start += entry[1]

    def dequantizer(self, out: torch.Tensor, scratch: Scratch | None = None) -> Callable[[], None]:
        return lambda: self.dequantize_into(out, scratch)

    def crop(self, n: int, dtype: torch.dtype) -> torch.Tensor | None:
        if n >= self.length:
            return None
        kept, start, tail = [], 0, None
        for entry in self.blocks:
            if start + entry[1] <= n:
                kept.append(entry)
            elif start < n:
                tail = self._block(entry)[:, :, :n - start].to(dtype).clone()
            start += entry[1]
        self.blocks = kept
        self.length = sum(e[1] for e in kept)
        return tail

    def batch_select(self, indices: torch.Tensor) -> None:
        for entry in self.blocks:
            entry[2] = indices.clone() if entry[2] is None else entry[2].index_select(0, indices.to(entry[2].device))

    def batch_repeat(self, repeats: int) -> None:
        for entry in self.blocks:
            rows = entry[2] if entry[2] is not None else torch.arange(self._stored_batch(entry[0]))
            entry[2] = rows.repeat_interleave(repeats)

    @staticmethod
    def _stored_batch(q) -> int:
        shape = q.shape if isinstance(q, torch.Tensor) else q[1]["shape"]  # quanto QTensor / HQQ (data, meta)
        return shape[0]

    def nbytes(self) -> int:
        return sum(self.backend.nbytes(q) + (0 if rows is None else rows.numel() * rows.element_size())
                   for q, _, rows in self.blocks)

    def map_tensors(self, fn) -> None:
        """Replace every tensor of the stored blocks (quantized data, metadata, row maps) by ``fn(tensor)``."""
        for entry in self.blocks:
            entry[0] = map_nested(entry[0], fn)
            if entry[2] is not None:
                entry[2] = fn(entry[2])

    def __deepcopy__(self, memo):
        new = LibraryStore(self.backend, self.axis, self.block_tokens)
        new.blocks = [[self.backend.copy(q), n, None if rows is None else rows.clone()]
                      for q, n, rows in self.blocks]
        new.length = self.length
        return new


# what cache files keep of these (kvgen.cache.codec): the library backends as their constructor arguments
for _helper in (HQQBackend, KiviStore, LibraryStore, QuantoBackend):
    register_persistable(_helper)
register_policy(QuantoBackend, constructed=lambda b: [b.qtype.bits, b.group])
register_policy(HQQBackend, constructed=lambda b: [b.nbits, b.group])
