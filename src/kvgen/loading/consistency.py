"""A model's config held to the rules every model of it must obey, before any weight is used.

:func:`check_config` checks a Hugging Face style config dict (read from ``config.json``, or
built from a GGUF's metadata, whose key names the errors then use); :func:`check_gguf_tensors`
checks a GGUF's tensor table against that config: every tensor the architecture needs, none
of a layer past the last, each of the shape the config implies.

Example:
    >>> check_config({"hidden_size": 64, "num_attention_heads": 5}, "config.json")
    Traceback (most recent call last):
    kvgen.loading.errors.ModelFileError: config.json: key num_attention_heads: expected a divisor of hidden_size (64), found 5
"""

from __future__ import annotations

import math
import os
from typing import Any

from kvgen.loading.errors import ModelFileError

_COUNTS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
           "intermediate_size", "vocab_size", "max_position_embeddings")
_POSITIVE_FLOATS = ("rms_norm_eps", "rope_theta", "layer_norm_epsilon")
_TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id", "decoder_start_token_id")


def check_config(config: dict[str, Any], source: str | os.PathLike, names: dict[str, str] | None = None,
                 vocabulary: int | None = None) -> None:
    """Refuse a config whose sizes cannot describe a model.

    Checked where present: counts are positive integers (a context length too); the heads
    divide the hidden size; the key/value heads divide the heads; epsilons and rope bases
    are positive and finite; special token ids lie inside the vocabulary (``vocabulary``
    when given: the tokenizer's size, else ``vocab_size``). ``names`` maps a config key to
    the name the file gives it (a GGUF metadata key) for the message.
    """
    names = names or {}

    def fail(key: str, expected: str, found: Any) -> ModelFileError:
        return ModelFileError(source, f"key {names.get(key, key)}", expected, f"{found!r}")

    for key in _COUNTS:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise fail(key, "a positive integer", value)
    for key in _POSITIVE_FLOATS:
        value = config.get(key)
        if value is not None and (not isinstance(value, (int, float)) or not 0 < value < math.inf):
            raise fail(key, "a positive finite number", value)
    hidden, heads, kv = config.get("hidden_size"), config.get("num_attention_heads"), config.get("num_key_value_heads")
    if hidden and heads and hidden % heads:
        raise fail("num_attention_heads", f"a divisor of {names.get('hidden_size', 'hidden_size')} ({hidden})", heads)
    if heads and kv and heads % kv:
        raise fail("num_key_value_heads", f"a divisor of {names.get('num_attention_heads', 'num_attention_heads')} "
                   f"({heads})", kv)
    size = vocabulary or config.get("vocab_size")
    for key in _TOKEN_IDS:
        ids = config.get(key)
        for token in ids if isinstance(ids, list) else [ids]:
            if token is not None and (not isinstance(token, int) or size and not 0 <= token < size):
                raise fail(key, f"a token id in 0..{size - 1} (the vocabulary)" if size else "a token id", token)
    if isinstance(config.get("text_config"), dict):
        check_config(config["text_config"], source)


def _gguf_shapes(config: dict[str, Any], arch: str) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """(required, optional) tensor shapes of one GGUF layer (``blk.N.`` names without the prefix) and the
    globals, innermost dimension first."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim, heads, kv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    q, k = heads * head_dim, kv * head_dim
    required = {"attn_norm.weight": [hidden], "attn_output.weight": [q, hidden], "ffn_norm.weight": [hidden],
                "ffn_down.weight": [inter, hidden],
                "ffn_up.weight": [hidden, 2 * inter] if arch == "phi3" else [hidden, inter]}
    if arch == "phi3":
        required["attn_qkv.weight"] = [hidden, q + 2 * k]
    else:
        required.update({"attn_q.weight": [hidden, q], "attn_k.weight": [hidden, k], "attn_v.weight": [hidden, k],
                         "ffn_gate.weight": [hidden, inter]})
    if arch in ("gemma2", "gemma3"):
        required.update({"post_attention_norm.weight": [hidden], "post_ffw_norm.weight": [hidden]})
    norms = {"attn_q_norm.weight": [head_dim], "attn_k_norm.weight": [head_dim]}
    if arch in ("qwen3", "gemma3"):
        required.update(norms)
    optional = {**norms, "attn_q.bias": [q], "attn_k.bias": [k], "attn_v.bias": [k], "attn_qkv.bias": [q + 2 * k],
                "attn_output.bias": [hidden]}
    return required, optional


def check_gguf_tensors(config: dict[str, Any], arch: str, shapes: dict[str, list[int]],
                       path: str | os.PathLike, vocabulary: int | None) -> None:
    """Refuse a GGUF whose tensors (``shapes``: name -> dims innermost first) are not those of ``config``.

    ``vocabulary`` is the number of tokens in the file's tokenizer: the embedding holds a row
    for each at least.
    """
    hidden, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    rows = shapes.get("token_embd.weight", [hidden, 0])[-1]
    if vocabulary is not None and rows < vocabulary:
        raise ModelFileError(path, "tensor token_embd.weight", f"a row for each of the {vocabulary} tokens of "
                             "tokenizer.ggml.tokens", f"{rows} rows")
    expected = {"token_embd.weight": [hidden, vocab], "output_norm.weight": [hidden]}
    optional = {"output.weight": [hidden, vocab]}
    rotary = config.get("partial_rotary_factor", 1.0) * config["head_dim"]
    optional.update({f"rope_factors_{kind}.weight": [int(rotary) // 2] for kind in ("long", "short")})
    required, per_layer_optional = _gguf_shapes(config, arch)
    for layer in range(layers):
        expected.update({f"blk.{layer}.{name}": shape for name, shape in required.items()})
        optional.update({f"blk.{layer}.{name}": shape for name, shape in per_layer_optional.items()})
    sizes = (f"from the metadata: hidden {hidden}, heads {config['num_attention_heads']}, key/value heads "
             f"{config['num_key_value_heads']}, head dim {config['head_dim']}, feed-forward "
             f"{config['intermediate_size']}, vocabulary {vocab}")
    missing = [name for name in expected if name not in shapes]
    if missing:
        raise ModelFileError(path, f"tensor {missing[0]}", f"the tensors of a {layers}-layer {arch} model",
                             f"{len(missing)} missing: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
    for name, shape in shapes.items():
        want = expected.get(name, optional.get(name))
        if want is None and name.startswith("blk.") and int(name.split(".")[1]) >= layers:
            raise ModelFileError(path, f"tensor {name}", f"layers 0..{layers - 1} ({arch}.block_count)",
                                 f"a tensor of layer {name.split('.')[1]}")
        if want is not None and list(shape) != want:
            raise ModelFileError(path, f"tensor {name}", f"shape {want} {sizes}", f"shape {list(shape)}")
