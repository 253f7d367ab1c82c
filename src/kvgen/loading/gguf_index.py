"""A GGUF file's metadata and tensor table, parsed once and kept in kvgen's cache.

The first load of a file reads and checks its header (:mod:`kvgen.loading.gguf_file`, 0.1-0.3 s
for a 49k-262k-token vocabulary) and every block's scales, and writes what the model needs
(metadata without the vocabulary arrays, the vocabulary's size, and each tensor's type, shape
and byte offset) to ``<cache>/gguf/<key>/index.json``, and its tokenizer as ``tokenizer.json``;
later loads read those and map the file's tensor bytes directly. The key is the file's
resolved path, size and modification time, so a changed file is parsed and checked again.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvgen.folders import cache_dir
from kvgen.loading.gguf_file import CHECKED_TYPES, check_block_scales, read_gguf_header

INDEX_VERSION = 2  # bump when the index's content changes
_CHUNK = 8 << 20  # bytes read at a time by the scale check
_VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


@dataclass
class IndexedTensor:
    """What the loader reads of a ``gguf.ReaderTensor``: name, type, dims (innermost first), data."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: list[int]
    data: np.ndarray


def cache_folder(path: Path) -> Path:
    """``<cache>/gguf/<key>``: the cache entry of the GGUF file at ``path``."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{INDEX_VERSION}".encode()).hexdigest()[:20]
    return cache_dir() / "gguf" / key


def write_atomically(target: Path, text: str) -> None:
    """Write ``text`` to ``target`` through a temporary file renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}-")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, target)


def _layout(t: dict[str, Any]) -> tuple[np.dtype, list[int]]:
    """(numpy dtype, array shape outermost first) of a tensor's bytes, as ``gguf.GGUFReader`` gives them:
    F32/F16 typed, every other type as rows of bytes."""
    qtype, shape = GGMLQuantizationType(t["type"]), t["shape"][::-1]
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.dtype(np.float32 if qtype == GGMLQuantizationType.F32 else np.float16), shape
    block, type_size = GGML_QUANT_SIZES[qtype]
    return np.dtype(np.uint8), [*shape[:-1], shape[-1] // block * type_size]


def _build_index(path: Path) -> dict[str, Any]:
    """The checked header of the file at ``path`` as an index; every tensor's scales are checked too."""
    header = read_gguf_header(path)
    buffer = np.empty(_CHUNK, np.uint8)
    with open(path, "rb", buffering=0) as f:  # read in 8 MB pieces: cheaper than faulting in mapped pages
        for t in (t for t in header.tensors if t.type in CHECKED_TYPES):
            step = _CHUNK // GGML_QUANT_SIZES[t.type][1] * GGML_QUANT_SIZES[t.type][1]  # whole blocks
            for start in range(0, t.nbytes, step):
                piece = buffer[:min(step, t.nbytes - start)]
                f.seek(t.offset + start)
                f.readinto(memoryview(piece))
                check_block_scales(path, t, piece)
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    return {"metadata": {name: value for name, value in header.metadata.items() if name not in _VOCABULARY},
            "vocabulary": len(tokens) if isinstance(tokens, list) else None,
            "tensors": [{"name": t.name, "type": int(t.type), "shape": t.shape, "offset": t.offset}
                        for t in header.tensors]}


def read_index(path: Path) -> tuple[dict[str, Any], list[IndexedTensor], int | None]:
    """(metadata without the vocabulary arrays, tensors over the mapped file, the number of tokens in
    ``tokenizer.ggml.tokens`` or None) of the GGUF at ``path``.

    The file is parsed and checked (:mod:`kvgen.loading.gguf_file`) on a cache miss.
    """
    index_file = cache_folder(path) / "index.json"
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        index = None
    if index is None:
        print(f"kvgen: indexing {path.name} (once per file)", file=sys.stderr)
        index = _build_index(path)
        try:
            write_atomically(index_file, json.dumps(index))
        except OSError:
            pass  # a read-only cache: parse every time
    file = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: torch.from_numpy takes it as is
    tensors = []
    for t in index["tensors"]:
        dtype, data_shape = _layout(t)
        count = int(np.prod(data_shape))
        data = file[t["offset"]:t["offset"] + count * dtype.itemsize].view(np.ndarray).view(dtype)
        tensors.append(IndexedTensor(t["name"], GGMLQuantizationType(t["type"]), t["shape"],
                                     data.reshape(data_shape)))
    return index["metadata"], tensors, index["vocabulary"]
