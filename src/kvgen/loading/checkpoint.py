"""Read and write Hugging Face style safetensors checkpoint folders.

A folder holds ``config.json`` plus either ``model.safetensors`` or shards listed in
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``), and
optionally ``generation_config.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-export or re-download it.") from None


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    """Read every tensor of one safetensors file into its own memory (no shared mmap).

    Tensors backed by one mmap of the file keep all its touched pages resident while any
    of them lives; separate buffers are freed one by one (e.g. as q/k/v get fused).
    """
    if not path.is_file():
        raise FileNotFoundError(f"safetensors file not found: {path}")
    size = path.stat().st_size

    def corrupt(why: str) -> ValueError:
        return ValueError(f"{path} is corrupt or truncated ({why}); re-download or re-export it.")

    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise corrupt("shorter than its 8-byte header length")
        header_len = int.from_bytes(head, "little")
        if header_len > size - 8:
            raise corrupt(f"header length {header_len} exceeds the file")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise corrupt(f"header is not JSON: {e}") from None
        header.pop("__metadata__", None)
        state = {}
        for name, info in sorted(header.items(), key=lambda item: item[1]["data_offsets"][0]):
            try:
                dtype, shape, (start, end) = _DTYPES[info["dtype"]], info["shape"], info["data_offsets"]
            except (KeyError, TypeError, ValueError):
                raise corrupt(f"bad header entry for tensor {name!r}: {info}") from None
            tensor = torch.empty(shape, dtype=dtype)
            nbytes = tensor.numel() * tensor.element_size()
            if end - start != nbytes or 8 + header_len + end > size:
                raise corrupt(f"tensor {name!r} needs {nbytes} bytes at {start}..{end}, file has {size}")
            f.seek(8 + header_len + start)
            if nbytes and f.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy())) != nbytes:
                raise corrupt(f"tensor {name!r} ends past the end of the file")
            state[name] = tensor
    return state


def _shard_files(folder: Path) -> list[Path]:
    """The safetensors files holding the folder's weights, in load order."""
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index_path} has no 'weight_map' object mapping tensor names to shard files.")
        shards = [folder / name for name in sorted(set(weight_map.values()))]
        missing = [p.name for p in shards if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"{index_path} lists shards missing from {folder}: {', '.join(missing)}")
        return shards
    present = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
    raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in {folder}; it contains: {present}")


def load_safetensors_state_dict(folder: str | os.PathLike, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Load every tensor of a (possibly sharded) safetensors checkpoint folder.

    Example:
        >>> state = load_safetensors_state_dict("path/to/model", dtype=torch.float32)  # doctest: +SKIP
        >>> state["model.embed_tokens.weight"].shape  # doctest: +SKIP
        torch.Size([49152, 576])
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder not found: {folder}")
    state: dict[str, torch.Tensor] = {}
    for shard in _shard_files(folder):
        state.update(_load_file(shard))
    if dtype is not None:
        state = {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}
    return state


def read_generation_config(folder: str | os.PathLike) -> dict[str, Any] | None:
    """``generation_config.json`` of a folder as a dict, or None when the folder has none.

    Example:
        >>> read_generation_config("path/to/model")  # doctest: +SKIP
        {'bos_token_id': 1, 'eos_token_id': 2}
    """
    path = Path(folder) / "generation_config.json"
    return _read_json(path) if path.is_file() else None


def save_safetensors_checkpoint(
    folder: str | os.PathLike,
    state_dict: dict[str, torch.Tensor],
    config_dict: dict[str, Any],
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Write ``model.safetensors``, ``config.json`` (and ``generation_config.json``) to ``folder``.

    The folder loads with ``transformers.AutoModelForCausalLM.from_pretrained`` too. With
    ``tie_word_embeddings`` set, ``lm_head.weight`` is left out: it is the embedding matrix.

    Example:
        >>> save_safetensors_checkpoint("out", state, config)  # doctest: +SKIP
        PosixPath('out')
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tied = config_dict.get("tie_word_embeddings", False)
    tensors = {k: v.contiguous() for k, v in state_dict.items() if not (tied and k == "lm_head.weight")}
    save_file(tensors, folder / SINGLE_FILE, metadata={"format": "pt"})
    files = {"config.json": config_dict, "generation_config.json": generation_config}
    for name, content in files.items():
        if content is not None:
            with open(folder / name, "w", encoding="utf-8") as f:
                json.dump(content, f, indent=2, sort_keys=True)
                f.write("\n")
    return folder
