"""Windowed preallocated caches: :class:`SlidingWindowLayer`, :class:`SlidingWindowCache`, :class:`HybridCache`.

A sliding-window layer is a ring buffer: position ``p`` lives in slot ``p % slots``, and a
tensor of the position held by each slot (``-1`` for empty) lets ``kvgen.masks`` build the
mask, whatever order the slots are in. Shapes never change and the bookkeeping lives in
tensors, so a decode step compiles once, as with :class:`~kvgen.cache.static.StaticLayer`.

A query at position ``q`` sees positions ``q - window + 1 .. q`` (``window`` tokens, itself
included, as in transformers), so ``window`` slots are enough for one-token decode steps:
the new token overwrites the one that just left the window. A chunk of several tokens
(a prefill, maybe longer than the window) attends to the old slots plus the whole chunk,
after which only its last ``window`` tokens are kept.
"""

from __future__ import annotations

import torch

from kvgen.cache.base import (Cache, CacheLayer, check_next_positions, config_value, fixed_address, snapshot,
                              text_config)
from kvgen.cache.registry import register_cache
from kvgen.cache.static import StaticLayer, repeat_batch_rows, select_batch_rows


class SlidingWindowLayer(CacheLayer):
    """A preallocated ring buffer of ``min(sliding_window, max_cache_len)`` slots.

    ``get_seq_length()`` counts every position seen, not the slots kept. Buffers are
    allocated on the first update unless batch, heads, head_dim and dtype are all given.

    Example:
        >>> import torch
        >>> layer = SlidingWindowLayer(sliding_window=4)
        >>> k = v = torch.zeros(1, 2, 6, 8)                      # a 6-token prompt
        >>> keys, _ = layer.update(k, v, torch.arange(6))
        >>> tuple(keys.shape), layer.get_seq_length()          # the prompt attends to all of itself
        ((1, 2, 6, 8), 6)
        >>> layer.key_positions(torch.tensor([6])).tolist()    # slot -> position after writing 6
        [4, 5, 6, 3]
    """

    is_compileable = True

    def __init__(self, sliding_window: int, max_cache_len: int | None = None, batch_size: int | None = None,
                 num_heads: int | None = None, head_dim: int | None = None, device=None, dtype=None):
        if sliding_window is None or int(sliding_window) < 1:
            raise ValueError(f"sliding_window must be a positive number of tokens, got {sliding_window}")
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"max_cache_len must be positive, got {max_cache_len}")
        self.sliding_window = int(sliding_window)
        #: the ring's size; fewer slots than the window only when the whole sequence is shorter
        self.slots = min(self.sliding_window, max_cache_len or self.sliding_window)
        self.batch_size, self.num_heads, self.head_dim = batch_size, num_heads, head_dim
        self.device, self.dtype = device, dtype
        self._k: torch.Tensor | None = None  # (B, H, slots, D)
        self._v: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None  # (slots,) int64: position held by each slot, -1 if empty
        self._seen: torch.Tensor | None = None  # (1,) int64: one past the highest written position
        if None not in (batch_size, num_heads, head_dim, dtype):
            self._allocate(batch_size, num_heads, head_dim, head_dim, torch.device(device or "cpu"), dtype)

    def _allocate(self, batch, heads, k_dim, v_dim, device, dtype):
        self._k = torch.zeros(batch, heads, self.slots, k_dim, device=device, dtype=dtype)
        self._v = torch.zeros(batch, heads, self.slots, v_dim, device=device, dtype=dtype)
        self._pos = torch.full((self.slots,), -1, dtype=torch.long, device=device)
        self._seen = torch.zeros(1, dtype=torch.long, device=device)
        fixed_address(self._k, self._v, self._pos, self._seen)

    # -- the plan shared by update and key_positions ---------------------------------------------------
    def _plan(self, cache_position: torch.Tensor) -> tuple[bool, int]:
        """``(concat, n)``: how ``update`` answers for ``cache_position``, decided from the state before it.

        ``concat=False``: write first, then return slots ``[:n]`` (one token, whose slot held a
        position that just left the window; or a chunk that fits the ring without wrapping).
        ``concat=True``: return slots ``[:n]`` as they were, followed by the whole new chunk,
        then write (the chunk's early queries still need what its late tokens overwrite).
        Under torch.compile ``n`` is always ``slots`` (static shapes; the mask hides empty slots).
        """
        t = cache_position.shape[0]
        if torch.compiler.is_compiling():
            return t > 1, self.slots
        seen = self.get_seq_length()
        last = int(cache_position[-1])
        if t == 1 or last < self.slots:
            return False, min(self.slots, max(seen, last + 1))
        return True, min(self.slots, seen)

    def update(self, key, value, cache_position):
        if self._k is None:
            if self.batch_size is not None and key.shape[0] != self.batch_size:
                raise ValueError(
                    f"the sliding-window cache was built for max_batch_size={self.batch_size} but got a batch of "
                    f"{key.shape[0]}; build it with max_batch_size={key.shape[0]}"
                )
            self._allocate(key.shape[0], key.shape[1], key.shape[3], value.shape[3],
                           torch.device(self.device) if self.device is not None else key.device,
                           self.dtype or key.dtype)
        concat, n = self._plan(cache_position)
        key, value = key.to(self._k.dtype), value.to(self._v.dtype)
        if concat:
            if n == 0:
                out_k, out_v = key, value
            else:
                out_k = torch.cat([self._k[:, :, :n], key], dim=2)  # (B, H, n + T, D), copied before the write
                out_v = torch.cat([self._v[:, :, :n], value], dim=2)
            keep = min(key.shape[2], self.slots)  # only the last `slots` new tokens stay
            self._write(key[:, :, -keep:], value[:, :, -keep:], cache_position[-keep:])
            return out_k, out_v
        self._write(key, value, cache_position)
        return self._k[:, :, :n], self._v[:, :, :n]

    def _write(self, key, value, cache_position):
        slot = cache_position % self.slots  # (T,) distinct: T <= slots
        self._k.index_copy_(2, slot, key)
        self._v.index_copy_(2, slot, value)
        self._pos.index_copy_(0, slot, cache_position)
        torch.maximum(self._seen, cache_position[-1:] + 1, out=self._seen)

    def key_positions(self, cache_position):
        concat, n = self._plan(cache_position)
        pos = self._pos
        if pos is None:  # nothing allocated yet: every slot is empty
            pos = torch.full((self.slots,), -1, dtype=torch.long, device=cache_position.device)
        pos = pos.to(cache_position.device)
        if concat:
            return torch.cat([pos[:n], cache_position]) if n else cache_position  # (n + T,)
        return pos.index_copy(0, cache_position % self.slots, cache_position)[:n]  # (n,) after the write

    def check_cache_position(self, cache_position):
        check_next_positions(cache_position, self.get_seq_length(), "this sliding-window (ring buffer) cache has "
                             "seen", "A ring buffer cannot go back to positions it has passed: call cache.crop(n) "
                             "first (once it has wrapped around, at most one token back) or cache.reset() and feed "
                             "the whole sequence.")
        last = int(cache_position[-1])
        if self.slots < self.sliding_window and last >= self.slots:
            raise ValueError(
                f"cache_position {last} does not fit a sliding-window cache of max_cache_len={self.slots} (smaller "
                f"than its window of {self.sliding_window}); build the cache with max_cache_len >= {last + 1} "
                "(prompt plus new tokens)"
            )

    def get_seq_length(self):
        return 0 if self._seen is None else int(self._seen)

    def get_max_cache_shape(self):
        return self.slots

    # -- stored tensors, oldest first ---------------------------------------------------------------
    def _stored_order(self) -> torch.Tensor:
        """Slot indices of the stored positions, oldest first."""
        order = torch.argsort(self._pos)
        return order[self._pos[order] >= 0]

    @property
    def keys(self):
        return None if self._k is None else self._k.index_select(2, self._stored_order())

    @property
    def values(self):
        return None if self._v is None else self._v.index_select(2, self._stored_order())

    # -- editing ------------------------------------------------------------------------------------
    def reset(self):
        if self._k is not None:  # keep the buffers: compiled graphs hold them
            self._k.zero_()
            self._v.zero_()
            self._pos.fill_(-1)
            self._seen.zero_()

    def check_crop(self, max_length: int) -> None:
        """Raise when cropping to ``max_length`` would need positions the ring has overwritten."""
        seen = self.get_seq_length()
        if self._k is None or max_length >= seen:
            return
        stored = self._pos[self._pos >= 0]
        oldest = int(stored.min()) if stored.numel() else 0
        needed = max(max_length - self.sliding_window + 1, 0)  # oldest position the next query sees
        if oldest > needed:
            raise ValueError(
                f"cannot crop this sliding-window cache to {max_length} tokens: its ring buffer of {self.slots} "
                f"slots holds positions {oldest}..{seen - 1}, but the next query (position {max_length}) needs "
                f"positions from {needed} on, which were overwritten. A wrapped ring buffer can be cropped back by "
                "at most one token; call cache.reset() and feed the sequence again instead."
            )

    def crop(self, max_length):
        self.check_crop(max_length)
        if self._k is None or max_length >= self.get_seq_length():
            return
        dropped = self._pos >= max_length  # (slots,)
        self._pos.masked_fill_(dropped, -1)
        self._k.masked_fill_(dropped.view(1, 1, -1, 1), 0)
        self._v.masked_fill_(dropped.view(1, 1, -1, 1), 0)
        self._seen.fill_(max_length)

    def checkpoint(self, new_tokens):
        if self._k is None or self.get_seq_length() + new_tokens <= self.slots:
            return None  # nothing gets overwritten
        return snapshot(self)

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


# -- the caches --------------------------------------------------------------------------------------

def _windowed_layers(cache_name: str, config, max_batch_size, max_cache_len, device, dtype, batch_size):
    """Ring buffers for the config's sliding-attention layers, static layers for the others."""
    if config is None:
        raise ValueError(f"{cache_name} needs the model's config: {cache_name}(config=model.config, max_cache_len=...)")
    config = text_config(config)
    window = config_value(config, "sliding_window")
    layer_types = list(config_value(config, "layer_types") or [])
    if not layer_types:
        n_layers = config_value(config, "num_hidden_layers")
        layer_types = ["sliding_attention" if window else "full_attention"] * (n_layers or 0)
    if not window or "sliding_attention" not in layer_types:
        raise ValueError(
            f"{cache_name} is only for models with sliding-window attention layers (Mistral, Gemma 2/3, ...); this "
            f"{config_value(config, 'model_type', 'model')} config has sliding_window={window} and no "
            "'sliding_attention' layer. Use cache_implementation='static' (StaticCache) or 'dynamic' instead."
        )
    max_cache_len = max_cache_len or config_value(config, "max_position_embeddings")
    if max_cache_len is None:
        raise ValueError(f"{cache_name} needs max_cache_len (the prompt plus the tokens to generate)")
    batch = max_batch_size or batch_size
    heads = config_value(config, "num_key_value_heads") or config_value(config, "num_attention_heads")
    head_dim = config_value(config, "head_dim") or (
        config_value(config, "hidden_size") // config_value(config, "num_attention_heads"))
    layers = [
        SlidingWindowLayer(window, max_cache_len, batch, heads, head_dim, device, dtype)
        if kind == "sliding_attention" else StaticLayer(max_cache_len, batch, heads, head_dim, device, dtype)
        for kind in layer_types
    ]
    return layers, max_cache_len


class _WindowedCache(Cache):
    """What both windowed caches share: the whole cache's length limit vs. each layer's slots."""

    max_cache_len: int

    def get_max_cache_shape(self, layer_idx: int | None = None) -> int | None:
        """Longest sequence the cache accepts (``max_cache_len``); with ``layer_idx``, that layer's slots.

        ``generate()`` pads the attention mask of its compiled decode step to this length, so
        it must cover every absolute position, not the first layer's ring of window slots.
        """
        if layer_idx is None:
            return self.max_cache_len
        return super().get_max_cache_shape(layer_idx)

    def _empty_max_cache_shape(self):
        return self.max_cache_len

    def crop(self, max_length: int) -> None:
        """Keep the first ``max_length`` positions; raises, changing nothing, if a ring cannot (see ``check_crop``)."""
        target = self.get_seq_length() + max_length if max_length < 0 else max_length
        for layer in self.layers:
            if isinstance(layer, SlidingWindowLayer):
                layer.check_crop(max(target, 0))
        super().crop(max_length)


class SlidingWindowCache(_WindowedCache):
    """A compile-friendly cache keeping the last ``sliding_window`` tokens of each sliding-attention layer.

    For models with sliding-window attention (Mistral-style configs); raises ``ValueError``
    for a model without one. Full-attention layers of a mixed config get static layers of
    ``max_cache_len`` slots. ``max_cache_len`` (default: the config's
    ``max_position_embeddings``) bounds the sequence: prompt plus new tokens.

    Example:
        >>> cache = SlidingWindowCache(config=model.config, max_batch_size=1, max_cache_len=256)  # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=30)           # doctest: +SKIP
        >>> out = model.generate(**inputs, cache_implementation="sliding_window")             # doctest: +SKIP
    """

    def __init__(self, config=None, max_batch_size: int | None = None, max_cache_len: int | None = None,
                 device=None, dtype=None, batch_size: int | None = None, **unused_for_compatibility):
        layers, self.max_cache_len = _windowed_layers("SlidingWindowCache", config, max_batch_size, max_cache_len,
                                                      device, dtype, batch_size)
        super().__init__(layers=layers)


class HybridCache(_WindowedCache):
    """Ring buffers for the local (sliding-window) layers and static buffers for the global ones.

    The layer kinds come from ``config.layer_types`` (Gemma 2 alternates local and global
    layers, Gemma 3 has five local layers per global one). Compile-friendly.
    ``get_seq_length()`` is the true sequence length whichever layer is asked.

    Example:
        >>> cache = HybridCache(config=model.config, max_batch_size=1, max_cache_len=1024)   # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=30)       # doctest: +SKIP
        >>> out = model.generate(**inputs, cache_implementation="hybrid")                # doctest: +SKIP
    """

    def __init__(self, config=None, max_batch_size: int | None = None, max_cache_len: int | None = None,
                 device=None, dtype=None, batch_size: int | None = None, **unused_for_compatibility):
        layers, self.max_cache_len = _windowed_layers("HybridCache", config, max_batch_size, max_cache_len,
                                                      device, dtype, batch_size)
        super().__init__(layers=layers)


@register_cache("sliding_window")
def _sliding_window(config, batch_size, max_cache_len, device, dtype, cache_config):
    return SlidingWindowCache(config=config, max_batch_size=batch_size, max_cache_len=max_cache_len,
                              device=device, dtype=dtype)


@register_cache("hybrid")
def _hybrid(config, batch_size, max_cache_len, device, dtype, cache_config):
    return HybridCache(config=config, max_batch_size=batch_size, max_cache_len=max_cache_len,
                       device=device, dtype=dtype)
