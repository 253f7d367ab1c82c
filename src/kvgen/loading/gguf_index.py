"""A GGUF file's metadata and tensor table, parsed once and kept in kvgen's cache.

``gguf``'s reader parses every metadata field in pure Python, the tokenizer's vocabulary
(49k-262k strings) included: seconds per load. The first load of a file writes what the
model needs (metadata without the vocabulary arrays, and each tensor's type, shape and byte
offset) to ``<cache>/gguf/<key>/index.json``, and its tokenizer as ``tokenizer.json``;
later loads read those and map the file's tensor bytes directly. The key is the file's
resolved path, size and modification time, so a changed file is parsed again.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType

from kvgen.folders import cache_dir

INDEX_VERSION = 1  # bump when the index's content changes
_VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


@dataclass
class IndexedTensor:
    """What the loader reads of a ``gguf.ReaderTensor``: name, type, dims (innermost first), data."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: list[int]
    data: np.ndarray


def field_value(field: Any) -> Any:
    """A ``gguf.ReaderField``'s value as plain Python (float32s by their shortest repr: 1e-05, not 9.99...e-06)."""
    value = field.contents()
    if field.types == [GGUFValueType.FLOAT32]:
        value = float(str(np.float32(value)))
    return value


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


def read_index(path: Path, open_reader) -> tuple[dict[str, Any], list[IndexedTensor]]:
    """(metadata without the vocabulary arrays, tensors over the mapped file) of the GGUF at ``path``.

    ``open_reader(path)`` parses the file on a cache miss (a ``GGUFReader``).
    """
    index_file = cache_folder(path) / "index.json"
    try:
        index = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        index = None
    if index is None:
        import sys

        print(f"kvgen: indexing {path.name} (once per file)", file=sys.stderr)
        reader = open_reader(path)
        index = {
            "metadata": {name: field_value(field) for name, field in reader.fields.items() if name not in _VOCABULARY},
            "tensors": [{"name": t.name, "type": int(t.tensor_type), "shape": [int(d) for d in t.shape],
                         "offset": int(t.data_offset), "dtype": t.data.dtype.str, "data_shape": list(t.data.shape)}
                        for t in reader.tensors],
        }
        try:
            write_atomically(index_file, json.dumps(index))
        except OSError:
            pass  # a read-only cache: parse every time
    file = np.memmap(path, dtype=np.uint8, mode="c")  # copy-on-write: torch.from_numpy takes it as is
    tensors = []
    for t in index["tensors"]:
        dtype = np.dtype(t["dtype"])
        count = int(np.prod(t["data_shape"]))
        data = file[t["offset"]:t["offset"] + count * dtype.itemsize].view(np.ndarray).view(dtype)
        tensors.append(IndexedTensor(t["name"], GGMLQuantizationType(t["type"]), t["shape"],
                                     data.reshape(t["data_shape"])))
    return index["metadata"], tensors
