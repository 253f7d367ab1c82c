"""transformers' side of the parity tests on real GGUF files, loaded once per file and test session.

transformers reads a GGUF with gguf-py: every call parses the whole file again (8-9 s for SmolLM2's 49k-token
vocabulary on 2 cores, more for Gemma 3's 262k) and builds gguf's tensor-name map again for each tensor (~13 s a
load). Here each file is parsed once and each name map built once, for all of transformers' calls; what
transformers computes from them (config, dequantized tensors, tokenizer) is its own, unchanged. Those are also
kept on disk, keyed by the file and transformers' version: Gemma 3's took ~70 s a session to compute, ~6 s to read
back.

    config, tensors = transformers_gguf(path)          # as load_gguf_checkpoint(return_tensors=True) gives them
    tokenizer = transformers_gguf_tokenizer(path)       # AutoTokenizer.from_pretrained(folder, gguf_file=name)
    reader = gguf_reader(path)                          # gguf.GGUFReader(path), parsed once
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from pathlib import Path

import gguf
import torch
import transformers

_READER, _NAME_MAP = gguf.GGUFReader, gguf.get_tensor_name_map


@contextlib.contextmanager
def _parsed_once():
    """gguf.GGUFReader and gguf.get_tensor_name_map memoized while transformers runs (it imports both from gguf
    at each call), keyed by the file's path, size and modification time."""
    gguf.GGUFReader = gguf_reader
    gguf.get_tensor_name_map = _name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = _READER, _NAME_MAP


def gguf_reader(path) -> gguf.GGUFReader:
    """``gguf.GGUFReader(path)`` (read-only), parsed once per file and session: a copy shared by every caller."""
    path = os.path.realpath(path)
    stat = os.stat(path)
    return _reader(path, stat.st_size, stat.st_mtime_ns)


@functools.cache
def _reader(path: str, size: int, mtime: int) -> gguf.GGUFReader:
    return _READER(path)


_name_map = functools.cache(_NAME_MAP)


@functools.cache
def transformers_gguf(path: Path) -> tuple[transformers.PretrainedConfig, dict[str, torch.Tensor]]:
    """transformers' config of the GGUF at ``path`` and its float32 state dict, computed once per file and
    transformers version and kept in ``$XDG_CACHE_HOME/kvgen-tests`` (``~/.cache``).

    ``from_pretrained(gguf_file=...)`` insists on ``accelerate`` (not installed); this calls
    ``load_gguf_checkpoint`` directly, on a weightless model for the tensor names, as it does.
    """
    from safetensors.torch import load_file, save_file
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder = _kept(path)
    if (folder / "tensors.safetensors").exists():
        config = transformers.AutoConfig.from_pretrained(folder)
        config._name_or_path = str(path.parent)  # as loaded from the GGUF
        return config, load_file(folder / "tensors.safetensors")
    with _parsed_once():
        config = transformers.AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        with torch.device("meta"):
            names = transformers.AutoModelForCausalLM.from_config(config)
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=names, torch_dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    partial = folder / f"tensors.{os.getpid()}.tmp"  # renamed once whole: a reader never sees half a file
    save_file({name: t.contiguous() for name, t in parsed["tensors"].items()}, partial)
    partial.rename(folder / "tensors.safetensors")
    return config, parsed["tensors"]


@functools.cache
def transformers_gguf_model(path: Path) -> transformers.PreTrainedModel:
    """transformers' float32 model of the GGUF at ``path`` (tied weights tied), in eval mode."""
    config, tensors = transformers_gguf(path)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)  # lm_head: tied
    model.tie_weights()
    return model


@functools.cache
def transformers_gguf_tokenizer(path: Path):
    """transformers' tokenizer of the GGUF at ``path``, converted once per file and transformers version and kept
    (as its ``save_pretrained`` writes it) where :func:`transformers_gguf` keeps the tensors."""
    folder = _kept(path) / "tokenizer"
    if (folder / "tokenizer_config.json").exists():
        return transformers.AutoTokenizer.from_pretrained(folder)
    with _parsed_once():
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    partial = folder.with_name(f"tokenizer.{os.getpid()}.tmp")
    tokenizer.save_pretrained(partial)
    try:
        partial.rename(folder)
    except OSError:  # another session kept it first
        shutil.rmtree(partial)
    return tokenizer


def _kept(path: Path) -> Path:
    """The folder that keeps what transformers computed from the GGUF at ``path``: one per file (its name, size and
    modification time) and transformers version."""
    stat = os.stat(os.path.realpath(path))
    return (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvgen-tests" /
            f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}")
