"""Copy-free prefix forks: many caches (or many batch rows) over one stored prefix.

``cache.fork(n)`` turns a filled cache into ``n`` caches that share its tokens: each
layer becomes a :class:`ForkedLayer`, the shared prefix (read-only, stored once) followed
by the fork's own tokens in a fresh layer of the original kind. Nothing is ever written
into the prefix, so forks are independent (copy-on-write: a fork that crops into the
prefix only shortens its own view of it). ``generate()`` uses the same layers for beams
and ``num_return_sequences`` after a shared prompt: the prompt is prefilled once and its
keys/values are stored once, whatever the number of rows.

Layer kinds that can be forked: growing (``DynamicLayer``) and preallocated
(``StaticLayer``) ones. Others (rings, sinks, quantized, SSM states) raise a clear error
from ``fork`` and are repeated row by row in ``generate()``.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvgen.cache.base import Cache, CacheLayer, register_operation
from kvgen.cache.codec import register_persistable
from kvgen.cache.dynamic import DynamicLayer
from kvgen.cache.static import StaticLayer

_FORK_GRANULARITY = 16  # slots: a fork's own tokens are few


@register_persistable
class SuffixFactory:
    """Builds the empty layer that holds a fork's own tokens after a prefix of ``P`` tokens.

    ``static_len``: the preallocated layer's total slots (prefix included); ``None`` for a growing layer.
    """

    def __init__(self, static_len: int | None = None, num_heads=None, head_dim=None, device=None, dtype=None):
        self.static_len, self.num_heads, self.head_dim, self.device, self.dtype = (
            static_len, num_heads, head_dim, device, dtype)

    def __call__(self, prefix_length: int) -> CacheLayer:
        if self.static_len is None or self.static_len <= prefix_length:  # (a full layer, e.g. cross-attention,
            return DynamicLayer(granularity=_FORK_GRANULARITY)            # gets none of its own)
        return StaticLayer(self.static_len - prefix_length, None, self.num_heads, self.head_dim, self.device,
                           self.dtype)


def _suffix_factory(layer: CacheLayer) -> Callable[[int], CacheLayer] | None:
    """How to build an empty layer of ``layer``'s kind for the tokens after a prefix; ``None``: not forkable."""
    if type(layer) is DynamicLayer:
        return SuffixFactory()
    if type(layer) is StaticLayer:
        return SuffixFactory(layer.max_cache_len, layer.num_heads, layer.head_dim, layer.device, layer.dtype)
    if type(layer) is ForkedLayer:
        return layer._make_suffix
    return None


class ForkedLayer(CacheLayer):
    """A shared, read-only prefix (positions ``0..P-1``) followed by this layer's own tokens.

    ``rows`` maps each batch row to its prefix row, so beams and repeated rows share one
    stored prefix row; reordering beams only reorders ``rows`` and the own tokens.

    Example:
        >>> import torch
        >>> from kvgen import DynamicCache
        >>> cache = DynamicCache()
        >>> _ = cache.update(torch.ones(1, 2, 5, 4), torch.ones(1, 2, 5, 4), 0)
        >>> a, b = cache.fork(2)
        >>> _ = a.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)
        >>> a.get_seq_length(), b.get_seq_length(), a.layers[0].prefix_keys is b.layers[0].prefix_keys
        (6, 5, True)
    """

    def __init__(self, prefix_keys: torch.Tensor, prefix_values: torch.Tensor, rows: torch.Tensor,
                 make_suffix: Callable[[int], CacheLayer]):
        self.prefix_keys, self.prefix_values = prefix_keys, prefix_values  # (Bp, H, P, D), never written
        self.rows = rows  # (B,) prefix row of each batch row
        self._make_suffix = make_suffix
        self.suffix = make_suffix(prefix_keys.shape[2])
        self.is_compileable = self.suffix.is_compileable
        self._same_rows = self._rows_are_identity()

    @property
    def prefix_length(self) -> int:
        return self.prefix_keys.shape[2]

    def _rows_are_identity(self) -> bool:
        return self.rows.shape[0] == self.prefix_keys.shape[0] and \
            bool((self.rows == torch.arange(self.rows.shape[0], device=self.rows.device)).all())

    def _prefix(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._same_rows:
            return self.prefix_keys, self.prefix_values
        rows = self.rows.to(self.prefix_keys.device)
        return self.prefix_keys.index_select(0, rows), self.prefix_values.index_select(0, rows)

    def update(self, key, value, cache_position):
        keys, values = self.suffix.update(key, value, cache_position - self.prefix_length)
        prefix_keys, prefix_values = self._prefix()
        return torch.cat([prefix_keys, keys], dim=2), torch.cat([prefix_values, values], dim=2)

    def key_positions(self, cache_position):
        p = self.prefix_length
        own = self.suffix.key_positions(cache_position - p)
        own = torch.where(own >= 0, own + p, own)
        return torch.cat([torch.arange(p, device=own.device), own])

    def check_cache_position(self, cache_position):
        if int(cache_position.min()) < self.prefix_length:
            raise ValueError(
                f"cache_position {int(cache_position.min())} falls inside the shared prefix of this forked cache "
                f"({self.prefix_length} tokens), which is read-only: crop the cache to {int(cache_position.min())} "
                "tokens first (its own view of the prefix gets shorter)"
            )
        self.suffix.check_cache_position(cache_position - self.prefix_length)

    def get_seq_length(self):
        return self.prefix_length + self.suffix.get_seq_length()

    def get_max_cache_shape(self):
        own = self.suffix.get_max_cache_shape()
        return None if own is None else own + self.prefix_length

    @property
    def keys(self):
        own = self.suffix.keys
        return self._prefix()[0] if own is None else torch.cat([self._prefix()[0], own], dim=2)

    @property
    def values(self):
        own = self.suffix.values
        return self._prefix()[1] if own is None else torch.cat([self._prefix()[1], own], dim=2)

    def reset(self):
        self.crop(0)

    def crop(self, max_length):
        if max_length >= self.prefix_length:
            self.suffix.crop(max_length - self.prefix_length)
            return
        # a shorter view of the shared prefix; the own tokens go (they came after it)
        self.prefix_keys = self.prefix_keys[:, :, :max_length]
        self.prefix_values = self.prefix_values[:, :, :max_length]
        self.suffix = self._make_suffix(max_length)

    def batch_tensor(self):
        return self.rows

    def batch_select_indices(self, indices):
        self.rows = self.rows.index_select(0, indices.to(self.rows.device))
        self._same_rows = self._rows_are_identity()
        self.suffix.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats):
        self.rows = self.rows.repeat_interleave(repeats)
        self._same_rows = self._rows_are_identity()
        self.suffix.batch_repeat_interleave(repeats)

    def nbytes(self):
        """Bytes this layer reaches, the shared prefix included (see :func:`unique_nbytes` for a set of forks)."""
        prefix = self.prefix_keys.untyped_storage().nbytes() + self.prefix_values.untyped_storage().nbytes()
        return prefix + self.suffix.nbytes()


def _forked_layers(cache: Cache, rows_per_item: int) -> list[ForkedLayer]:
    """One :class:`ForkedLayer` per layer over its current tokens (stored once, tight)."""
    layers = []
    for i, layer in enumerate(cache.layers):
        make_suffix = _suffix_factory(layer)
        if make_suffix is None or layer.keys is None:
            reason = "it is empty" if make_suffix is not None else f"{type(layer).__name__} cannot share its tokens"
            raise ValueError(
                f"layer {i} of this {type(cache).__name__} cannot be forked: {reason}. Forks need filled growing "
                "or preallocated layers (DynamicCache, StaticCache); use copy.deepcopy(cache) for the others."
            )
        keys, values = layer.keys.contiguous(), layer.values.contiguous()  # (B, H, P, D)
        rows = torch.arange(keys.shape[0], device=keys.device).repeat_interleave(rows_per_item)
        layers.append(ForkedLayer(keys, values, rows, make_suffix))
    return layers


@register_operation("fork")
def fork_cache(cache: Cache, n: int) -> list[Cache]:
    """``n`` caches that share ``cache``'s tokens; ``cache`` itself keeps working (it shares them too)."""
    if n < 1:
        raise ValueError(f"fork needs n >= 1, got {n}")
    if not cache.layers:
        raise ValueError("an empty cache has nothing to share: fill it (prefill the prompt) before forking")
    shared = _forked_layers(cache, 1)
    cache.layers = shared  # the original now only reads the shared tokens too: no fork can see another's writes
    forks = []
    for _ in range(n):
        fork = Cache([ForkedLayer(layer.prefix_keys, layer.prefix_values, layer.rows, layer._make_suffix)
                      for layer in shared])
        fork.token_ids = cache.token_ids
        forks.append(fork)
    return forks


def can_share_rows(cache: Cache) -> bool:
    return bool(cache.layers) and all(_suffix_factory(layer) is not None and layer.keys is not None
                                      for layer in cache.layers)


@register_operation("share_rows")
def share_rows(cache: Cache, repeats: int) -> None:
    """``cache.batch_repeat_interleave(repeats)``, but the repeated rows share storage when the layers allow."""
    if repeats == 1:
        return
    if not can_share_rows(cache):
        cache.batch_repeat_interleave(repeats)
        return
    cache.layers = _forked_layers(cache, repeats)
    if cache.token_ids is not None:
        cache.token_ids = cache.token_ids.repeat_interleave(repeats, dim=0)


def unique_nbytes(*caches: Cache) -> int:
    """Bytes of distinct storage behind all tensors of ``caches`` (shared prefixes counted once)."""
    seen: dict[int, int] = {}

    def visit(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    for cache in caches:
        for layer in cache.layers:
            layer.map_tensors(visit)
    return sum(seen.values())
