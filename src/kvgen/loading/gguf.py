"""Read GGUF files (llama.cpp's format) into Hugging Face style configs and state dicts.

The ``gguf`` package parses the file; dequantisation runs vectorised in torch over all
blocks of a tensor at once and matches ``gguf.quants.dequantize`` bit for bit. Tensor
names, the config mapping and llama's Q/K row un-permutation mirror transformers'
GGUF loader (``transformers/modeling_gguf_pytorch_utils.py``).
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize as _numpy_dequantize
from tqdm.auto import tqdm

from kvgen.loading.consistency import check_config, check_gguf_tensors
from kvgen.loading.errors import ModelFileError
from kvgen.loading.gguf_file import TOKEN_ID_KEYS, read_gguf_header
from kvgen.loading.gguf_index import read_index
from kvgen.models.packed import FORMATS, PackedWeight, can_pack, release_file_pages

# -- reading ---------------------------------------------------------------------------------------


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Return every metadata key of a GGUF file as a plain Python value.

    Example:
        >>> meta = read_gguf_metadata("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
        >>> meta["general.architecture"], meta["llama.block_count"]  # doctest: +SKIP
        ('llama', 30)
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return read_gguf_header(path).metadata


# -- dequantisation --------------------------------------------------------------------------------


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """(n, type_size) uint8 -> (n, 1) float32 read from the float16 at byte ``start``."""
    return blocks[:, start:start + 2].view(torch.float16).float()


def _unpack(x: torch.Tensor, group: int, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """(n, m) uint8 -> (n, m * len(shifts)): each run of ``group`` bytes becomes one run per shift."""
    shift = torch.tensor(shifts, dtype=torch.uint8).view(1, 1, -1, 1)
    out = x.reshape(x.shape[0], -1, 1, group) >> shift  # (n, m / group, len(shifts), group)
    return out.bitwise_and_(mask).reshape(x.shape[0], -1)


# The decoders below compute exactly what gguf.quants does, in float32 and in the same order;
# in-place ops only save allocations (they dominate the time).
_NIBBLES = (0, 4)
_CRUMBS = (0, 2, 4, 6)
_BITS = tuple(range(8))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return _unpack(b[:, 2:], 16, _NIBBLES, 0x0F).float().sub_(8).mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _unpack(b[:, 4:], 16, _NIBBLES, 0x0F).float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """(n, 32) 5-bit values: 4 low bits in nibbles, the 5th in a 32-bit little-endian mask."""
    high = _unpack(b[:, qh_at:qh_at + 4], 1, _BITS, 1)
    return _unpack(b[:, qh_at + 4:], 16, _NIBBLES, 0x0F).bitwise_or_(high << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return _q5(b, 2).float().sub_(16).mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _q5(b, 4).float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float().mul_(_f16(b, 0))


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n, scales = b.shape[0], b[:, :16]
    dl = (_f16(b, 80) * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).reshape(n, 16, 1)
    q = _unpack(b[:, 16:80], 32, _CRUMBS, 3).reshape(n, 16, 16).float()
    return q.mul_(dl).sub_(ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n, scales = b.shape[0], b[:, 96:108]
    sc = _unpack(scales[:, :8], 8, _NIBBLES, 0x0F) | (_unpack(scales[:, 8:], 4, _CRUMBS, 3) << 4)  # (n, 16)
    dl = (_f16(b, 108) * sc.float().sub_(32)).reshape(n, 16, 1)
    low = _unpack(b[:, 32:96], 32, _CRUMBS, 3)
    high = _unpack(b[:, :32], 32, _BITS, 1) ^ 1  # a set mask bit means "no -4 offset"
    q = low.to(torch.int8).sub_(high.to(torch.int8) << 2)  # (n, 256) in -4..3
    return q.reshape(n, 16, 16).float().mul_(dl).reshape(n, 256)


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: (n, 8, 1) scales and mins from 2 float16 super-scales and 12 bytes of 6-bit values."""
    n = b.shape[0]
    packed = b[:, 4:16].reshape(n, 3, 4)
    d, m, md = packed[:, 0], packed[:, 1], packed[:, 2]  # (n, 4) each
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return (_f16(b, 0) * sc.float()).reshape(n, 8, 1), (_f16(b, 2) * mn.float()).reshape(n, 8, 1)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _k_scales(b)
    q = _unpack(b[:, 16:], 32, _NIBBLES, 0x0F).reshape(n, 8, 32).float()
    return q.mul_(d).sub_(dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, dm = _k_scales(b)
    q = _unpack(b[:, 48:], 32, _NIBBLES, 0x0F).bitwise_or_(_unpack(b[:, 16:48], 32, _BITS, 1) << 4)
    return q.reshape(n, 8, 32).float().mul_(d).sub_(dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).reshape(n, 16, 1)
    q = _unpack(b[:, :128], 64, _NIBBLES, 0x0F).bitwise_or_(_unpack(b[:, 128:192], 32, _CRUMBS, 3) << 4)
    return q.reshape(n, 16, 16).float().sub_(32).mul_(d).reshape(n, 256)


# type -> (values per block, bytes per block, (n_blocks, bytes) uint8 -> (n_blocks, values) float32)
_BLOCK_DECODERS = {
    Q.Q4_0: (32, 18, _q4_0),
    Q.Q4_1: (32, 20, _q4_1),
    Q.Q5_0: (32, 22, _q5_0),
    Q.Q5_1: (32, 24, _q5_1),
    Q.Q8_0: (32, 34, _q8_0),
    Q.Q2_K: (256, 84, _q2_k),
    Q.Q3_K: (256, 110, _q3_k),
    Q.Q4_K: (256, 144, _q4_k),
    Q.Q5_K: (256, 176, _q5_k),
    Q.Q6_K: (256, 210, _q6_k),
}
SUPPORTED_TYPES = (Q.F32, Q.F16, Q.BF16, *_BLOCK_DECODERS)


def dequantize(data: np.ndarray, qtype: Q) -> torch.Tensor:
    """Torch twin of ``gguf.quants.dequantize``: raw rows of ``qtype`` blocks -> float32 values.

    ``data`` is ``ReaderTensor.data``: (..., bytes per row) uint8 for block types, already
    typed for F32/F16. Types outside :data:`SUPPORTED_TYPES` go through gguf's numpy code.

    Example:
        >>> import gguf
        >>> raw = gguf.quants.quantize(np.ones((2, 32), np.float32), Q.Q8_0)
        >>> dequantize(raw, Q.Q8_0).shape
        torch.Size([2, 32])
    """
    x = torch.from_numpy(np.ascontiguousarray(data))
    if qtype in (Q.F32, Q.F16):
        return x.float()
    if qtype == Q.BF16:
        return x.view(torch.bfloat16).float()  # (..., 2k) bytes -> (..., k)
    if qtype not in _BLOCK_DECODERS:
        return torch.from_numpy(_numpy_dequantize(data, qtype))
    values, nbytes, decode = _BLOCK_DECODERS[qtype]
    out = decode(x.reshape(-1, nbytes))  # (n_blocks, values)
    return out.reshape(*data.shape[:-1], data.shape[-1] // nbytes * values)


# -- config and tensor names -----------------------------------------------------------------------

# GGUF general.architecture -> (model_type, transformers class); llama.cpp files Mistral under "llama".
_ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "phi3": ("phi3", "Phi3ForCausalLM"),
    "gemma2": ("gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),  # the text part, as transformers loads it
}
_GEMMA = ("gemma2", "gemma3")
_MISTRAL = ("mistral", "MistralForCausalLM")

_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "ffn_up": "mlp.gate_up_proj"}  # phi3 fuses gate and up in ffn_up
# Gemma's sandwich norms: ffn_norm is the norm before the MLP, not after attention as in llama
_GEMMA_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm",
                      "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
_ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
# config key -> GGUF metadata key (after "<architecture>."), for the checks' messages
_METADATA_NAMES = {"hidden_size": "embedding_length", "intermediate_size": "feed_forward_length",
                   "num_hidden_layers": "block_count", "num_attention_heads": "attention.head_count",
                   "num_key_value_heads": "attention.head_count_kv", "head_dim": "attention.key_length",
                   "rms_norm_eps": "attention.layer_norm_rms_epsilon", "rope_theta": "rope.freq_base",
                   "max_position_embeddings": "context_length", "vocab_size": "vocab_size"}
_TENSOR_NAME = re.compile(r"(?:blk\.(\d+)\.)?(\w+)\.(weight|bias)")


def _hf_name(gguf_name: str, arch: str) -> str | None:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; None when unknown."""
    match = _TENSOR_NAME.fullmatch(gguf_name)
    if match is None:
        return None
    layer, base, kind = match.groups()
    if layer is None:
        return f"{_GLOBAL_NAMES[base]}.{kind}" if base in _GLOBAL_NAMES else None
    names = _PHI3_LAYER_NAMES if arch == "phi3" else _GEMMA_LAYER_NAMES if arch in _GEMMA else _LAYER_NAMES
    return f"model.layers.{layer}.{names[base]}.{kind}" if base in names else None


def _config(meta: dict[str, Any], tensors: dict[str, Any], path: Path, dtype: torch.dtype) -> dict[str, Any]:
    """HF ``config.json`` dict from GGUF metadata, mirroring transformers' ``GGUF_CONFIG_MAPPING``."""
    arch = meta["general.architecture"]
    model_type, hf_class = _ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(meta.get("general.name", "")).lower():
        model_type, hf_class = _MISTRAL

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden, heads = get("embedding_length"), get("attention.head_count")
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [hf_class],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        # transformers reads llama's head_dim from rope.dimension_count; key_length is exact when present
        "head_dim": get("attention.key_length")
        or (get("rope.dimension_count") if arch == "llama" else None)
        or hidden // heads,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length", 2048),
        "vocab_size": get("vocab_size") or int(tensors["token_embd.weight"].shape[-1]),  # GGUF: [hidden, vocab]
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    rotary = get("rope.dimension_count")
    if rotary and rotary != config["head_dim"]:  # e.g. Phi-4-mini rotates 3/4 of each head
        config["partial_rotary_factor"] = rotary / config["head_dim"]
    if model_type == "mistral":
        config["sliding_window"] = None  # llama.cpp runs "llama" files with full attention
    if arch in _GEMMA:  # as transformers: unmapped fields (query_pre_attn_scalar, layer pattern) keep defaults
        config.update(hidden_act="gelu_pytorch_tanh", hidden_activation="gelu_pytorch_tanh",
                      sliding_window=get("attention.sliding_window"),
                      rope_theta=get("rope.freq_base", 10000.0 if arch == "gemma2" else 1_000_000.0))
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if get(key) is not None:
                config[key] = get(key)
    scaling = get("rope.scaling.type", "none")
    if scaling in ("linear", "yarn"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": get("rope.scaling.factor")}
        if get("rope.scaling.original_context_length"):
            config["rope_scaling"]["original_max_position_embeddings"] = get("rope.scaling.original_context_length")
    elif scaling != "none":
        raise ValueError(f"{path}: rope scaling type {scaling!r} is not supported (only linear and yarn).")
    for gguf_key, hf_key in TOKEN_ID_KEYS.items():
        if f"tokenizer.ggml.{gguf_key}" in meta:
            config[hf_key] = meta[f"tokenizer.ggml.{gguf_key}"]
    return config


def _unpermute(w, n_head: int):
    """Undo llama.cpp's Q/K row permutation (``reverse_permute_weights`` in transformers).

    The converter interleaves the two rotary halves of every head; this restores HF's order.
    ``w`` is a float tensor or a :class:`PackedWeight` (whose stored rows move as they are).
    """
    rows = w.shape[0]
    # output row i is stored row index[i]: (n_head, rows / n_head / 2, 2) -> (n_head, 2, rows / n_head / 2)
    index = torch.arange(rows).reshape(n_head, -1, 2).transpose(1, 2).reshape(rows)
    if not isinstance(w, PackedWeight):
        return w[index]
    permuted = w.permute_rows(index)
    release_file_pages([data for _, data in w.segments])  # read once into the copy: not kept resident
    return permuted


def _packed(tensor: Any) -> PackedWeight | None:
    """The tensor as a :class:`PackedWeight` when kvgen's kernels run its type (2-D, whole blocks)."""
    format, data = int(tensor.tensor_type), tensor.data
    if tensor.tensor_type == Q.F32 or data.ndim != 2 or format not in FORMATS:
        return None
    in_features = int(tensor.shape[0])  # GGUF lists dims innermost first
    if not can_pack(format, in_features):
        return None
    raw = torch.from_numpy(np.ascontiguousarray(data).view(np.uint8))  # the file's bytes, mapped, not copied
    return PackedWeight([(format, raw.reshape(data.shape[0], -1))], in_features)


def _dequantize_tensor(tensor: Any, path: Path) -> torch.Tensor:
    """Dequantise one ``ReaderTensor``; unsupported types fail naming the tensor and its type."""
    try:
        return dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"{path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which cannot be dequantised; "
            f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)} and gguf.quants' numpy types."
        ) from None


@contextlib.contextmanager
def _one_thread():
    """Run torch ops on one thread: dequantising is memory-bound, and on a busy 2-core machine
    two threads waiting on each other at every op made the default model take 1.2-5.6 s to
    load, against a steady ~1.3 s on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def load_gguf(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, progress: bool = False, packed: bool = False
) -> tuple[dict[str, Any], dict[str, torch.Tensor | PackedWeight]]:
    """Read a GGUF file into an HF ``config.json`` dict and a transformers-named state dict.

    Quantised tensors are dequantised to float32, then cast to ``dtype``; with ``packed=True``
    the weight matrices stay in their stored types instead (:class:`PackedWeight` over the
    file's mapped bytes), and types kvgen's kernels cannot run are dequantised with a one-line
    warning. Architectures:
    llama (Llama, Mistral, SmolLM2), qwen2, qwen3, phi3, gemma2, gemma3 (text). ``progress`` shows a bar over tensors.

    Example:
        >>> config, state = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")  # doctest: +SKIP
        >>> config["num_hidden_layers"], state["model.norm.weight"].shape  # doctest: +SKIP
        (30, torch.Size([576]))
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    meta, tensor_list, vocabulary = read_index(path)
    tensors = {t.name: t for t in tensor_list}
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: "
            f"{', '.join(_ARCHITECTURES)} (llama covers Llama, Mistral and SmolLM2)."
        )
    names = {hf: f"{arch}.{key}" for hf, key in _METADATA_NAMES.items()}
    names.update({hf: f"tokenizer.ggml.{key}" for key, hf in TOKEN_ID_KEYS.items()})
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if names[key] not in meta:
            raise ModelFileError(path, f"key {names[key]}", "a positive integer", "no such key")
    if "token_embd.weight" not in tensors:
        raise ModelFileError(path, "tensor token_embd.weight", "the token embedding", "no such tensor")
    check_config({hf: meta[key] for hf, key in names.items() if key in meta}, path, names, vocabulary)
    config = _config(meta, tensors, path, dtype)
    check_config(config, path, names, vocabulary)
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{path}: rope_freqs.weight (Llama-3 rope frequency factors) is not supported.")
    unknown = sorted(n for n in tensors if n not in _ROPE_FACTORS and _hf_name(n, arch) is None)
    if unknown:
        raise ValueError(f"{path}: tensors with no transformers equivalent for {arch!r}: {', '.join(unknown)}")
    rotary = meta.get(f"{arch}.rope.dimension_count")
    if rotary is not None and (not isinstance(rotary, int) or not 2 <= rotary <= config["head_dim"] or rotary % 2):
        raise ModelFileError(path, f"key {arch}.rope.dimension_count", f"an even count (rotated in pairs) of at most "
                             f"the head dimension ({config['head_dim']})", repr(rotary))
    check_gguf_tensors(config, arch, {name: t.shape for name, t in tensors.items()}, path, vocabulary)

    state: dict[str, torch.Tensor | PackedWeight] = {}
    rope_factors: dict[str, list[float]] = {}
    dequantized: set[str] = set()
    with _one_thread():
        for tensor in tqdm(tensor_list, desc=f"Loading {path.name}", unit="tensor", disable=not progress):
            weight = _packed(tensor) if packed else None
            if weight is None:
                if packed and tensor.tensor_type != Q.F32 and tensor.data.ndim == 2:
                    dequantized.add(tensor.tensor_type.name)
                weight = _dequantize_tensor(tensor, path)
            if tensor.name in _ROPE_FACTORS:
                rope_factors[_ROPE_FACTORS[tensor.name]] = weight.tolist()
                continue
            if arch == "llama" and ".attn_q." in tensor.name:
                weight = _unpermute(weight, config["num_attention_heads"])
            elif arch == "llama" and ".attn_k." in tensor.name:
                weight = _unpermute(weight, config["num_key_value_heads"])
            elif arch in _GEMMA and tensor.name.endswith("norm.weight"):
                weight = weight - 1  # llama.cpp stores Gemma's RMSNorm scale as 1 + weight
            state[_hf_name(tensor.name, arch)] = weight if isinstance(weight, PackedWeight) else weight.to(dtype)
    if dequantized:
        warnings.warn(f"{path.name}: kvgen has no kernel for {', '.join(sorted(dequantized))} weights; "
                      "they are dequantized to float32 at load", stacklevel=2)
    if rope_factors:  # phi3 long-context ("longrope") models store their rope factors as tensors
        config["rope_scaling"] = {"rope_type": "longrope", **rope_factors}
        config["original_max_position_embeddings"] = meta.get(f"{arch}.rope.scaling.original_context_length")
    return config, state
