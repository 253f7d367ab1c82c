"""Which model filled a cache: :func:`model_fingerprint` and :func:`check_cache_model`.

A cache's keys and values only mean something to the model that computed them. A fingerprint
identifies that model by its config and its weights; cache files record it
(:mod:`kvgen.cache.persist`) and every model's forward checks it (a pre-hook in
``kvgen.models.base``), so a cache of another model raises instead of producing garbage.
"""

from __future__ import annotations

import hashlib
import json
import weakref

import torch

from kvgen.cache.base import Cache

#: elements sampled from each weight tensor for the weights part
_SAMPLE = 2048
#: config fields that do not change what a cache holds (token ids, bookkeeping; the dtype is in the weights)
_CONFIG_IGNORED = frozenset({
    "name_or_path", "model_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype",
    "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "output_attentions", "output_hidden_states",
    "return_dict", "attn_implementation", "tokenizer_class", "auto_map",
})


class CacheModelMismatchError(ValueError):
    """A cache used with (or loaded for) a model other than the one that filled it."""


def model_fingerprint(model) -> dict[str, str]:
    """``{"config": sha256, "weights": sha256}`` of ``model``: what cache files record and forward checks.

    The config part hashes the canonical JSON of the config's fields that shape keys and values
    (not token ids or the dtype's name). The weights part hashes each weight tensor's name,
    dtype, shape and 2048 evenly spaced elements: cheap for any model size, and different for
    another checkpoint, a fine-tune or another dtype. It is computed once per model and
    remembered on it until a weight tensor is replaced or changed in place.

    Example:
        >>> fingerprint = model_fingerprint(model)   # doctest: +SKIP
        >>> sorted(fingerprint)                      # doctest: +SKIP
        ['config', 'weights']
    """
    tensors = _weight_tensors(model)
    key = tuple((name, t.data_ptr(), _version(t), t.dtype, tuple(t.shape), t.device) for name, t in tensors)
    memo = model.__dict__.get("_kvgen_weights_fingerprint")
    if memo is None or memo[0] != key:
        h, formats = hashlib.sha256(), _packed_formats(model)
        for name, t in tensors:
            h.update(f"{name}|{str(t.dtype).removeprefix('torch.')}|{tuple(t.shape)}|".encode())
            h.update(_sample(t, formats.get(id(t))).view(torch.uint8).numpy())
        memo = (key, h.hexdigest())
        model.__dict__["_kvgen_weights_fingerprint"] = memo
    return {"config": _config_digest(model.config), "weights": memo[1]}


def check_cache_model(cache: Cache, model) -> None:
    """Raise :class:`CacheModelMismatchError` when ``cache`` holds tokens of a model other than ``model``.

    "Other" means another config or other weights: a loaded cache is compared with the
    fingerprint it was saved with, a cache in memory with the model that last ran with it. An
    empty cache fits any model. The cache then remembers ``model`` (weakly), so further calls
    with it cost one comparison and ``cache.save(path)`` knows which fingerprint to record.

    Example:
        >>> cache = model(ids, past_key_values=DynamicCache()).past_key_values   # doctest: +SKIP
        >>> check_cache_model(cache, other_model)                                 # doctest: +SKIP
        Traceback (most recent call last):
        ...
        CacheModelMismatchError: past_key_values was filled by a different model (the weights differ) ...
    """
    previous = last_model(cache)
    if previous is model:
        return
    expected = cache.__dict__.get("model_fingerprint")
    if (expected is not None or previous is not None) and cache.get_seq_length() > 0:
        expected = expected or model_fingerprint(previous)
        actual = model_fingerprint(model)
        if actual != expected:
            raise mismatch_error(expected, actual, "past_key_values",
                                 "use that model, or a new cache (cache.reset() empties this one).")
    else:
        cache.__dict__.pop("model_fingerprint", None)  # empty: it belongs to whichever model fills it
    cache._model_ref = weakref.ref(model)


def last_model(cache: Cache):
    """The model that last ran with ``cache`` (``None``: none, or it is gone)."""
    ref = cache.__dict__.get("_model_ref")
    return ref() if ref is not None else None


def mismatch_error(recorded: dict, actual: dict, what: str, fix: str) -> CacheModelMismatchError:
    """The error for ``what``, filled by the model ``recorded``, used with the model ``actual`` (both named)."""
    differs = [part for part in ("config", "weights") if recorded.get(part) != actual.get(part)]
    verb = "differs" if differs == ["config"] else "differ"
    return CacheModelMismatchError(
        f"{what} was filled by a different model (the {' and the '.join(differs)} {verb}): the cache's model has "
        f"fingerprint [{_describe(recorded)}], this model [{_describe(actual)}]. A cache only fits the model that "
        f"made it: {fix}"
    )


def _describe(fingerprint: dict) -> str:
    return f"config {str(fingerprint.get('config'))[:16]}, weights {str(fingerprint.get('weights'))[:16]}"


def _config_digest(config) -> str:
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(vars(config))
    fields = {k: v for k, v in fields.items() if k not in _CONFIG_IGNORED and not k.startswith("_")}
    text = json.dumps(_canonical(fields), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical(value):
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if hasattr(value, "to_dict"):  # a nested config
        return _canonical(value.to_dict())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def _weight_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """Parameters and persistent buffers, each tied tensor once (non-persistent buffers such as rope tables vary)."""
    seen, out = set(), []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((name, tensor))
    return out


def _version(t: torch.Tensor) -> int:
    """The tensor's in-place modification counter (inference-mode tensors have none, and cannot change)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def _packed_formats(model) -> dict[int, int]:
    """The format of each stored-precision weight segment (:class:`~kvgen.models.packed.PackedWeight`), by tensor id."""
    from kvgen.models.packed import PackedWeight  # kvgen.models imports this module

    out = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, PackedWeight):
            out.update((id(data), format) for format, data in weight.segments)
    return out


def _sample(t: torch.Tensor, format: int | None = None) -> torch.Tensor:
    """``_SAMPLE`` evenly spaced elements of ``t`` (all of a small one), on the CPU: the same from every device.
    A packed weight segment (``format``) is sampled in GGUF row order, whichever layout this machine keeps it in
    (Q8_0 is in tiles of 16 rows only where integer dot products run)."""
    flat = t.detach().reshape(-1)
    n = flat.numel()
    positions = torch.arange(min(n, _SAMPLE), device=flat.device)
    if n > _SAMPLE:
        positions = positions * (n - 1) // (_SAMPLE - 1)
    if format is not None:
        from kvgen.models.packed import stored_positions

        positions = stored_positions(format, t, positions)
    return flat[positions].cpu().contiguous()
