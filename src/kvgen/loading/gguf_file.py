"""A GGUF file's header, read with every count, length, type and offset checked against the file.

A model file is input from strangers. As llama.cpp's loader does (``gguf_init_from_file``),
:func:`read_gguf_header` refuses, with a :class:`ModelFileError` naming the key or tensor:
a wrong magic or version; counts, strings and arrays running past the end of the file;
unknown value or tensor types; more than 4 dimensions; duplicate keys or tensor names; a
``general.alignment`` that is not a power of two; and tensor data that is misaligned, not
packed in the order of the tensor table (an overlap or a gap means a damaged type or
offset), or past the end of the file. :func:`check_block_scales` then finds the tensors
whose bytes do not decode as their type (a changed type of the same byte count).

Example:
    >>> header = read_gguf_header(Path("SmolLM2-135M-Instruct.Q4_1.gguf"))  # doctest: +SKIP
    >>> header.metadata["general.architecture"], header.tensors[0].name  # doctest: +SKIP
    ('llama', 'token_embd.weight')
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as Q

from kvgen.loading.errors import ModelFileError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8",
                 12: "<f8"}
_FLOAT32 = 6
#: ``tokenizer.ggml.<key>`` special token ids -> their config names
TOKEN_ID_KEYS = {"bos_token_id": "bos_token_id", "eos_token_id": "eos_token_id", "padding_token_id": "pad_token_id",
                 "unknown_token_id": "unk_token_id"}


@dataclass
class TensorInfo:
    """One entry of the tensor table: ``shape`` innermost first (as GGUF lists it), ``offset`` in the file."""

    name: str
    type: Q
    shape: list[int]
    offset: int
    nbytes: int


@dataclass
class GGUFHeader:
    """Everything before the tensor data: version, metadata (plain Python values) and tensor table."""

    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]
    alignment: int
    data_start: int


class _Cursor:
    """Reads little-endian values from ``buf``, each bounded by the file's end."""

    def __init__(self, buf: mmap.mmap, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def error(self, where: str, expected: str, found: str) -> ModelFileError:
        return ModelFileError(self.path, where, expected, found)

    def need(self, count: int, where: str) -> None:
        if count > len(self.buf) - self.pos:
            raise self.error(where, f"{count} bytes at offset {self.pos}",
                             f"the file ends at byte {len(self.buf)} (truncated, or a damaged length)")

    def scalar(self, fmt: str, where: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, where)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self, where: str) -> str:
        length = self.scalar("<Q", where)
        self.need(length, f"{where} (a string of {length} bytes)")
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.error(where, "UTF-8 text", f"invalid bytes ({e.reason} at {e.start})") from None

    def value(self, type_id: int, where: str) -> Any:
        if type_id == _STRING:
            return self.string(where)
        if type_id == _ARRAY:
            return self.array(where)
        if type_id not in _SCALARS:
            raise self.error(where, "a GGUF value type 0-12", f"type {type_id}")
        value = self.scalar(_SCALARS[type_id], where)
        return float(str(np.float32(value))) if type_id == _FLOAT32 else value  # 1e-05, not 9.99...e-06

    def array(self, where: str) -> list[Any]:
        type_id, count = self.scalar("<I", where), self.scalar("<Q", where)
        if type_id in _ARRAY_DTYPES:
            dtype = np.dtype(_ARRAY_DTYPES[type_id])
            self.need(count * dtype.itemsize, f"{where} (an array of {count} values)")
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos += count * dtype.itemsize
            return values
        if type_id not in (_STRING, _ARRAY):
            raise self.error(where, "a GGUF array element type 0-12", f"type {type_id}")
        self.need(count * 8, f"{where} (an array of {count} values)")  # each takes 8 bytes at least
        if type_id == _ARRAY:
            return [self.array(f"{where}[{i}]") for i in range(count)]
        buf, pos, end, strings = self.buf, self.pos, len(self.buf), []
        for i in range(count):  # the vocabulary: 49k-262k strings, so no method call per string
            (length,) = struct.unpack_from("<Q", buf, pos) if pos + 8 <= end else (end,)
            if pos + 8 + length > end:
                self.pos = pos
                self.need(8 + length, f"{where}[{i}]")
            strings.append(buf[pos + 8:pos + 8 + length])
            pos += 8 + length
        self.pos = pos
        try:
            return [s.decode("utf-8") for s in strings]
        except UnicodeDecodeError:
            bad = next(i for i, s in enumerate(strings) if not _is_utf8(s))
            raise self.error(f"{where}[{bad}]", "UTF-8 text", f"invalid bytes {strings[bad][:16]!r}") from None


def _is_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _tensor_info(cursor: _Cursor, index: int) -> TensorInfo:
    name = cursor.string(f"tensor {index}'s name")
    where = f"tensor {name}"
    dims = cursor.scalar("<I", where)
    if not 1 <= dims <= MAX_DIMS:
        raise cursor.error(where, f"1 to {MAX_DIMS} dimensions", f"{dims}")
    shape = [cursor.scalar("<Q", where) for _ in range(dims)]
    if min(shape) < 1 or int(np.prod(shape, dtype=object)) >= 2**62:
        raise cursor.error(where, "dimensions of at least 1 and fewer than 2^62 values", f"shape {shape}")
    type_id = cursor.scalar("<I", where)
    try:
        qtype = Q(type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise cursor.error(where, "a known GGML tensor type (F32, F16, BF16, Q4_0, Q8_0, Q4_K, ...)",
                           f"type id {type_id}") from None
    if shape[0] % block:
        raise cursor.error(where, f"a first dimension that is a multiple of {qtype.name}'s {block}-value blocks",
                           f"shape {shape}")
    offset = cursor.scalar("<Q", where)
    return TensorInfo(name, qtype, shape, offset, int(np.prod(shape, dtype=object)) // block * type_size)


def read_gguf_header(path: Path) -> GGUFHeader:
    """Parse and check a GGUF file's header and tensor table (no tensor data is read).

    Offsets in the result are absolute; a :class:`ModelFileError` names what does not hold.
    """
    with open(path, "rb") as f:
        if path.stat().st_size == 0:
            raise ModelFileError(path, "the file", "a GGUF file", "an empty file")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with buf:
        cursor = _Cursor(buf, path)
        cursor.need(4, "the magic")
        magic = bytes(buf[:4])
        if magic != MAGIC:
            raise cursor.error("the magic", f"{MAGIC!r} (a GGUF file)", f"{magic!r}")
        cursor.pos = 4
        version = cursor.scalar("<I", "the version")
        if version not in VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            found = f"version {version}" + (" (a big-endian file)" if swapped in VERSIONS else "")
            raise cursor.error("the version", f"GGUF version {' or '.join(map(str, VERSIONS))}", found)
        tensor_count, kv_count = cursor.scalar("<Q", "the tensor count"), cursor.scalar("<Q", "the key count")
        remaining = len(buf) - cursor.pos
        if kv_count * 12 > remaining:  # a key takes 12 bytes at least (length and type)
            raise cursor.error("the key count", f"at most {remaining // 12} keys in a {len(buf)}-byte file",
                               f"{kv_count} (a truncated file, or a damaged count)")
        metadata: dict[str, Any] = {}
        for i in range(kv_count):
            key = cursor.string(f"key {i}")
            if key in metadata:
                raise cursor.error(f"key {key}", "each key once", "it twice")
            metadata[key] = cursor.value(cursor.scalar("<I", f"key {key}"), f"key {key}")
        remaining = len(buf) - cursor.pos
        if tensor_count * 24 > remaining:  # name length, dimension count, one dimension, type and offset
            raise cursor.error("the tensor count", f"at most {remaining // 24} tensors in the bytes left",
                               f"{tensor_count} (a truncated file, or a damaged count)")
        tensors = [_tensor_info(cursor, i) for i in range(tensor_count)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise cursor.error("key general.alignment", "a power of two", f"{alignment!r}")
        data_start = -(-cursor.pos // alignment) * alignment
        _place_tensors(cursor, tensors, data_start, alignment)
        return GGUFHeader(version, metadata, tensors, alignment, data_start)


def _place_tensors(cursor: _Cursor, tensors: list[TensorInfo], data_start: int, alignment: int) -> None:
    """Make each tensor's offset absolute, checking that the data is aligned, packed in table order
    (each tensor right after the previous one, padded to the alignment) and inside the file."""
    expected, previous, names = 0, None, set()
    for t in tensors:
        where = f"tensor {t.name}"
        if t.name in names:
            raise cursor.error(where, "each tensor name once", "it twice")
        names.add(t.name)
        if t.offset % alignment:
            raise cursor.error(where, f"a data offset that is a multiple of general.alignment ({alignment})",
                               f"offset {t.offset}")
        if t.offset != expected:
            after = f"right after {previous}" if previous else "at the start of the data"
            kind = "overlapping the tensor before it" if t.offset < expected else "leaving a gap before it"
            raise cursor.error(where, f"its data at offset {expected}, {after} (whose size follows from its type "
                               f"and shape)", f"offset {t.offset}, {kind}: a damaged offset, type or shape")
        end = data_start + t.offset + t.nbytes
        if end > len(cursor.buf):
            raise cursor.error(where, f"{t.nbytes} bytes of {t.type.name} {t.shape} ending inside the file",
                               f"they end at byte {end}, the file at {len(cursor.buf)} (truncated?)")
        t.offset += data_start
        expected = -(-(end - data_start) // alignment) * alignment
        previous = t.name


# Byte offsets of each block type's float16 scales (d, and dmin where the type has one).
_SCALE_OFFSETS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q2_K: (80, 82),
                  Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
CHECKED_TYPES = (Q.F16, Q.BF16, Q.F32, *_SCALE_OFFSETS)


def check_block_scales(path: Path, tensor: TensorInfo, data: np.ndarray) -> None:
    """Refuse a tensor whose block scales (or, for F16/BF16/F32, values) are infinite or NaN.

    That is how bytes written as one type read as another of the same size (Q4_0 as Q4_K,
    Q5_0 as Q5_K): llama.cpp's ``ggml_validate_row_data`` checks the same. ``data`` is the
    tensor's bytes (uint8).
    """
    raw = torch.from_numpy(data.reshape(-1))  # (nbytes,) uint8
    if tensor.type in (Q.F16, Q.BF16, Q.F32):
        values = raw.view({Q.F16: torch.float16, Q.BF16: torch.bfloat16, Q.F32: torch.float32}[tensor.type])
        bad = not torch.isfinite(values).all()
    elif tensor.type in _SCALE_OFFSETS:
        blocks = raw.view(-1, GGML_QUANT_SIZES[tensor.type][1])  # (n_blocks, block bytes)
        # a float16 is infinite or NaN when its exponent bits (0x7C of its high byte) are all set
        bad = any(bool((blocks[:, at + 1] & 0x7C == 0x7C).any()) for at in _SCALE_OFFSETS[tensor.type])
    else:
        return
    if bad:
        raise ModelFileError(path, f"tensor {tensor.name}", f"finite {tensor.type.name} scales and values",
                             "infinite or NaN ones: the bytes are not of this type (a damaged type field?)")
