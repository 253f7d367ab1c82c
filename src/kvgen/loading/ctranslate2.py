"""Read CTranslate2 Whisper models (``model.bin``, as used by faster-whisper) as Hugging Face checkpoints.

A CTranslate2 folder holds ``model.bin``, ``config.json`` (generation settings, not an HF config),
and the vocabulary (``vocabulary.txt`` or ``vocabulary.json``, often ``tokenizer.json`` too).
:func:`load_ctranslate2_whisper` turns it into what an HF Whisper checkpoint would hold: a
``WhisperConfig`` dict, a state dict with HF tensor names and a generation config dict.

``model.bin`` (binary version 6, little-endian): uint32 version; string spec name; uint32 spec
revision; uint32 variable count; per variable: string name, uint8 rank, rank x uint32 dims,
uint8 dtype (0 f32, 1 i8, 2 i16, 3 i32, 4 f16, 5 bf16), uint32 byte count, raw bytes; then
uint32 alias count and (alias, target) string pairs. A string is a uint16 length (counting a
trailing NUL) and the bytes.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from kvgen.loading.consistency import check_config
from kvgen.loading.errors import ModelFileError

MODEL_FILE = "model.bin"
SUPPORTED_BINARY_VERSIONS = (6,)
DTYPES = {0: torch.float32, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.float16, 5: torch.bfloat16}
_GELU = 3  # CTranslate2's ActivationType.GELU


@dataclass
class CTranslate2Model:
    """The raw contents of a ``model.bin``: spec name, revision, variables and aliases.

    Example:
        >>> model = read_ctranslate2_model("faster-whisper-tiny.en/model.bin")  # doctest: +SKIP
        >>> model.spec, model["decoder/projection/weight"].shape  # doctest: +SKIP
        ('WhisperSpec', torch.Size([51864, 384]))
    """

    spec: str
    revision: int
    variables: dict[str, torch.Tensor]
    aliases: dict[str, str]  # alias name -> variable name

    def __contains__(self, name: str) -> bool:
        return name in self.variables or name in self.aliases

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self.variables[self.aliases.get(name, name)]
        except KeyError:
            raise KeyError(f"the {self.spec} model.bin has no variable {name!r}") from None

    def scalar(self, name: str, default: int) -> int:
        """An integer scalar variable such as ``encoder/num_heads``, or ``default`` when absent."""
        return int(self[name].item()) if name in self else default


class _Reader:
    """Reads the little-endian fields of ``model.bin``, naming the file and offset on truncation."""

    def __init__(self, file: BinaryIO, path: Path):
        self.file, self.path = file, path
        self.size = os.fstat(file.fileno()).st_size

    def error(self, why: str) -> ModelFileError:
        return ModelFileError(self.path, f"byte {self.file.tell()} of {self.size}", "a valid CTranslate2 model.bin",
                              f"{why}: the file is truncated or corrupt (copy or convert it again)")

    def bytes(self, count: int) -> bytes:
        data = self.file.read(count)
        if len(data) != count:
            raise self.error(f"needed {count} more bytes, the file ends")
        return data

    def uint(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.bytes(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        data = self.bytes(self.uint("H"))
        if not data.endswith(b"\0"):
            raise self.error("a string does not end with NUL")
        try:
            return data[:-1].decode("utf-8")
        except UnicodeDecodeError:
            raise self.error("a string is not UTF-8") from None

    def tensor(self, shape: list[int], dtype: torch.dtype, nbytes: int, name: str) -> torch.Tensor:
        numel = 1
        for dim in shape:
            numel *= dim
        if numel * dtype.itemsize != nbytes:
            raise self.error(f"variable {name!r} of shape {shape} and {dtype} declares {nbytes} bytes")
        if nbytes > self.size - self.file.tell():
            raise self.error(f"variable {name!r} needs {nbytes} bytes, the file ends first")
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        buffer = bytearray(nbytes)
        self.file.readinto(buffer)
        return torch.frombuffer(buffer, dtype=dtype).reshape(shape)


def _read_header(reader: _Reader) -> tuple[int, str, int]:
    version = reader.uint("I")
    if version not in SUPPORTED_BINARY_VERSIONS:
        raise ModelFileError(reader.path, "the binary version", f"version {SUPPORTED_BINARY_VERSIONS} (convert the "
                             "model again with a recent CTranslate2)", f"binary version {version}; kvgen reads version")
    return version, reader.string(), reader.uint("I")


def read_ctranslate2_model(path: str | os.PathLike) -> CTranslate2Model:
    """Read every variable and alias of a CTranslate2 ``model.bin`` (a file or its folder)."""
    path = Path(path)
    if path.is_dir():
        path = path / MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(f"CTranslate2 model file not found: {path}")
    with open(path, "rb") as f:
        reader = _Reader(f, path)
        _, spec, revision = _read_header(reader)
        variables = {}
        for _ in range(reader.uint("I")):
            name = reader.string()
            shape = [reader.uint("I") for _ in range(reader.uint("B"))]
            type_id = reader.uint("B")
            if type_id not in DTYPES:
                raise reader.error(f"variable {name!r} has unknown dtype id {type_id}")
            variables[name] = reader.tensor(shape, DTYPES[type_id], reader.uint("I"), name)
        aliases = {}
        for _ in range(reader.uint("I")):
            alias, target = reader.string(), reader.string()
            aliases[alias] = target
        if f.read(1):
            raise reader.error("unexpected bytes after the alias table")
    for alias, target in aliases.items():
        if target not in variables:
            raise ModelFileError(path, f"alias {alias!r}", "a variable the file holds (convert it again)",
                                 f"alias {alias!r} points to {target!r}, which the file does not hold")
    return CTranslate2Model(spec, revision, variables, aliases)


def is_ctranslate2_dir(path: str | os.PathLike) -> bool:
    """True for a folder with a CTranslate2 ``model.bin`` (checked by its header) and no HF weights."""
    folder = Path(path)
    model_file = folder / MODEL_FILE
    if not folder.is_dir() or not model_file.is_file():
        return False
    if any(folder.glob("*.safetensors")) or (folder / "model.safetensors.index.json").is_file():
        return False
    try:
        with open(model_file, "rb") as f:
            _read_header(_Reader(f, model_file))
    except (ValueError, OSError):
        return False
    return True


# -- Whisper ------------------------------------------------------------------------------------------

def _dequantize(model: CTranslate2Model) -> None:
    """Turn int8/int16 weights with a ``weight_scale`` (CTranslate2 quantization) back into float32."""
    for name in [n for n in model.variables if n.endswith("/weight_scale")]:
        weight_name = name.removesuffix("_scale")
        scale = model.variables.pop(name).float()  # (out_features,) or a scalar
        weight = model.variables[weight_name]
        model.variables[weight_name] = weight.float() / (scale.unsqueeze(-1) if scale.dim() else scale)


def _read_vocabulary(folder: Path) -> list[str]:
    if (folder / "vocabulary.txt").is_file():
        return (folder / "vocabulary.txt").read_text(encoding="utf-8").split("\n")
    if (folder / "vocabulary.json").is_file():
        return json.loads((folder / "vocabulary.json").read_text(encoding="utf-8"))
    raise FileNotFoundError(f"{folder} has no vocabulary.txt or vocabulary.json; a CTranslate2 Whisper folder needs "
                            "one to know the special token ids. Copy it from the converted model.")


def _special_ids(vocabulary: list[str], vocab_size: int) -> dict[str, Any]:
    index = {token: i for i, token in enumerate(vocabulary[:vocab_size])}
    needed = ("<|endoftext|>", "<|startoftranscript|>", "<|translate|>", "<|transcribe|>", "<|startofprev|>",
              "<|notimestamps|>")
    missing = [token for token in needed if token not in index]
    if missing:
        raise ValueError(f"the vocabulary lacks Whisper's special tokens {missing}; is this a Whisper model?")
    sot, translate = index["<|startoftranscript|>"], index["<|translate|>"]
    languages = {token: i for token, i in index.items()
                 if sot < i < translate and re.fullmatch(r"<\|[a-z]{2,3}\|>", token)}
    return {"eot": index["<|endoftext|>"], "sot": sot, "translate": translate,
            "transcribe": index["<|transcribe|>"], "prev": index["<|startofprev|>"],
            "no_timestamps": index["<|notimestamps|>"], "languages": languages}


def _split_rows(tensor: torch.Tensor, parts: int, name: str) -> tuple[torch.Tensor, ...]:
    if tensor.shape[0] % parts:
        raise ValueError(f"fused variable {name!r} has {tensor.shape[0]} rows, not a multiple of {parts}")
    return tuple(t.clone() for t in tensor.chunk(parts, dim=0))


def _attention(model: CTranslate2Model, ct2: str, hf: str, fused: str) -> dict[str, torch.Tensor]:
    """One attention block. ``fused`` is "qkv" (self-attention) or "kv" (cross-attention, q in linear_0).

    The k projection has no bias in Whisper; CTranslate2 stores zeros there. A key bias adds
    ``q . b_k`` to every score of a query alike, which softmax ignores, so dropping it is exact.
    """
    out: dict[str, torch.Tensor] = {}
    if fused == "qkv":
        q_w, k_w, v_w = _split_rows(model[f"{ct2}/linear_0/weight"], 3, f"{ct2}/linear_0/weight")
        q_b, _, v_b = _split_rows(model[f"{ct2}/linear_0/bias"], 3, f"{ct2}/linear_0/bias")
        out_proj = "linear_1"
    else:
        q_w, q_b = model[f"{ct2}/linear_0/weight"], model[f"{ct2}/linear_0/bias"]
        k_w, v_w = _split_rows(model[f"{ct2}/linear_1/weight"], 2, f"{ct2}/linear_1/weight")
        _, v_b = _split_rows(model[f"{ct2}/linear_1/bias"], 2, f"{ct2}/linear_1/bias")
        out_proj = "linear_2"
    out[f"{hf}.q_proj.weight"], out[f"{hf}.q_proj.bias"] = q_w, q_b
    out[f"{hf}.k_proj.weight"] = k_w
    out[f"{hf}.v_proj.weight"], out[f"{hf}.v_proj.bias"] = v_w, v_b
    out[f"{hf}.out_proj.weight"] = model[f"{ct2}/{out_proj}/weight"]
    out[f"{hf}.out_proj.bias"] = model[f"{ct2}/{out_proj}/bias"]
    return out


def _norm(model: CTranslate2Model, ct2: str, hf: str) -> dict[str, torch.Tensor]:
    return {f"{hf}.weight": model[f"{ct2}/gamma"], f"{hf}.bias": model[f"{ct2}/beta"]}


def _linear(model: CTranslate2Model, ct2: str, hf: str) -> dict[str, torch.Tensor]:
    return {f"{hf}.weight": model[f"{ct2}/weight"], f"{hf}.bias": model[f"{ct2}/bias"]}


def _self_attention_and_ffn(model: CTranslate2Model, ct2: str, hf: str) -> dict[str, torch.Tensor]:
    """The parts every Whisper layer has: self-attention, the feed-forward block and their norms."""
    state = _attention(model, f"{ct2}/self_attention", f"{hf}.self_attn", "qkv")
    state.update(_norm(model, f"{ct2}/self_attention/layer_norm", f"{hf}.self_attn_layer_norm"))
    state.update(_linear(model, f"{ct2}/ffn/linear_0", f"{hf}.fc1"))
    state.update(_linear(model, f"{ct2}/ffn/linear_1", f"{hf}.fc2"))
    state.update(_norm(model, f"{ct2}/ffn/layer_norm", f"{hf}.final_layer_norm"))
    return state


def _whisper_state_dict(model: CTranslate2Model, encoder_layers: int, decoder_layers: int) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for conv in ("conv1", "conv2"):
        state.update(_linear(model, f"encoder/{conv}", f"model.encoder.{conv}"))
    state["model.encoder.embed_positions.weight"] = model["encoder/position_encodings/encodings"]
    for i in range(encoder_layers):
        state.update(_self_attention_and_ffn(model, f"encoder/layer_{i}", f"model.encoder.layers.{i}"))
    state.update(_norm(model, "encoder/layer_norm", "model.encoder.layer_norm"))
    state["model.decoder.embed_tokens.weight"] = model["decoder/embeddings/weight"]
    state["model.decoder.embed_positions.weight"] = model["decoder/position_encodings/encodings"]
    for i in range(decoder_layers):
        ct2, hf = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
        state.update(_self_attention_and_ffn(model, ct2, hf))
        state.update(_attention(model, f"{ct2}/attention", f"{hf}.encoder_attn", "kv"))
        state.update(_norm(model, f"{ct2}/attention/layer_norm", f"{hf}.encoder_attn_layer_norm"))
    state.update(_norm(model, "decoder/layer_norm", "model.decoder.layer_norm"))
    if model.aliases.get("decoder/projection/weight") != "decoder/embeddings/weight":
        state["proj_out.weight"] = model["decoder/projection/weight"]
    return state


def _layer_count(model: CTranslate2Model, stack: str) -> int:
    found = {int(m.group(1)) for name in model.variables if (m := re.match(rf"{stack}/layer_(\d+)/", name))}
    if found != set(range(len(found))):
        raise ValueError(f"the {stack} layers of this model.bin are not numbered 0..n-1: {sorted(found)}")
    return len(found)


def _whisper_config(model: CTranslate2Model, folder: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The HF ``WhisperConfig`` dict (from the tensor shapes) and generation config dict (from config.json)."""
    if model.scalar("decoder/activation", _GELU) != _GELU or not model.scalar("decoder/pre_norm", 1) \
            or model.scalar("decoder/alibi", 0):
        raise ValueError(f"{folder / MODEL_FILE}: the decoder is not Whisper's (GELU, pre-norm, no ALiBi)")
    embeddings = model["decoder/embeddings/weight"]  # (vocab, d_model)
    vocab_size, d_model = embeddings.shape
    conv1 = model["encoder/conv1/weight"]  # (d_model, num_mel_bins, 3)
    encoder_layers, decoder_layers = _layer_count(model, "encoder"), _layer_count(model, "decoder")
    encoder_heads = model.scalar("encoder/num_heads", d_model // 64)
    decoder_heads = model.scalar("decoder/num_heads", d_model // 64)
    settings = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    ids = _special_ids(_read_vocabulary(folder), vocab_size)
    multilingual = vocab_size >= 51865
    tied = model.aliases.get("decoder/projection/weight") == "decoder/embeddings/weight"
    config = {
        "model_type": "whisper", "architectures": ["WhisperForConditionalGeneration"],
        "vocab_size": vocab_size, "num_mel_bins": conv1.shape[1], "d_model": d_model,
        "encoder_layers": encoder_layers, "decoder_layers": decoder_layers, "num_hidden_layers": encoder_layers,
        "encoder_attention_heads": encoder_heads, "decoder_attention_heads": decoder_heads,
        "encoder_ffn_dim": model["encoder/layer_0/ffn/linear_0/weight"].shape[0] if encoder_layers else 4 * d_model,
        "decoder_ffn_dim": model["decoder/layer_0/ffn/linear_0/weight"].shape[0] if decoder_layers else 4 * d_model,
        "max_source_positions": model["encoder/position_encodings/encodings"].shape[0],
        "max_target_positions": model["decoder/position_encodings/encodings"].shape[0],
        "activation_function": "gelu", "scale_embedding": bool(model.scalar("decoder/scale_embeddings", 0)),
        "is_encoder_decoder": True, "tie_word_embeddings": tied, "use_cache": True,
        "bos_token_id": ids["sot"], "eos_token_id": ids["eot"], "pad_token_id": ids["eot"],
        "decoder_start_token_id": ids["sot"], "dtype": str(embeddings.dtype).removeprefix("torch."),
    }
    generation = {
        "decoder_start_token_id": ids["sot"], "bos_token_id": ids["sot"], "eos_token_id": ids["eot"],
        "pad_token_id": ids["eot"], "max_length": config["max_target_positions"],
        "suppress_tokens": list(settings.get("suppress_ids", [])),
        "begin_suppress_tokens": list(settings.get("suppress_ids_begin", [])),
        "no_timestamps_token_id": ids["no_timestamps"], "prev_sot_token_id": ids["prev"],
        "is_multilingual": multilingual, "return_timestamps": False, "max_initial_timestamp_index": 50,
    }
    if settings.get("alignment_heads"):
        generation["alignment_heads"] = [list(pair) for pair in settings["alignment_heads"]]
    if multilingual:  # language ids from the vocabulary (config.json's lang_ids may be off by one for .en models)
        generation["lang_to_id"] = ids["languages"]
        generation["task_to_id"] = {"transcribe": ids["transcribe"], "translate": ids["translate"]}
    return config, generation


def load_ctranslate2_whisper(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor],
                                                                 dict[str, Any]]:
    """Load a CTranslate2 Whisper folder as ``(config dict, HF-named state dict, generation config dict)``.

    Tensors keep the file's float dtype (float16 for faster-whisper models); int8/int16-quantized
    weights are dequantized to float32. The config loads in ``transformers.WhisperConfig(**config)``.

    Example:
        >>> config, state, generation = load_ctranslate2_whisper(whisper_tiny_en_dir())  # doctest: +SKIP
        >>> config["d_model"], state["model.decoder.embed_tokens.weight"].dtype  # doctest: +SKIP
        (384, torch.float16)
    """
    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    model = read_ctranslate2_model(folder / MODEL_FILE)
    if model.spec != "WhisperSpec":
        raise ValueError(f"{folder / MODEL_FILE} holds a CTranslate2 {model.spec!r}; kvgen reads WhisperSpec models "
                         "only from CTranslate2 files.")
    _dequantize(model)
    try:
        config, generation = _whisper_config(model, folder)
        check_config(config, folder / MODEL_FILE)
        state = _whisper_state_dict(model, config["encoder_layers"], config["decoder_layers"])
    except KeyError as e:
        raise ModelFileError(folder / MODEL_FILE, "the variables", "a complete Whisper model (convert it again with "
                             "ct2-transformers-converter)", f"not a complete Whisper model: {e.args[0]}") from None
    return config, state, generation
