"""Growing caches: :class:`DynamicLayer`, :class:`DynamicSlidingWindowLayer`, :class:`DynamicCache`.

Growth is amortised: a layer keeps a buffer with spare room and grows it geometrically,
so appending one token writes one slot instead of copying the whole cache (the
reference's ``torch.cat`` per token is quadratic in memory traffic). ``update`` returns
views into the buffer.
"""

from __future__ import annotations

import torch

from kvgen.cache.base import (Cache, CacheLayer, LegacyCache, check_next_positions, config_value, layer_kind,
                              operation, text_config)
from kvgen.cache.codec import register_persistable
from kvgen.cache.registry import register_cache

_ROUND = 128  # slots are allocated in multiples of this (by default)


def _round_up(n: int, step: int = _ROUND) -> int:
    return -(-n // step) * step


class DynamicLayer(CacheLayer):
    """A layer that keeps every token, in a buffer that grows by 1.5x when full.

    ``_start`` is the first live slot and ``_end`` one past the last; slot ``i`` holds
    absolute position ``_seen - (_end - i)``.
    """

    granularity = _ROUND  # (class default: caches saved before this attribute existed load with it)

    def __init__(self, granularity: int = _ROUND) -> None:
        self.granularity = granularity  # slots are allocated in multiples of this (forks use small ones)
        self._k: torch.Tensor | None = None  # (B, H, capacity, D)
        self._v: torch.Tensor | None = None
        self._start = 0
        self._end = 0
        self._seen = 0

    # -- storage -----------------------------------------------------------------------------------
    def _make_room(self, extra: int) -> None:
        """Make ``extra`` free slots after ``_end`` (there are fewer), compacting or growing the buffer."""
        capacity = self._k.shape[2]
        live = self._end - self._start
        if self._start > 0 and live + extra <= capacity and self._start >= live:
            # Enough dead room at the front: move the live part down (copies at most `live` slots).
            self._k[:, :, :live] = self._k[:, :, self._start:self._end]
            self._v[:, :, :live] = self._v[:, :, self._start:self._end]
        else:
            new_capacity = _round_up(max(live + extra, capacity * 3 // 2), self.granularity)
            k = self._k.new_empty(*self._k.shape[:2], new_capacity, self._k.shape[3])
            v = self._v.new_empty(*self._v.shape[:2], new_capacity, self._v.shape[3])
            k[:, :, :live] = self._k[:, :, self._start:self._end]
            v[:, :, :live] = self._v[:, :, self._start:self._end]
            self._k, self._v = k, v
        self._start, self._end = 0, live

    def _claim(self, key: torch.Tensor, value: torch.Tensor) -> int:
        """Room for ``key``/``value``'s T new slots, counted as held; returns the first of them (to be written)."""
        b, h, t, d = key.shape  # (one shape read per tensor: this runs for every layer of every step)
        if self._k is None:
            capacity = _round_up(t + 1, self.granularity)
            self._k = key.new_empty(b, h, capacity, d)
            self._v = value.new_empty(value.shape[0], value.shape[1], capacity, value.shape[3])
        else:
            held_b, held_h, capacity, _ = self._k.shape
            if b != held_b or h != held_h:
                raise ValueError(f"new keys have batch {b} and {h} heads but the cache holds batch {held_b} with "
                                 f"{held_h} heads; use one cache per batch shape")
            if self._end + t > capacity:
                self._make_room(t)
        first = self._end
        self._end += t
        self._seen += t
        return first

    def _append(self, key: torch.Tensor, value: torch.Tensor) -> None:
        first, t = self._claim(key, value), key.shape[2]
        self._k.narrow(2, first, t).copy_(key)  # narrow: a few microseconds less than [:, :, a:b] per step
        self._v.narrow(2, first, t).copy_(value)

    def _live(self) -> tuple[torch.Tensor, torch.Tensor]:
        live = self._end - self._start
        return self._k.narrow(2, self._start, live), self._v.narrow(2, self._start, live)

    def update(self, key, value, cache_position):
        self._append(key, value)
        return self._live()

    def reserve(self, key, value, first):
        if first != self._seen:  # (the new tokens go after the seen ones)
            return None
        self._claim(key, value)
        return self._k, self._v, self._start, self._end, None

    def key_positions(self, cache_position):
        span = self.key_range(cache_position)
        return torch.arange(span.start, span.stop, device=cache_position.device)

    def key_range(self, cache_position):
        return range(self._seen - (self._end - self._start), self._seen + cache_position.shape[0])

    def check_cache_position(self, cache_position):
        check_next_positions(cache_position, self._seen, f"this {type(self).__name__} holds",
                             "cache_position counts tokens in the cache (padding included): pass torch.arange("
                             "cache.get_seq_length(), cache.get_seq_length() + new_tokens), or crop the cache first.")

    def get_seq_length(self):
        return self._seen

    @property
    def keys(self):
        return None if self._k is None else self._k[:, :, self._start:self._end]

    @property
    def values(self):
        return None if self._v is None else self._v[:, :, self._start:self._end]

    def reset(self):
        self._k = self._v = None
        self._start = self._end = self._seen = 0

    def crop(self, max_length):
        if max_length >= self._seen:
            return
        first = self._seen - (self._end - self._start)
        if max_length < first:
            raise ValueError(
                f"cannot crop to {max_length} tokens: this layer already dropped positions before {first}"
            )
        self._end -= self._seen - max_length
        self._seen = max_length

    def batch_tensor(self):
        return self._k

    def batch_select_indices(self, indices):
        if self._k is not None:
            self._k = self._k.index_select(0, indices.to(self._k.device))
            self._v = self._v.index_select(0, indices.to(self._v.device))

    def batch_repeat_interleave(self, repeats):
        if self._k is not None:
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)

    def nbytes(self):
        if self._k is None:
            return 0
        return self._k.numel() * self._k.element_size() + self._v.numel() * self._v.element_size()

    @classmethod
    def from_tensors(cls, key: torch.Tensor, value: torch.Tensor) -> "DynamicLayer":
        layer = cls()
        layer._append(key, value)
        return layer


class DynamicSlidingWindowLayer(DynamicLayer):
    """A growing layer that stops growing at its window: it keeps the last ``window - 1`` tokens.

    A query attends to at most ``window`` keys (itself included), so ``window - 1`` old
    tokens plus the new ones are all that any future query can see.
    """

    def __init__(self, sliding_window: int):
        super().__init__()
        if sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.sliding_window = sliding_window

    def _drop_unseen(self) -> None:
        keep = self.sliding_window - 1
        if self._end - self._start > keep:  # drop what no future query can see (no copy)
            self._start = self._end - keep

    def update(self, key, value, cache_position):
        self._drop_unseen()
        return super().update(key, value, cache_position)

    def reserve(self, key, value, first):
        self._drop_unseen()
        return super().reserve(key, value, first)

    def key_range(self, cache_position):
        live = min(self._end - self._start, self.sliding_window - 1)
        return range(self._seen - live, self._seen + cache_position.shape[0])

    def get_max_cache_shape(self):
        return self.sliding_window


@register_persistable
def new_dynamic_layer(layer_idx: int) -> DynamicLayer:
    """Layer factory of a :class:`DynamicCache` built without a config (a named function, so it can be saved)."""
    return DynamicLayer()


class DynamicCache(Cache):
    """The default cache: every layer grows as tokens come.

    With ``config=model.config``, layers of sliding-window attention stop growing at
    the window and Mamba layers hold their fixed-size state (:class:`~kvgen.cache.ssm.SSMLayer`).
    Without a config, layers are created on first use.

    Example:
        >>> from kvgen import AutoModelForCausalLM, DynamicCache  # doctest: +SKIP
        >>> cache = DynamicCache(config=model.config)              # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache)  # doctest: +SKIP

    ``offloading=True`` keeps all but the layer being computed on the CPU (see
    :mod:`kvgen.cache.offload`); ``offload_only_non_sliding=True`` then leaves the
    sliding-window layers on the device.
    """

    def __init__(self, config=None, offloading: bool = False, offload_only_non_sliding: bool = False,
                 **unused_for_compatibility):
        if config is None:
            super().__init__(layer_factory=new_dynamic_layer)
        else:
            config = text_config(config)
            layer_types = config_value(config, "layer_types") or []
            window = config_value(config, "sliding_window")
            layers = [
                layer_kind(kind)(config) if layer_kind(kind)  # (Mamba layers: ssm.py)
                else DynamicSlidingWindowLayer(window) if kind == "sliding_attention" and window else DynamicLayer()
                for kind in layer_types
            ]
            super().__init__(layers=layers, layer_factory=None if layers else new_dynamic_layer)
        if offloading:
            operation("enable_offloading")(self, only_non_sliding=offload_only_non_sliding)

    @classmethod
    def from_legacy_cache(cls, past_key_values: LegacyCache | None) -> "DynamicCache":
        """Build a cache from a tuple of ``(key, value)`` pairs, one per layer."""
        cache = cls()
        if past_key_values is None:
            return cache
        for i, pair in enumerate(past_key_values):
            if len(pair) != 2 or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in pair):
                raise ValueError(
                    f"legacy cache layer {i} must be a (key, value) pair of 4-D tensors (batch, heads, seq, "
                    f"head_dim); got {[type(t).__name__ for t in pair]}"
                )
            cache.layers.append(DynamicLayer.from_tensors(*pair))
        return cache


def as_cache(past_key_values) -> tuple[Cache | None, bool]:
    """``(cache, was_legacy)`` for a ``past_key_values`` argument: a Cache, a legacy tuple (converted) or None."""
    if isinstance(past_key_values, (tuple, list)):
        return DynamicCache.from_legacy_cache(past_key_values), True
    if past_key_values is not None and not isinstance(past_key_values, Cache):
        raise TypeError(
            f"past_key_values must be a kvgen Cache or a legacy tuple of (key, value) pairs, "
            f"got {type(past_key_values).__name__}"
        )
    return past_key_values, False


@register_cache("dynamic")
def _dynamic(config, batch_size, max_cache_len, device, dtype, cache_config):
    return DynamicCache(config=config)
