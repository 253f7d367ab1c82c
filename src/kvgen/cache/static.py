"""Preallocated caches: :class:`StaticLayer`, :class:`StaticCache`.

Buffers have a fixed number of slots, writes go through ``index_copy_`` at
``cache_position`` and the fill level is a tensor, so a decode step has static shapes
and ``torch.compile`` traces it once.
"""

from __future__ import annotations

import torch

from kvgen.cache.base import Cache, CacheLayer, config_value, fixed_address, layer_kind, operation, text_config
from kvgen.cache.precision import kv_dtype, store, stored_dim
from kvgen.cache.registry import register_cache


def select_batch_rows(layer, names: tuple[str, ...], indices: torch.Tensor) -> None:
    """Keep (and reorder) batch rows ``indices`` of the preallocated buffers ``names`` of ``layer``.

    Same batch size: rows are copied in place, so compiled graphs that hold the buffers stay valid.
    """
    buffers = [getattr(layer, name) for name in names]
    if buffers[0] is not None:
        indices = indices.to(buffers[0].device)
        for name, buf in zip(names, buffers):
            if indices.shape[0] == buf.shape[0]:
                buf.copy_(buf.index_select(0, indices))
            else:
                setattr(layer, name, buf.index_select(0, indices))
    if layer.batch_size is not None:
        layer.batch_size = indices.shape[0]


def repeat_batch_rows(layer, names: tuple[str, ...], repeats: int) -> None:
    """Repeat every batch row of the buffers ``names`` of ``layer`` ``repeats`` times."""
    if getattr(layer, names[0]) is not None:
        for name in names:
            setattr(layer, name, getattr(layer, name).repeat_interleave(repeats, dim=0))
    if layer.batch_size is not None:
        layer.batch_size *= repeats


class StaticLayer(CacheLayer):
    """A layer with ``max_cache_len`` preallocated slots; slot ``i`` holds position ``i``.

    Under torch.compile ``update`` returns every slot (static shapes; the mask hides the
    empty ones); in eager mode only the slots up to the last filled one. Buffers are
    allocated on the first update (batch, device and dtype default to the
    first keys'), so the cache can be built before the model's device is known.
    """

    is_compileable = True

    def __init__(self, max_cache_len: int, batch_size: int | None = None, num_heads: int | None = None,
                 head_dim: int | None = None, device=None, dtype=None):
        if max_cache_len < 1:
            raise ValueError(f"max_cache_len must be positive, got {max_cache_len}")
        self.max_cache_len = max_cache_len
        self.batch_size, self.num_heads, self.head_dim = batch_size, num_heads, head_dim
        self.device, self.dtype = device, dtype
        self._k: torch.Tensor | None = None  # (B, H, max_cache_len, D)
        self._v: torch.Tensor | None = None
        self._seen: torch.Tensor | None = None  # (1,) int64: one past the highest written position
        self._positions: torch.Tensor | None = None  # (max_cache_len,)
        if None not in (batch_size, num_heads, head_dim, dtype):
            self._allocate(batch_size, num_heads, head_dim, head_dim, torch.device(device or "cpu"), dtype)

    def _allocate(self, batch, heads, k_dim, v_dim, device, dtype):
        k_dim, v_dim = stored_dim(dtype, k_dim), stored_dim(dtype, v_dim)  # (int8 rows carry their scales)
        self._k = torch.zeros(batch, heads, self.max_cache_len, k_dim, device=device, dtype=dtype)
        self._v = torch.zeros(batch, heads, self.max_cache_len, v_dim, device=device, dtype=dtype)
        self._seen = torch.zeros(1, dtype=torch.long, device=device)
        self._positions = torch.arange(self.max_cache_len, device=device)
        fixed_address(self._k, self._v, self._seen, self._positions)

    def update(self, key, value, cache_position):
        if self._k is None:
            if self.batch_size is not None and key.shape[0] != self.batch_size:
                raise ValueError(
                    f"StaticCache was built for max_batch_size={self.batch_size} but got a batch of "
                    f"{key.shape[0]}; build it with max_batch_size={key.shape[0]}"
                )
            self._allocate(key.shape[0], key.shape[1], key.shape[3], value.shape[3],
                           torch.device(self.device) if self.device is not None else key.device,
                           self.dtype or key.dtype)
        end = self._filled_end(cache_position)
        store(self._k, cache_position, key)
        store(self._v, cache_position, value)
        torch.maximum(self._seen, cache_position[-1:] + 1, out=self._seen)
        return self._k[:, :, :end], self._v[:, :, :end]

    def reserve(self, key, value, first):
        """Slots ``0 .. seen + T``, the new tokens' after the filled ones, where they start there (``first``).
        None (nothing changed) where it does not, or where ``update`` would allocate, refuse or convert: the caller
        then calls it."""
        seen = self.get_seq_length()
        end = seen + key.shape[2]
        if (self._k is None or end > self.max_cache_len or torch.compiler.is_compiling() or first != seen
                or key.shape[:2] + key.shape[3:] != self._k.shape[:2] + self._k.shape[3:]
                or value.shape[3] != self._v.shape[3] or key.dtype != self._k.dtype or key.device != self._k.device):
            return None
        self._seen.fill_(end)
        return self._k, self._v, 0, end, None

    def _filled_end(self, cache_position) -> int:
        """Slots to attend to: all of them under torch.compile (static shapes); else up to the last filled one."""
        if torch.compiler.is_compiling():
            return self.max_cache_len
        return max(self.get_seq_length(), int(cache_position[-1]) + 1)

    def key_positions(self, cache_position):
        if self._positions is None or self._positions.device != cache_position.device:
            self._positions = torch.arange(self.max_cache_len, device=cache_position.device)
        return self._positions[: self._filled_end(cache_position)]

    def check_cache_position(self, cache_position):
        last = int(cache_position.max())
        if last >= self.max_cache_len or int(cache_position.min()) < 0:
            raise ValueError(
                f"cache_position {last} does not fit a StaticCache of max_cache_len={self.max_cache_len}; "
                f"build the cache with max_cache_len >= {last + 1} (prompt plus new tokens)"
            )

    def get_seq_length(self):
        return 0 if self._seen is None else int(self._seen)

    def get_max_cache_shape(self):
        return self.max_cache_len

    @property
    def keys(self):
        return None if self._k is None else self._k[:, :, : self.get_seq_length()]

    @property
    def values(self):
        return None if self._v is None else self._v[:, :, : self.get_seq_length()]

    def reset(self):
        if self._k is not None:
            self._k.zero_()
            self._v.zero_()
            self._seen.zero_()

    def crop(self, max_length):
        if self._k is not None and max_length < self.get_seq_length():
            self._k[:, :, max_length:] = 0
            self._v[:, :, max_length:] = 0
            self._seen.fill_(max_length)

    def batch_tensor(self):
        return self._k

    def batch_select_indices(self, indices):
        select_batch_rows(self, ("_k", "_v"), indices)

    def batch_repeat_interleave(self, repeats):
        repeat_batch_rows(self, ("_k", "_v"), repeats)

    def nbytes(self):
        if self._k is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()


class StaticCache(Cache):
    """A preallocated cache of ``max_cache_len`` slots per layer, for ``torch.compile``.

    ``max_batch_size``, ``device`` and ``dtype`` are optional: when left out, they are
    taken from the first keys written. ``dtype`` is the precision keys and values are stored in; besides float
    dtypes, ``torch.int8`` stores int8 rows with a scale per 32 values (:mod:`kvgen.cache.precision`), which
    kvgen's attention reads as stored.

    Example:
        >>> cache = StaticCache(config=model.config, max_batch_size=1, max_cache_len=1024,
        ...                     device="cpu", dtype=torch.float32)         # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=20)  # doctest: +SKIP

    ``offloading=True`` preallocates the buffers on ``offload_device`` (CPU) and keeps only
    the layer being computed (and the next) on ``device`` (see :mod:`kvgen.cache.offload`).
    """

    def __init__(self, config=None, max_batch_size: int | None = None, max_cache_len: int | None = None,
                 device=None, dtype=None, batch_size: int | None = None, offloading: bool = False,
                 offload_only_non_sliding: bool = True, offload_device="cpu", **unused_for_compatibility):
        if config is None:
            raise ValueError("StaticCache needs the model's config: StaticCache(config=model.config, max_cache_len=...)")
        config = text_config(config)
        max_cache_len = max_cache_len or config_value(config, "max_position_embeddings")
        if max_cache_len is None:
            raise ValueError("StaticCache needs max_cache_len (the prompt plus the tokens to generate)")
        batch = max_batch_size or batch_size
        n_layers = config_value(config, "num_hidden_layers")
        kinds = config_value(config, "layer_types") or ["full_attention"] * n_layers
        attention_heads = config_value(config, "num_attention_heads")  # (None for a pure Mamba config)
        heads = config_value(config, "num_key_value_heads") or attention_heads
        head_dim = config_value(config, "head_dim") or (
            config_value(config, "hidden_size") // attention_heads if attention_heads else None)
        self.max_cache_len = max_cache_len
        # offloaded buffers are preallocated on the offload device, not on the compute device
        layer_device = offload_device if offloading and None not in (batch, dtype) else device
        super().__init__(layers=[
            layer_kind(kind)(config, batch, dtype, device) if layer_kind(kind)  # Mamba layers: fixed-size states
            else StaticLayer(max_cache_len, batch, heads, head_dim, layer_device, dtype)
            for kind in kinds])
        if offloading:
            operation("enable_offloading")(self, offload_device, only_non_sliding=offload_only_non_sliding,
                                           compute_device=device)

    def _empty_max_cache_shape(self):
        return self.max_cache_len


@register_cache("static")
def _static(config, batch_size, max_cache_len, device, dtype, cache_config):
    """``cache_config={"dtype": "int8"}`` (or float16, bfloat16, float32) stores keys and values in that precision
    (the serving engine's ``kv_dtype``); else in the model's dtype."""
    if isinstance(cache_config, dict) and "dtype" in cache_config:
        dtype = kv_dtype(cache_config["dtype"])
    return StaticCache(config=config, max_batch_size=batch_size, max_cache_len=max_cache_len,
                       device=device, dtype=dtype)
