"""The cache container and the per-layer base class.

A :class:`Cache` is a list of per-layer objects (:class:`CacheLayer`). Every strategy
(growing, preallocated, windowed, quantized, ...) is a layer class; the public cache
classes only choose which layers to build. Models talk to the container alone:

* ``cache.update(key, value, layer_idx, {"cache_position": pos})`` stores the new
  keys/values and returns everything the layer attends to;
* ``cache.key_positions(layer_idx, pos)`` tells which absolute positions those
  returned slots hold (``-1`` for an empty slot), so ``kvgen.masks`` can build the
  attention mask without knowing the cache type.

Where every layer can (``CacheLayer.reserve``), ``cache.reserve(keys, values, first)`` makes room
for a step's new keys/values in all layers at once and returns the buffers to write them
into, so that a fused decode step (:mod:`kvgen.models.decode_stack`) runs every layer in C++.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterator

import torch

LegacyCache = tuple[tuple[torch.Tensor, torch.Tensor], ...]

#: what modules that import this one add to every cache, by name (they register on import, which
#: ``kvgen.cache`` does for all of them): ``fork`` and ``share_rows`` (fork.py), ``save`` (persist.py),
#: ``enable_offloading`` (offload.py). This module imports none of them.
_OPERATIONS: dict[str, Callable] = {}
#: layer kinds of a config's ``layer_types`` other than attention -> the factory of their layers (ssm.py: Mamba)
_LAYER_KINDS: dict[str, Callable] = {}


def register_operation(name: str) -> Callable[[Callable], Callable]:
    """Make the decorated function the cache operation ``name`` (see ``_OPERATIONS``)."""
    def add(fn: Callable) -> Callable:
        _OPERATIONS[name] = fn
        return fn

    return add


def operation(name: str) -> Callable:
    """The cache operation ``name``, registered by its module when ``kvgen.cache`` was imported."""
    try:
        return _OPERATIONS[name]
    except KeyError:
        raise RuntimeError(f"no cache operation {name!r}: import kvgen.cache (it registers every one)") from None


def register_layer_kind(kinds: tuple[str, ...], factory: Callable) -> None:
    """Build layers of the config ``layer_types`` in ``kinds`` with ``factory(config, batch, dtype, device)``."""
    _LAYER_KINDS.update(dict.fromkeys(kinds, factory))


def layer_kind(kind: str) -> Callable | None:
    """The factory registered for layers of ``kind`` (None: an attention layer, the caller's own)."""
    return _LAYER_KINDS.get(kind)


class CacheLayer:
    """Storage of one attention layer. Subclasses choose a growth policy.

    Tensors are laid out ``(batch, kv_heads, slots, head_dim)``.
    """

    #: tokens a query may look back (``None``: unlimited); used for the mask
    sliding_window: int | None = None
    #: True when the layer preallocates (static shapes, usable under torch.compile)
    is_compileable: bool = False
    #: True when ``update`` takes the model's rotary embedding as ``rotary_emb=`` (from ``cache_kwargs``),
    #: for layers that re-rotate cached keys (attention sinks)
    needs_rotary: bool = False

    def update(self, key: torch.Tensor, value: torch.Tensor,
               cache_position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``key``/``value`` (B, H, T, D) at ``cache_position`` (T,); return what to attend to."""
        raise NotImplementedError

    def reserve(self, key: torch.Tensor, value: torch.Tensor, first: int) -> tuple | None:
        """Room made for the new keys/values from position ``first`` on (``cache_position[0]``) without writing
        them: ``(keys, values, start, end, slots)``, buffers (B, H, slots, stored width) whose slots ``start ..
        end - 1`` are what ``update(key, value, cache_position)`` would return, the caller storing the new T tokens
        (in the buffers' precision, :mod:`kvgen.cache.precision`) into the last T of them, or where ``slots`` (T,)
        says (a paged pool's) when it is not ``None`` (the fused decode step, :mod:`kvgen.models.decode_stack`,
        which takes the slot range rather than a view: two ``narrow`` calls a layer were a twentieth of a SmolLM2
        step). Only the shapes and dtypes of ``key``/``value`` (B, H, T, D) are read. ``None`` (the default),
        changing nothing: the layer stores only through ``update`` (it quantizes, re-rotates or moves what it
        stores). A subclass that changes what ``update`` stores changes ``reserve`` alike."""
        return None

    def key_positions(self, cache_position: torch.Tensor) -> torch.Tensor:
        """Absolute position held by each slot that ``update`` will return for ``cache_position``; -1 if empty."""
        raise NotImplementedError

    def key_range(self, cache_position: torch.Tensor) -> range | None:
        """What :meth:`key_positions` returns, as a ``range``, when the slots hold consecutive positions; ``None``
        (the default): ask ``key_positions``. Lets a decode step's mask be settled without tensors. A layer that
        overrides ``key_positions`` overrides this too."""
        return None

    def block_mask(self, sliding_window: int | None):
        """A block-sparse mask (flex_attention's ``BlockMask``) of this pass over what ``update`` returns, where
        the layer reads only some blocks of it (a ``block_sparse`` paged pool); ``None`` (the default): the mask
        comes from :meth:`key_positions`."""
        return None

    def check_cache_position(self, cache_position: torch.Tensor) -> None:
        """Raise a clear error when ``cache_position`` cannot be written to this layer."""

    def get_seq_length(self) -> int:
        """Number of positions of the sequence this layer has seen (not how many it still stores)."""
        raise NotImplementedError

    def get_max_cache_shape(self) -> int | None:
        """Most slots the layer can hold, ``None`` when it grows without bound."""
        return None

    @property
    def keys(self) -> torch.Tensor | None:
        """The stored keys (B, H, stored, D), oldest first, or ``None`` before the first update."""
        raise NotImplementedError

    @property
    def values(self) -> torch.Tensor | None:
        raise NotImplementedError

    def reset(self) -> None:
        raise NotImplementedError

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot be cropped")

    def checkpoint(self, new_tokens: int) -> Callable[[], None] | None:
        """Before ``new_tokens`` more are written: ``None`` when ``crop`` can later take the layer back exactly to
        its present length (the default), else a function that puts it back as it is now (speculative decoding
        verifies drafts, then drops the rejected ones)."""
        return None

    def chunk_limit(self) -> int | None:
        """Most tokens one ``update`` can take now and still give each of them what one-by-one updates would
        (``None``: any number). Speculative decoding splits its verifying pass to stay exact."""
        return None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep (and reorder) the batch rows ``indices`` (a checked LongTensor); used for beams and filtering."""
        raise NotImplementedError

    def batch_tensor(self) -> torch.Tensor | None:
        """A stored tensor whose first dimension is the batch (``None`` while empty), to check row indices against."""
        return self.keys

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError

    def read_ssm_states(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """State-space layers: ``(conv_state, ssm_state)``, ``(None, None)`` before the first token."""
        raise TypeError(self._not_ssm())

    def write_ssm_states(self, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                         cache_position: torch.Tensor) -> None:
        """State-space layers: store the states reached after the tokens at ``cache_position``."""
        raise TypeError(self._not_ssm())

    def _not_ssm(self) -> str:
        return (f"{type(self).__name__} holds attention keys and values, not the conv/SSM states of a Mamba "
                "mixer: build the cache from the model's config (DynamicCache(config=model.config), "
                "MambaCache(model.config, ...)) so that its Mamba layers get state-space layers")

    def nbytes(self) -> int:
        """Bytes allocated by this layer's tensors."""
        return 0

    def map_tensors(self, fn) -> None:
        """Replace every tensor the layer stores by ``fn(tensor)`` (offloading moves layers with it).

        The default covers tensor attributes and attributes with a ``map_tensors`` method of
        their own (e.g. quantized stores), and skips everything else (shared scratch buffers);
        a layer that keeps tensors elsewhere, or views of its own tensors, overrides it.
        """
        for name, value in list(vars(self).items()):
            if isinstance(value, torch.Tensor):
                setattr(self, name, fn(value))
            elif not isinstance(value, type) and callable(getattr(value, "map_tensors", None)):
                value.map_tensors(fn)


def snapshot(layer: CacheLayer) -> Callable[[], None]:
    """A function that puts ``layer``'s tensors (in place: buffers keep their address) and counters back as now."""
    saved = {name: value.clone() if isinstance(value, torch.Tensor) else copy.copy(value)
             for name, value in vars(layer).items()}

    def restore() -> None:
        for name, value in saved.items():
            current = vars(layer).get(name)
            if (isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor)
                    and current.shape == value.shape and current.dtype == value.dtype):
                current.copy_(value)
            else:
                setattr(layer, name, value)

    return restore


class Cache:
    """A list of per-layer caches with the Hugging Face cache API.

    ``layer_factory`` builds layer ``i`` on first use when ``layers`` does not cover it,
    so a cache created without a model config grows to however many layers use it.

    Example:
        >>> import torch
        >>> from kvgen import DynamicCache
        >>> cache = DynamicCache()
        >>> k = v = torch.zeros(1, 2, 3, 4)
        >>> keys, values = cache.update(k, v, 0, {"cache_position": torch.arange(3)})
        >>> cache.get_seq_length(), tuple(keys.shape)
        (3, (1, 2, 3, 4))
    """

    #: ``{"config": ..., "weights": ...}`` of the model that filled a loaded cache (see :mod:`kvgen.cache.persist`)
    model_fingerprint: dict[str, str] | None = None

    def __init__(self, layers: list[CacheLayer] | None = None, layer_factory=None):
        self.layers: list[CacheLayer] = list(layers or [])
        self._layer_factory = layer_factory
        #: (B, n) ids of the first n cached positions when known, so a reused cache can be checked
        #: against a new prompt (``None``: unknown, e.g. filled from embeddings or a legacy tuple)
        self.token_ids: torch.Tensor | None = None

    # -- the model-facing interface ------------------------------------------------------------------
    def layer(self, layer_idx: int) -> CacheLayer:
        while len(self.layers) <= layer_idx:
            if self._layer_factory is None:
                raise IndexError(
                    f"{type(self).__name__} has {len(self.layers)} layers; layer {layer_idx} was asked for. "
                    "Build the cache with the model's config (config=model.config)."
                )
            self.layers.append(self._layer_factory(len(self.layers)))
        return self.layers[layer_idx]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               cache_kwargs: dict[str, Any] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new keys/values (B, H, T, D) of ``layer_idx``; return the keys/values to attend to."""
        cache_position = (cache_kwargs or {}).get("cache_position")
        layer = self.layer(layer_idx)
        if cache_position is None:
            start = layer.get_seq_length()
            cache_position = torch.arange(start, start + key_states.shape[-2], device=key_states.device)
        if layer.needs_rotary:
            return layer.update(key_states, value_states, cache_position,
                                rotary_emb=(cache_kwargs or {}).get("rotary_emb"))
        return layer.update(key_states, value_states, cache_position)

    def key_positions(self, layer_idx: int, cache_position: torch.Tensor) -> torch.Tensor:
        return self.layer(layer_idx).key_positions(cache_position)

    def key_range(self, layer_idx: int, cache_position: torch.Tensor) -> range | None:
        """:meth:`CacheLayer.key_range` of layer ``layer_idx``."""
        return self.layer(layer_idx).key_range(cache_position)

    def block_mask(self, layer_idx: int, sliding_window: int | None):
        """:meth:`CacheLayer.block_mask` of layer ``layer_idx``."""
        return self.layer(layer_idx).block_mask(sliding_window)

    def reserves(self) -> bool:
        """Whether every layer this cache holds can :meth:`reserve` (a static cache's from the start)."""
        return bool(self.layers) and all(type(layer).reserve is not CacheLayer.reserve for layer in self.layers)

    def reserve(self, keys: list[torch.Tensor], values: list[torch.Tensor], first: int) -> list[tuple] | None:
        """:meth:`CacheLayer.reserve` of layers 0 .. len(keys) - 1 for the new ``keys[i]``/``values[i]``
        (B, Hkv, T, D) from position ``first`` on: per layer, ``(keys, values, start, end, slots)``, the buffers to
        store the new tokens into (the last T of slots ``start .. end - 1``, or ``slots``) and then attend to;
        ``None``, changing nothing, unless every layer can reserve."""
        n = len(keys)
        layers = self.layers[:n] if len(self.layers) >= n else [self.layer(i) for i in range(n)]
        if any(kind.reserve is CacheLayer.reserve for kind in set(map(type, layers))):
            return None
        reserved = [layer.reserve(k, v, first) for layer, k, v in zip(layers, keys, values)]
        if any(r is None for r in reserved):  # a layer declined (a static layer without room): the others undone
            for layer, k, r in zip(layers, keys, reserved):
                if r is not None:
                    layer.crop(layer.get_seq_length() - k.shape[2])
            return None
        return reserved

    def read_ssm_states(self, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """``(conv_state, ssm_state)`` of state-space (Mamba) layer ``layer_idx``; ``(None, None)`` when it is empty."""
        return self.layer(layer_idx).read_ssm_states()

    def write_ssm_states(self, layer_idx: int, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                         cache_position: torch.Tensor) -> None:
        """Store the states of state-space layer ``layer_idx`` after the new tokens at ``cache_position``."""
        self.layer(layer_idx).write_ssm_states(conv_state, ssm_state, cache_position)

    def mask_group(self, layer_idx: int) -> tuple:
        """Layers in the same group share one attention mask for a given forward pass."""
        layer = self.layer(layer_idx)
        return (type(layer), layer.sliding_window, layer.get_max_cache_shape())

    def check_cache_position(self, cache_position: torch.Tensor) -> None:
        """Validate once per forward pass that ``cache_position`` fits every kind of layer."""
        seen: set[tuple] = set()
        for i in range(max(len(self.layers), 1)):
            group = self.mask_group(i)
            if group not in seen:
                seen.add(group)
                self.layer(i).check_cache_position(cache_position)

    def record_token_ids(self, input_ids: torch.Tensor | None, cache_position: torch.Tensor) -> None:
        """Remember which token ids were written at ``cache_position`` (called by models, outside compile)."""
        start = _first_last(cache_position)[0]
        known = self.token_ids
        if (input_ids is None or (known is None and start > 0) or
                (known is not None and (known.shape[0] != input_ids.shape[0] or start > known.shape[1]))):
            self.token_ids = None
            return
        prefix = input_ids[:, :0] if known is None else known if known.shape[1] == start else known[:, :start]
        self.token_ids = torch.cat([prefix, input_ids.to(prefix.device)], dim=1)

    def common_prefix_length(self, input_ids: torch.Tensor) -> int:
        """How many leading cached positions hold exactly ``input_ids``' tokens (all of them when unknown)."""
        seen = self.get_seq_length()
        known = self.token_ids
        if known is None or known.shape[0] != input_ids.shape[0] or known.shape[1] < seen:
            return seen
        n = min(seen, input_ids.shape[1])
        same = (known[:, :n] == input_ids[:, :n].to(known.device)).all(dim=0)  # (n,)
        return int(same.long().cumprod(0).sum())

    def keep_common_prefix(self, input_ids: torch.Tensor) -> int:
        """Crop to the leading tokens held that ``input_ids`` (B, L) starts with, at most ``L - 1`` (so the last
        one is fed again, for its logits); return how many are kept.

        A cache that cannot go back that far (a wrapped ring buffer, a Mamba state) is reset
        (0 kept). Raises when it holds more tokens than ``input_ids`` without knowing which.
        """
        seen, length = self.get_seq_length(), input_ids.shape[1]
        common = self.common_prefix_length(input_ids) if seen else 0
        if common > length:  # (token ids unknown: all of them count as shared)
            raise ValueError(f"the cache holds {seen} tokens but input_ids has only {length}: pass the whole "
                             "sequence (the cached prefix followed by the new tokens)")
        keep = min(common, length - 1)
        if keep < seen:
            try:
                self.crop(keep)
            except ValueError:  # e.g. a ring buffer that wrapped, a Mamba state: refill it
                self.reset()
                keep = 0
        return keep

    # -- sizes -------------------------------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Length of the sequence seen so far (the next token's ``cache_position``)."""
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].get_seq_length()

    def get_max_cache_shape(self, layer_idx: int = 0) -> int | None:
        if layer_idx >= len(self.layers):
            return self._empty_max_cache_shape()
        return self.layers[layer_idx].get_max_cache_shape()

    def _empty_max_cache_shape(self) -> int | None:
        return None

    def get_max_length(self) -> int | None:
        """Older spelling of :meth:`get_max_cache_shape`."""
        return self.get_max_cache_shape()

    @property
    def is_compileable(self) -> bool:
        return bool(self.layers) and all(layer.is_compileable for layer in self.layers)

    def nbytes(self) -> int:
        """Bytes allocated by all layers."""
        return sum(layer.nbytes() for layer in self.layers)

    # -- editing -----------------------------------------------------------------------------------
    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        self.token_ids = None

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions (negative: drop that many from the end)."""
        if max_length < 0:
            max_length = self.get_seq_length() + max_length
        for layer in self.layers:
            layer.crop(max(max_length, 0))
        if self.token_ids is not None:
            self.token_ids = self.token_ids[:, :max(max_length, 0)]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Reorder the batch rows (beam search); every layer and every part of it follows."""
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor | list[int] | tuple[int, ...]) -> None:
        """Keep (and reorder) batch rows ``indices``: a 1-D integer tensor, list or tuple (see :func:`row_indices`)."""
        indices = row_indices(indices, self.layers)
        for layer in self.layers:
            layer.batch_select_indices(indices)
        if self.token_ids is not None:
            self.token_ids = self.token_ids.index_select(0, indices.to(self.token_ids.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)
        if self.token_ids is not None:
            self.token_ids = self.token_ids.repeat_interleave(repeats, dim=0)

    def fork(self, n: int) -> list["Cache"]:
        """``n`` caches that share this cache's tokens without copying them (copy-on-write).

        Each can be passed as ``past_key_values`` for a different continuation; this cache
        keeps working too. Growing and preallocated layers can be forked (see
        :mod:`kvgen.cache.fork`); other kinds raise a clear error.
        """
        return operation("fork")(self, n)

    def share_rows(self, repeats: int) -> None:
        """Like :meth:`batch_repeat_interleave`, but the repeated rows share storage where the layers allow."""
        operation("share_rows")(self, repeats)

    # -- files -------------------------------------------------------------------------------------
    def save(self, path, model=None) -> None:
        """Write the cache to ``path`` (one safetensors file); ``kvgen.load_cache(path, model=model)`` reads it back.

        ``model``: whose fingerprint to record (default: the model that last ran with the cache).
        See :mod:`kvgen.cache.persist` for the format.

        Example:
            >>> cache.save("prompt.safetensors")                                  # doctest: +SKIP
            >>> cache = kvgen.load_cache("prompt.safetensors", model=model)       # doctest: +SKIP
        """
        operation("save")(self, path, model=model)

    # -- legacy views ------------------------------------------------------------------------------
    def to_legacy_cache(self) -> LegacyCache:
        """The stored keys/values as a tuple of ``(key, value)`` pairs, one per layer."""
        out = []
        for i, layer in enumerate(self.layers):
            if layer.keys is None:
                raise ValueError(f"layer {i} of the cache is empty; there is nothing to convert")
            out.append((layer.keys, layer.values))
        return tuple(out)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[layer_idx]
        return layer.keys, layer.values

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for layer in self.layers:
            yield layer.keys, layer.values

    @property
    def key_cache(self) -> list[torch.Tensor]:
        return [layer.keys for layer in self.layers]

    @property
    def value_cache(self) -> list[torch.Tensor]:
        return [layer.values for layer in self.layers]

    @property
    def conv_states(self) -> list[torch.Tensor | None]:
        """Conv state (B, d_inner, d_conv) of each state-space layer (``None`` for the other layers)."""
        return [getattr(layer, "conv_state", None) for layer in self.layers]

    @property
    def ssm_states(self) -> list[torch.Tensor | None]:
        """SSM state (B, d_inner, d_state) of each state-space layer (``None`` for the other layers)."""
        return [getattr(layer, "ssm_state", None) for layer in self.layers]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers={len(self.layers)}, seq_length={self.get_seq_length()})"


def fixed_address(*tensors: torch.Tensor) -> None:
    """Mark a compileable layer's GPU buffers, which compiled decode steps write in place, as kept at one address.

    torch.compile's CUDA graphs (the "reduce-overhead" mode kvgen compiles GPU decode steps with) can then
    replay those writes; without the mark they skip graphs for a step that mutates its inputs.
    """
    for tensor in tensors:
        if tensor.is_cuda:
            torch._dynamo.mark_static_address(tensor)


def _first_last(cache_position: torch.Tensor) -> tuple[int, int]:
    """The first and last entries of a 1-D ``cache_position`` (one read for a decode step's single entry)."""
    if cache_position.shape[0] == 1:
        only = int(cache_position)  # (indexing first would make a tensor: 5x slower)
        return only, only
    return int(cache_position[0]), int(cache_position[-1])


def check_next_positions(cache_position: torch.Tensor, seen: int, holder: str, hint: str) -> None:
    """Raise ``ValueError`` unless ``cache_position`` (T,) is ``seen .. seen + T - 1`` (a layer that only appends).

    ``holder`` names the layer and its verb ("this DynamicLayer holds"); ``hint`` says how to fix the call.
    """
    t = cache_position.shape[0]
    first, last = _first_last(cache_position)
    if first != seen or last != seen + t - 1:
        raise ValueError(f"cache_position runs {first}..{last} but {holder} {seen} tokens, so the next positions "
                         f"must be {seen}..{seen + t - 1}. {hint}")


def row_indices(indices, layers) -> torch.Tensor:
    """``indices`` (a 1-D integer tensor, list or tuple of batch rows) as a LongTensor, checked against ``layers``.

    The batch size and device are those of the first layer that stores anything; negative
    indices count from the end, as in Python. Raises ``ValueError`` for anything but a 1-D
    sequence of integers and ``IndexError`` for a row the cache does not hold.
    """
    if isinstance(indices, torch.Tensor):
        rows = indices
    else:
        try:
            rows = torch.as_tensor(indices) if len(indices) else torch.zeros(0, dtype=torch.long)
        except (TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"batch row indices must be a 1-D tensor, list or tuple of integers, got {indices!r}"
                             ) from error
    if rows.dim() != 1:
        raise ValueError(f"batch row indices must be 1-D, got shape {tuple(rows.shape)}: {indices!r}")
    if rows.dtype == torch.bool:
        raise ValueError("batch row indices must be integers, got a boolean mask; pass mask.nonzero().flatten() "
                         "to keep its True rows")
    if rows.is_floating_point() or rows.is_complex():
        raise ValueError(f"batch row indices must be integers, got {rows.dtype} values; convert them with .long()")
    stored = next((t for t in (layer.batch_tensor() for layer in layers) if t is not None), None)
    if stored is None:  # nothing stored yet: nothing to check against
        return rows.long()
    batch = stored.shape[0]
    if rows.numel():
        low, high = (int(v) for v in torch.aminmax(rows))
        if low < -batch or high >= batch:
            bad = low if low < -batch else high
            raise IndexError(f"batch row index {bad} is out of range: the cache holds {batch} rows "
                             f"(valid indices: {-batch}..{batch - 1})")
        if low < 0:
            rows = rows.remainder(batch)
    return rows.to(device=stored.device, dtype=torch.long)


def map_nested(value, fn):
    """``value`` with every tensor in it replaced by ``fn(tensor)``: tensors, lists, tuples and dicts of them.

    Objects with a ``map_tensors`` method are mapped in place; anything else is returned as is.
    """
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, list):
        return [map_nested(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(map_nested(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: map_nested(v, fn) for k, v in value.items()}
    if not isinstance(value, type) and callable(getattr(value, "map_tensors", None)):
        value.map_tensors(fn)
    return value


def config_value(config, name: str, default=None):
    """Read ``name`` from a config object or dict (``None`` config gives ``default``)."""
    if config is None:
        return default
    if isinstance(config, dict):
        return config.get(name, default)
    return getattr(config, name, default)


def text_config(config):
    """The decoder part of a config that nests one (``text_config``), else the config itself."""
    return config_value(config, "text_config", None) or config
