"""Cache files: :func:`save_cache` (``cache.save(path)``) and :func:`load_cache` (``kvgen.load_cache``).

A cache file is one ``.safetensors`` file: the cache's tensors (``t0``, ``t1``, ...) and, in
the header's string ``__metadata__``, a JSON document (key ``"kvgen.cache"``) with its sha256
(key ``"kvgen.cache.sha256"``). The document holds:

* ``format`` (``"kvgen.cache"``), ``format_version`` (1) and ``kvgen_version``;
* a summary that the loaded cache must match: ``cache_class``, ``seq_length``, ``dtype`` and,
  per layer, its ``class`` (and the ``inner`` class an offloaded layer wraps), ``seq_length``,
  ``max_cache_shape`` and ``sliding_window``;
* ``fingerprint``: ``{"config": sha256, "weights": sha256}`` of the model that filled the cache
  (:func:`~kvgen.cache.fingerprint.model_fingerprint`), or ``null`` when unknown;
* ``tensors``: per tensor its ``dtype``, ``shape``, ``sha256`` of its bytes and ``path``
  (where it lives, e.g. ``cache.layers[3]._k``);
* ``objects`` and ``root``: the cache itself, every object with its class and attributes
  (:mod:`kvgen.cache.codec`), which is how every cache type, present or future, is saved
  with no code of its own. ``token_ids`` (the cached prefix) is one of those attributes.

Loading never unpickles and builds only kvgen's cache classes (see :mod:`kvgen.cache.codec`).
A truncated file, changed tensor bytes, edited JSON, missing or extra tensors, shapes or
lengths that disagree with the JSON, unknown classes and other format versions raise
:class:`CacheFileError`. The checksums detect damage, not forgery: whoever can write the file
can recompute them (though still not make kvgen run code of their choosing).
"""

from __future__ import annotations

import hashlib
import json
import os
import weakref
from pathlib import Path

import torch

from kvgen.cache.base import Cache, CacheLayer, register_operation
from kvgen.cache.codec import DescriptionError, decode, encode, place
from kvgen.cache.fingerprint import CacheModelMismatchError, last_model, mismatch_error, model_fingerprint

FORMAT_VERSION = 1
_META_KEY = "kvgen.cache"
_SHA_KEY = "kvgen.cache.sha256"


class CacheFileError(ValueError):
    """A file that cannot be loaded as a cache: not a kvgen cache file, another format version, damaged or edited."""


@register_operation("save")
def save_cache(cache: Cache, path: str | os.PathLike, model=None) -> None:
    """Write ``cache`` to ``path``, one safetensors file replaced atomically (format: this module's docstring).

    ``model``: whose fingerprint to record; by default the model that last ran with the cache
    (for a loaded cache not used since, the fingerprint it was loaded with).

    Example:
        >>> cache = model(**inputs, past_key_values=DynamicCache()).past_key_values  # doctest: +SKIP
        >>> save_cache(cache, "prompt.safetensors")   # the same as cache.save("prompt.safetensors")  # doctest: +SKIP
    """
    from safetensors.torch import save_file

    if not isinstance(cache, Cache):
        raise TypeError(f"save_cache saves a kvgen Cache, got {type(cache).__name__}")
    description, tensors, records = encode(cache)
    for key, record in records.items():
        record["sha256"] = _digest(tensors[key])
    if model is not None:
        fingerprint = model_fingerprint(model)
    elif last_model(cache) is not None:
        fingerprint = model_fingerprint(last_model(cache))
    else:
        fingerprint = cache.model_fingerprint
    document = {"format": "kvgen.cache", "format_version": FORMAT_VERSION, "kvgen_version": _kvgen_version(),
                **_summary(cache), "fingerprint": fingerprint, "tensors": records, **description}
    text = json.dumps(document, separators=(",", ":"))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={_META_KEY: text, _SHA_KEY: _sha(text)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_cache(path: str | os.PathLike, model=None, device=None) -> Cache:
    """Read a cache written by ``cache.save(path)``: the same class and layers, ready to continue decoding.

    With ``model``, raises :class:`~kvgen.cache.fingerprint.CacheModelMismatchError` unless the
    file was made by a model with the same config and weights. Without it, the cache keeps the
    file's fingerprint in ``cache.model_fingerprint``, and the forward of a model with another
    one raises. Tensors go to ``device`` (default: the model's device, else the CPU); offloaded
    layers go to their offload device. Raises :class:`CacheFileError` for anything but an
    intact kvgen cache file.

    Example:
        >>> import kvgen
        >>> cache = kvgen.load_cache("prompt.safetensors", model=model)                # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=20)  # doctest: +SKIP
    """
    path = Path(path)
    document, tensors = _read(path)
    try:
        cache = decode(document, tensors)
    except DescriptionError as e:
        raise CacheFileError(f"{path} cannot be loaded: {e}") from None
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, RuntimeError) as e:
        raise CacheFileError(f"{path}: the cache description is malformed ({type(e).__name__}: {e})") from None
    if not isinstance(cache, Cache):
        raise CacheFileError(f"{path} describes a {type(cache).__name__}, not a cache")
    summary = _summary(cache)
    recorded = {key: document.get(key) for key in summary}
    if summary != recorded:
        raise CacheFileError(f"{path}: the restored cache does not match the file's summary: "
                             f"{_first_difference(recorded, summary)}. The file was edited or damaged")
    fingerprint = document.get("fingerprint")
    if fingerprint is not None and not (isinstance(fingerprint, dict) and set(fingerprint) == {"config", "weights"}):
        raise CacheFileError(f"{path}: malformed model fingerprint {fingerprint!r}")
    if model is not None:
        if fingerprint is None:
            raise CacheModelMismatchError(
                f"{path} does not record which model filled the cache (it was saved without one), so it cannot be "
                "checked against this model: load it without model= if you know it fits, or save it with "
                "cache.save(path, model=model)"
            )
        actual = model_fingerprint(model)
        if actual != fingerprint:
            raise mismatch_error(fingerprint, actual, f"the cache in {path}",
                                 "load it with that model, or fill a new cache with this one.")
    if device is None:
        device = model.device if model is not None else "cpu"
    place(cache, torch.device(device))
    cache.model_fingerprint = fingerprint
    if model is not None:
        cache._model_ref = weakref.ref(model)
    return cache


# -- the summary ---------------------------------------------------------------------------------------

def _summary(cache: Cache) -> dict:
    layers = []
    for layer in getattr(cache, "layers", None) or []:
        entry = {"class": type(layer).__name__}
        inner = vars(layer).get("inner")
        if isinstance(inner, CacheLayer):
            entry["inner"] = type(inner).__name__
        entry["seq_length"] = _ask(layer.get_seq_length)
        entry["max_cache_shape"] = _ask(layer.get_max_cache_shape)
        entry["sliding_window"] = _ask(lambda: layer.sliding_window)
        layers.append(entry)
    return {"cache_class": type(cache).__name__, "seq_length": _ask(cache.get_seq_length), "dtype": _dtype(cache),
            "layers": layers}


def _ask(fn):
    """``fn()`` as a JSON scalar; ``None`` for what a layer kind does not have (e.g. the keys of a Mamba layer)."""
    try:
        value = fn()
    except (NotImplementedError, AttributeError, TypeError, IndexError):
        return None
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)


def _dtype(cache: Cache) -> str | None:
    """The dtype of the keys the cache returns (its first filled layer's); ``None`` when empty."""
    for layer in getattr(cache, "layers", None) or []:
        dtype = _ask(lambda: None if layer.keys is None else layer.keys.dtype)
        if dtype is not None:
            return dtype.removeprefix("torch.")
    return None


def _first_difference(recorded: dict, restored: dict) -> str:
    for key, value in restored.items():
        if key == "layers" and isinstance(recorded.get(key), list) and len(recorded[key]) == len(value):
            for i, (a, b) in enumerate(zip(recorded[key], value)):
                if a != b:
                    return f"layer {i}: the file says {a}, the restored layer is {b}"
        elif recorded.get(key) != value:
            return f"{key}: the file says {recorded.get(key)!r}, the restored cache {value!r}"
    return "?"


# -- reading and checking ------------------------------------------------------------------------------

def _read(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """The JSON document and the verified tensors of the file at ``path``."""
    from safetensors import safe_open

    if not path.is_file():
        raise FileNotFoundError(f"no cache file at {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            text = metadata.get(_META_KEY)
            if text is None:
                raise CacheFileError(f"{path} is a safetensors file but not a kvgen cache (it has no {_META_KEY!r} "
                                     "metadata): cache files are written by cache.save(path)")
            document = _parse(text, path)
            if metadata.get(_SHA_KEY) != _sha(text):
                raise CacheFileError(f"{path}: the cache description (JSON metadata) does not match its checksum: "
                                     "the file was edited or damaged; save the cache again")
            records = document.get("tensors")
            if not isinstance(records, dict) or not all(isinstance(r, dict) for r in records.values()):
                raise CacheFileError(f"{path}: the cache description has no valid list of tensors")
            names = set(f.keys())
            missing, extra = sorted(set(records) - names), sorted(names - set(records))
            if missing or extra:
                where = [f"{k} ({records[k].get('path')})" for k in missing[:5]]
                raise CacheFileError(f"{path}: tensors missing from the file: {where or 'none'}; tensors the "
                                     f"description does not list: {extra[:5] or 'none'}. The file is incomplete or "
                                     "was put together by hand; save the cache again")
            tensors = {name: _verified(f.get_tensor(name), records[name], name, path) for name in records}
    except CacheFileError:
        raise
    except Exception as e:  # safetensors' own errors: a truncated or garbled header or data
        raise CacheFileError(f"{path} is not a readable cache file (truncated or damaged?): {e}") from None
    return document, tensors


def _parse(text: str, path: Path) -> dict:
    try:
        document = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise CacheFileError(f"{path}: the cache description is not valid JSON ({e})") from None
    if not isinstance(document, dict) or document.get("format") != "kvgen.cache":
        raise CacheFileError(f"{path} is not a kvgen cache file")
    version = document.get("format_version")
    if version != FORMAT_VERSION:  # checked before the checksum: another version may compute it otherwise
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise CacheFileError(
            f"{path} has cache format version {version!r}; this kvgen reads version {FORMAT_VERSION}. "
            + ("It was written by a newer kvgen: upgrade kvgen to load it." if newer
               else "Fill the cache again and save it with this kvgen.")
        )
    return document


def _verified(t: torch.Tensor, record: dict, name: str, path: Path) -> torch.Tensor:
    where = f"tensor {name} ({record.get('path')})"
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype != record.get("dtype") or list(t.shape) != record.get("shape"):
        raise CacheFileError(f"{path}: {where} is {dtype} {list(t.shape)} in the file but {record.get('dtype')} "
                             f"{record.get('shape')} in the cache description: the file was edited or damaged")
    if _digest(t) != record.get("sha256"):
        raise CacheFileError(f"{path}: the bytes of {where} do not match their checksum: the file was damaged or "
                             "edited; save the cache again")
    # a fresh allocation: tensors read from the file may sit at addresses without the allocator's alignment, where
    # CPU kernels round differently (continuing a loaded cache would not match the original bit for bit)
    return t.clone()


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _kvgen_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("kvgen")
    except Exception:  # not installed as a distribution (a source checkout)
        return None
