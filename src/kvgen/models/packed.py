"""Weights kept in their stored formats: :class:`PackedWeight` and the formats kvgen runs.

A packed weight is an (out_features, in_features) matrix stored as row segments, each a
(rows, row_bytes) uint8 tensor in one format: a GGUF block type (Q4_0 ... Q6_K, F16, BF16)
or one of kvgen's load-time formats (int8 rows with a scale each, int4 groups of 32/64/128).
Fused projections keep one segment per stored part (q, k and v; gate and up), read where the
file holds them (no copy), whatever their formats (Gemma 3's q/k in Q5_0, v in Q8_0); models
keep Q4_0, Q4_1, Q5_0, Q4_K and Q6_K in tiles of 16 rows instead (:func:`tile_rows`, a copy in another
order). ``kvgen.kernels`` multiplies and dequantizes them on the CPU; on other devices (GGUF rows, not tiles:
:func:`untile_rows`) :func:`dequantize_on_device` decodes them with torch operations, to the same values.
"""

from __future__ import annotations

import ctypes
import mmap
from dataclasses import dataclass
from pathlib import Path

import torch

from kvgen.kernels import integer_dot_formats, kernels_available

#: format id -> (name, values per block, bytes per block, extra bytes per row). GGML type ids, and
#: kvgen's own above 1000 (int8: a float32 scale after each row; int4: float32 scale and min per group)
FORMATS: dict[int, tuple[str, int, int, int]] = {
    1: ("F16", 32, 64, 0),
    2: ("Q4_0", 32, 18, 0),
    3: ("Q4_1", 32, 20, 0),
    6: ("Q5_0", 32, 22, 0),
    7: ("Q5_1", 32, 24, 0),
    8: ("Q8_0", 32, 34, 0),
    12: ("Q4_K", 256, 144, 0),
    13: ("Q5_K", 256, 176, 0),
    14: ("Q6_K", 256, 210, 0),
    30: ("BF16", 32, 64, 0),
    1008: ("int8", 32, 32, 4),
    1032: ("int4/g32", 32, 24, 0),
    1064: ("int4/g64", 64, 40, 0),
    1128: ("int4/g128", 128, 72, 0),
}

#: format in rows -> (bytes of its block head, bytes of each head field) for the formats :func:`tile_rows` tiles:
#: GGUF types (float16 d, then m, Q5_0's 32-bit mask or Q4_K's dmin; Q6_K none, its d comes last) and kvgen's int8
#: (no head: the 16 rows' scales follow the tile's blocks) and int4 (float32 scale and min per group)
TILED_HEADS: dict[int, tuple[int, int]] = {2: (2, 2), 3: (4, 2), 6: (6, 2), 8: (2, 2), 12: (4, 2), 14: (0, 2),
                                           1008: (0, 4), 1032: (8, 4), 1064: (8, 4), 1128: (8, 4)}
#: formats whose tiles the float32 product runs too; the others are tiled only where their integer dot products
#: run (:func:`~kvgen.kernels.integer_dot_formats`: with AVX-512, Q8_0's float32 product streams its rows as fast)
_FLOAT_TILES = (2, 3, 6, 12, 14)
#: tiled formats (2000 + the format in rows, the same bytes in another order) -> rows per tile
TILED: dict[int, int] = {2000 + t: 16 for t in TILED_HEADS}
FORMATS.update({2000 + t: FORMATS[t] for t in TILED_HEADS})


def row_bytes(format: int, in_features: int) -> int:
    """Bytes one row of ``in_features`` values takes in ``format``."""
    _, values, nbytes, extra = FORMATS[format]
    return in_features // values * nbytes + extra


def can_pack(format: int, in_features: int) -> bool:
    """Whether kvgen's kernels run ``format`` on rows of ``in_features`` values (whole blocks only)."""
    return format in FORMATS and in_features % FORMATS[format][1] == 0


@dataclass
class PackedWeight:
    """An (out_features, in_features) weight as row segments ``[(format, (rows, row_bytes) uint8), ...]``.

    Example:
        >>> import gguf, numpy as np
        >>> raw = gguf.quants.quantize(np.ones((4, 32), np.float32), gguf.GGMLQuantizationType.Q8_0)
        >>> w = PackedWeight([(8, torch.from_numpy(raw))], in_features=32)
        >>> w.shape, w.format_name
        ((4, 32), 'Q8_0')
    """

    segments: list[tuple[int, torch.Tensor]]
    in_features: int

    def __post_init__(self):
        for format, data in self.segments:
            if not can_pack(format, self.in_features):
                raise ValueError(f"format {FORMATS.get(format, (format,))[0]} cannot hold rows of "
                                 f"{self.in_features} values (whole blocks only)")
            if data.dtype != torch.uint8 or data.dim() != 2 or data.shape[1] != row_bytes(format, self.in_features):
                raise ValueError(f"a {FORMATS[format][0]} segment of rows of {self.in_features} values must be "
                                 f"(rows, {row_bytes(format, self.in_features)}) uint8, not {tuple(data.shape)} "
                                 f"{data.dtype}")

    @property
    def out_features(self) -> int:
        return sum(data.shape[0] for _, data in self.segments)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    @property
    def format_name(self) -> str:
        """``"Q4_1"``, or ``"Q5_0+Q8_0"`` for a weight of several formats."""
        return "+".join(dict.fromkeys(FORMATS[format][0] for format, _ in self.segments))

    @property
    def nbytes(self) -> int:
        return sum(data.numel() for _, data in self.segments)

    def dequantize(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 (out_features, in_features) matrix, exactly as gguf dequantizes it (into ``out``)."""
        from kvgen.kernels import unavailable_reason

        if self.segments[0][1].device.type != "cpu":
            parts = [dequantize_on_device(format, data, self.in_features) for format, data in self.segments]
            return torch.cat(parts, out=out) if out is not None else torch.cat(parts)
        if not kernels_available():
            raise RuntimeError(f"dequantizing a packed weight needs kvgen's kernels: {unavailable_reason()}")
        out = torch.empty(self.shape) if out is None else out
        start = 0
        for format, data in self.segments:
            torch.ops.kvgen.dequantize_(out[start:start + data.shape[0]], data, format)
            start += data.shape[0]
        return out

    def permute_rows(self, index: torch.Tensor) -> "PackedWeight":
        """Rows reordered by ``index`` (a permutation within a single-format weight, e.g. llama's Q/K)."""
        ((format, data),) = self.segments
        if format in TILED:
            raise ValueError("rows in tiles cannot be permuted one by one; permute before tile_rows")
        return PackedWeight([(format, data[index])], self.in_features)


def dequantize_on_device(format: int, data: torch.Tensor, in_features: int) -> torch.Tensor:
    """One segment as a float32 (rows, in_features) matrix on ``data``'s device, by torch operations.

    The CPU kernels' values, bit for bit: GGUF blocks as gguf-py's ``gguf.quants`` decodes them (``d * q`` or
    ``d * q + m``, float16 scales widened to float32; float32 products of small integers are exact), F16 and BF16
    widened, ``scale * q`` (int8), ``q * scale + min`` (int4). Segments in tiles of 16 rows (:func:`tile_rows`)
    raise: :func:`untile_rows` puts them back in rows (as ``module.to(device)`` does for packed layers).
    """
    if format not in FORMATS or format in TILED:  # (every format in rows decodes here)
        raise ValueError(f"{FORMATS[format][0]} rows in tiles of 16 (format {format}) decode on the CPU only, not on "
                         f"{data.device}; put them back in GGUF rows first (untile_rows(weight), which "
                         f"QuantizedLinear/QuantizedEmbedding.to(device) do), or keep the weight on the CPU")
    rows = data.shape[0]
    if format in (1, 30):
        return data.view(torch.float16 if format == 1 else torch.bfloat16).float()
    if format == 1008:
        q = data[:, :in_features].view(torch.int8)  # (rows, in)
        scale = data[:, in_features:].contiguous().view(torch.float32)  # (rows, 1)
        return q.float() * scale
    if format < 1000:  # GGUF blocks
        _, values, size, _ = FORMATS[format]
        blocks = data.view(rows, in_features // values, size)  # (rows, blocks, block bytes)
        decode = _q4_k_q5_k if format in (12, 13) else _q6_k if format == 14 else _legacy
        return decode(format, blocks).reshape(rows, in_features)
    group = format - 1000
    blocks = data.view(rows, in_features // group, 8 + group // 2)  # (rows, groups, 8 + G/2)
    scale_min = blocks[..., :8].contiguous().view(torch.float32)  # (rows, groups, 2)
    nibbles = blocks[..., 8:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=-1).float()  # (rows, groups, G)
    return (q * scale_min[..., :1] + scale_min[..., 1:]).view(rows, in_features)


def _f16(fields: torch.Tensor) -> torch.Tensor:
    """Little-endian float16 fields (..., 2k) uint8 as float32 (..., k)."""
    return fields.contiguous().view(torch.float16).float()


def _fields(data: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The ``count`` fields of ``bits`` bits in each byte, lowest first: (..., n) uint8 -> (..., count, n)."""
    shifts = torch.arange(0, bits * count, bits, dtype=torch.uint8, device=data.device).view(-1, 1)
    return (data.unsqueeze(-2) >> shifts) & ((1 << bits) - 1)


def _legacy(format: int, blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 blocks (rows, blocks, bytes) as float32 (rows, blocks, 32): float16 d
    (, float16 m) (, 32 fifth bits, little-endian), then 32 int8 values or 16 bytes of low / high nibbles."""
    d = _f16(blocks[..., :2])  # (rows, blocks, 1)
    if format == 8:
        return blocks[..., 2:].view(torch.int8).float() * d
    with_min, fifth = format in (3, 7), format in (6, 7)
    head = 4 if with_min else 2
    q = _fields(blocks[..., head + 4 * fifth:], 4, 2).flatten(-2)  # (rows, blocks, 32): value j, then j + 16
    if fifth:  # bit j of the mask: bit j % 8 of its byte j // 8
        q = q | _fields(blocks[..., head:head + 4], 1, 8).transpose(-1, -2).flatten(-2) << 4
    if with_min:
        return d * q.float() + _f16(blocks[..., 2:4])
    return d * (q.float() - (16 if fifth else 8))


def _q4_k_q5_k(format: int, blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K, Q5_K blocks (rows, blocks, 144 or 176 bytes) as float32 (rows, blocks, 8, 32), as gguf-py: float16
    d and dmin, 8 six-bit scales and mins in 12 bytes, (Q5_K: 32 bytes of fifth bits,) 128 bytes of nibbles."""
    d, dmin = _f16(blocks[..., :2]).unsqueeze(-1), _f16(blocks[..., 2:4]).unsqueeze(-1)  # (rows, blocks, 1, 1)
    s, m, sm = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]  # gguf's d, m and m_d bytes
    scale = torch.cat([s & 63, (sm & 15) | ((s >> 2) & 48)], dim=-1).unsqueeze(-1)  # (rows, blocks, 8, 1)
    low = torch.cat([m & 63, (sm >> 4) | ((m >> 2) & 48)], dim=-1).unsqueeze(-1)  # (rows, blocks, 8, 1)
    q = _fields(blocks[..., -128:].unflatten(-1, (4, 32)), 4, 2).flatten(-3, -2)  # (rows, blocks, 8, 32)
    if format == 13:
        q = q | _fields(blocks[..., 16:48], 1, 8) << 4  # bit i of byte j: value 32 i + j
    return (d * scale.float()) * q.float() - dmin * low.float()


def _q6_k(format: int, blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks (rows, blocks, 210 bytes) as float32 (rows, blocks, 16, 16), as gguf-py: 128 bytes of low
    nibbles, 64 bytes of 2-bit highs, 16 int8 scales (one per 16 values), float16 d last."""
    low = _fields(blocks[..., :128].unflatten(-1, (2, 64)), 4, 2).flatten(-3)  # (rows, blocks, 256)
    high = _fields(blocks[..., 128:192].unflatten(-1, (2, 32)), 2, 4).flatten(-3)  # (rows, blocks, 256)
    q = ((low | high << 4).float() - 32).unflatten(-1, (16, 16))  # (rows, blocks, 16, 16)
    scale = blocks[..., 192:208].view(torch.int8).float().unsqueeze(-1)  # (rows, blocks, 16, 1)
    return (_f16(blocks[..., 208:]).unsqueeze(-1) * scale) * q


def _tiles(format: int, data: torch.Tensor) -> bool:
    """Whether :func:`tile_rows` puts this segment in tiles (for the kernels: only where they run)."""
    return kernels_available() and format in TILED_HEADS and data.shape[0] % 16 == 0 and (
        format in _FLOAT_TILES or 2000 + format in integer_dot_formats())


def _tile_shape(format: int, data: torch.Tensor) -> tuple[int, int, int, int, int, int]:
    """A segment's tiles, blocks a row, bytes a block, head bytes a block, bytes a head field, extra bytes a row."""
    head, field = TILED_HEADS[format - 2000 if format in TILED else format]
    _, _, size, extra = FORMATS[format]
    return data.shape[0] // 16, (data.shape[1] - extra) // size, size, head, field, extra


def _quad_runs(format: int) -> tuple[int, int] | None:
    """The runs (byte j of a GGUF block: run j, 16 rows each) that a tile block of ``format`` stores 4 at a time in
    the order AVX2's integer products load them (the C++ ``quad_runs``), or None where they stay in row order."""
    runs = torch.ops.kvgen.tile_quads(format)
    return (runs[0], runs[1]) if runs else None


def _quad_source(o: int) -> int:
    """Byte ``o`` of 4 runs stored for AVX2 is byte ``16 * run + row`` of the runs in row order: 32 bytes of rows
    0-3 and 8-11, then 32 of rows 4-7 and 12-15, each row's 4 bytes from runs 0, 2, 1, 3 (simd.h's ``Quads``)."""
    half, lane = o // 32, o % 32 // 4
    return 16 * (0, 2, 1, 3)[o % 4] + 4 * half + lane % 4 + 8 * (lane // 4)


_QUAD_TARGET = torch.empty(64, dtype=torch.long)  # where byte 16 * run + row of 4 runs in row order is stored
_QUAD_TARGET[[_quad_source(o) for o in range(64)]] = torch.arange(64)


def tiled_sizes(weight: PackedWeight) -> list[int]:
    """The bytes of each segment that :func:`tile_rows` copies into tiles (for a :class:`WeightArena`)."""
    return [data.nbytes for format, data in weight.segments if _tiles(format, data)]


_TILING_CHUNK = 8 << 20  # bytes of a weight tiled (and its file pages released) at a time


def tile_rows(weight: PackedWeight, empty_like=torch.empty_like) -> PackedWeight:
    """``weight`` with its Q4_0, Q4_1, Q5_0, Q4_K and Q6_K segments (of a multiple of 16 rows) in tiles
    of 16 rows (format 2000 + the format in rows); Q8_0 and kvgen's int8 and int4 too where their tiles take
    integer dot products (:func:`~kvgen.kernels.integer_dot_formats`: 16 rows a lane each, as the 4-6-bit tiles).

    Per block of columns a tile holds the 16 rows' head fields (float16 d, then Q4_1's float16 m,
    Q5_0's 32-bit mask of 5th bits as two 2-byte fields or Q4_K's dmin; Q6_K and int8 have none; int4's
    float32 scale and min), then byte j of each row's remaining block bytes for every j, and after the last
    block the 16 rows' extra bytes (int8's float32 scales): the bytes of 16 rows in another
    order, so that a one-row product decodes 16 rows' values per instruction (1.3-1.8x faster). Where AVX2's
    integer products run, each 4 runs of a block's values (byte j of the 16 rows: run j) are stored in the order
    they load them (:func:`_quad_source`; ``torch.ops.kvgen.tile_quads`` names the runs). The values,
    ``dequantize`` and embedding lookups are unchanged. The tiles go where ``empty_like`` puts them
    (a :class:`~kvgen.models.weight_arena.WeightArena`'s); file-mapped sources are released as they are
    copied, 8 MB at a time (:func:`release_file_pages`): a load's peak holds the model once, not a large weight
    twice (Llama 3.1 8B's 411 MB output head).

    Example:
        >>> import gguf, numpy as np
        >>> raw = gguf.quants.quantize(np.random.randn(16, 64).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
        >>> w = PackedWeight([(3, torch.from_numpy(raw))], in_features=64)
        >>> tile_rows(w).format_name, torch.equal(tile_rows(w).dequantize(), w.dequantize())
        ('Q4_1', True)
    """
    segments, copied = [], []
    for format, data in weight.segments:
        if _tiles(format, data):
            out = empty_like(data)
            step = max(16, _TILING_CHUNK // data.shape[1] // 16 * 16)  # rows
            for r0 in range(0, data.shape[0], step):  # each chunk's source released once copied: no second copy
                torch.ops.kvgen.tile_rows_(out[r0:r0 + step], data[r0:r0 + step], 2000 + format)
                release_file_pages([data[r0:r0 + step]])
            copied.append(data)
            format, data = 2000 + format, out
        segments.append((format, data))
    release_file_pages(copied)
    return PackedWeight(segments, weight.in_features)


def untile_rows(weight: PackedWeight) -> PackedWeight:
    """``weight`` with its segments in tiles of 16 rows (:func:`tile_rows`) back in GGUF rows, on their device
    (torch operations: packed layers leaving the CPU take this layout, which :func:`dequantize_on_device` and row
    lookups read). Other segments are kept as they are (not copied).

    Example:
        >>> import gguf, numpy as np
        >>> raw = gguf.quants.quantize(np.random.randn(16, 64).astype(np.float32), gguf.GGMLQuantizationType.Q4_1)
        >>> torch.equal(untile_rows(tile_rows(PackedWeight([(3, torch.from_numpy(raw))], 64))).segments[0][1],
        ...             torch.from_numpy(raw))
        True
    """
    segments = []
    for format, data in weight.segments:
        if format in TILED:
            tiles, blocks, size, head, field, extra = _tile_shape(format, data)
            tile = data.view(tiles, -1)
            t = tile[:, :blocks * 16 * size].view(tiles, blocks, 16 * size)
            heads = t[..., :16 * head].unflatten(-1, (head // field, 16, field)).transpose(-3, -2)  # (.., 16, n, field)
            values = t[..., 16 * head:]  # (tiles, blocks, 16 * (size - head)): run j - head holds byte j of 16 rows
            quads = _quad_runs(format)
            if quads:  # those runs back in row order
                lo, hi = 16 * (quads[0] - head), 16 * (quads[1] - head)
                stored = values[..., lo:hi].unflatten(-1, (-1, 64))  # (tiles, blocks, chunks, 64)
                values = torch.cat([values[..., :lo], stored[..., _QUAD_TARGET].flatten(-2), values[..., hi:]], -1)
            values = values.unflatten(-1, (size - head, 16)).transpose(-1, -2)  # (.., 16 rows, bytes)
            block = torch.cat([heads.flatten(-2), values], dim=-1)  # (tiles, blocks, 16 rows, size)
            extras = tile[:, blocks * 16 * size:].view(tiles, 16, extra)
            rows = torch.cat([block.transpose(1, 2).flatten(2), extras], dim=-1)  # (tiles, 16 rows, row bytes)
            format, data = format - 2000, rows.reshape(data.shape)
        segments.append((format, data))
    return PackedWeight(segments, weight.in_features)


def stored_positions(format: int, data: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Where byte ``positions`` of a segment in rows (GGUF order, flattened) lie in ``data`` as stored:
    the same positions, except in tiles of 16 rows (:func:`tile_rows`). So that a fingerprint of the
    weight samples the same bytes whichever layout this machine chose."""
    if format not in TILED:
        return positions
    _, blocks, size, head, field, extra = _tile_shape(format, data)
    row, column = positions // data.shape[1], positions % data.shape[1]
    block, at = column // size, column % size
    tile, lane = row // 16 * 16 * data.shape[1], row % 16  # the tile's first byte, the row's lane
    in_head = 16 * field * (at // field) + field * lane + at % field  # the 16 rows' head fields, one after the other
    in_values = 16 * at + lane  # byte j of the 16 rows' other bytes
    quads = _quad_runs(format)
    if quads:  # 4 runs at a time in AVX2's order
        run = at - quads[0]
        in_quads = 16 * quads[0] + 64 * (run // 4) + _QUAD_TARGET[16 * (run % 4) + lane]
        in_values = torch.where((at >= quads[0]) & (at < quads[1]), in_quads, in_values)
    in_blocks = block * 16 * size + torch.where(at < head, in_head, in_values)
    in_extra = blocks * 16 * size + extra * lane + column - blocks * size  # after the blocks: the rows' extra bytes
    return tile + torch.where(column < blocks * size, in_blocks, in_extra)


def cat_rows(parts: list) -> torch.Tensor | PackedWeight:
    """Stack the rows of tensors (``torch.cat``) or of packed weights (their segments, not copied)."""
    if not any(isinstance(p, PackedWeight) for p in parts):
        return torch.cat(parts, dim=0)
    if not all(isinstance(p, PackedWeight) for p in parts) or len({p.in_features for p in parts}) != 1:
        raise ValueError("cannot fuse packed weights with float ones or with other input sizes; "
                         "load with dtype=torch.float32 to dequantize them all")
    return PackedWeight([segment for part in parts for segment in part.segments], parts[0].in_features)


_file_mappings: list[tuple[int, int]] = []  # (start, end) of this process's file-backed mappings, as last read


def _in_file_mapping(lo: int, hi: int) -> bool:
    """Whether bytes lo..hi lie in one file-backed mapping (``/proc/self/maps``, read again on a miss)."""
    for fresh in (False, True):
        if fresh:
            try:
                maps = Path("/proc/self/maps").read_text().splitlines()
            except OSError:
                return False
            _file_mappings[:] = [tuple(int(a, 16) for a in f[0].split("-")) for f in map(str.split, maps)
                                 if len(f) >= 6 and f[4] != "0" and f[5].startswith("/")]
        if any(start <= lo and hi <= end for start, end in _file_mappings):
            return True
    return False


def release_file_pages(tensors: list[torch.Tensor]) -> None:
    """Drop the pages of file-mapped ``tensors`` from this process (``madvise(MADV_DONTNEED)``, Linux).

    For sources that a copy replaced (:func:`tile_rows` of a GGUF's mapped weights): reading them
    made their pages resident, and they would stay counted in this process's memory while the file
    stays mapped. The file keeps its bytes (a later read faults them in again). Tensors outside
    file mappings (anonymous memory, whose pages this would zero) are left alone; memory torch
    allocated itself (a resizable storage) is never looked up.
    """
    tensors = [t for t in tensors if not t.untyped_storage().resizable()]
    if not tensors:
        return
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    for t in tensors:
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        if _in_file_mapping(lo, hi):
            first, last = -(-lo // mmap.PAGESIZE) * mmap.PAGESIZE, hi // mmap.PAGESIZE * mmap.PAGESIZE  # whole pages only
            if last > first:
                madvise(first, last - first, 4)  # MADV_DONTNEED
