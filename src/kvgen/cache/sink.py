"""Attention sinks (StreamingLLM): :class:`SinkLayer`, :class:`SinkCache`, :class:`StaticSinkCache`.

A sink layer keeps the first ``num_sink_tokens`` tokens of the sequence (the "sinks") and the
most recent ``window_length - num_sink_tokens`` tokens (the window), so a stream of any length
runs in ``window_length`` slots ("Efficient Streaming Language Models with Attention Sinks",
Xiao et al. 2023).

Positions. StreamingLLM gives the tokens *in the cache* contiguous positions: the sinks
``0 .. S-1``, the window ``S, S+1, ...``, as if the evicted tokens had never been there.
``generate()`` and ``forward()`` keep passing absolute positions (``cache_position`` and the
``position_ids`` that rotate queries and keys), so the cache realises the in-cache positions
through RoPE's relative property: a score depends only on the difference between the query's
and the key's rotation positions. The window is contiguous in absolute positions, so its keys
are already right as the model rotated them; only the sinks are out of place, by ``offset`` =
(absolute position of the first window token) - S. The layer keeps each sink key as the model
rotated it and, whenever the window moves, writes it rotated by ``offset`` more (always from
that original, so errors do not accumulate). Every query then sees every key at exactly the
distance it would have in a fresh forward pass over [sinks + window] at positions
``0 .. n-1``; ``tests/test_sink.py`` checks this logit for logit. Per step this rotates
``S`` keys per layer, where re-rotating the whole window to in-cache positions (the reference
``SinkCache``) rotates ``window_length`` keys. The rotation uses the model's own
``rotary_emb`` (passed by :meth:`Cache.update <kvgen.cache.base.Cache.update>` to layers with
``needs_rotary``): its ``inv_freq`` covers default, linear and llama3 scaling, and its
``rotary_dim`` partial rotary.

Chunks. An update of ``T`` tokens evicts the ``T`` oldest window tokens and attends to sinks +
the rest of the window + the chunk (causally), as one fresh forward over those tokens would.
A chunk with more than ``window_length - num_sink_tokens`` window tokens (a long first prompt,
say) attends to the sinks and the whole chunk, then only its last tokens are kept.

Storage. Slots ``0 .. S-1`` hold the sinks, slots ``S .. W-1`` are a ring buffer for the window
(position ``p`` lives in slot ``S + (p - S) % (W - S)``); the fill level and the first window
position are tensors, so a decode step has static shapes and compiles once.

Limits. ``key_positions`` reports absolute positions, so the padding mask stays right, but a
model's own sliding-window mask (Mistral-style configs) would hide the sinks once they are
farther than its window: the registry factories refuse such configs. Dynamic-NTK RoPE changes
its frequencies past ``max_position_embeddings`` and cached keys would stop matching: the
layer raises once the stream gets there.
"""

from __future__ import annotations

import torch

from kvgen.cache.base import (Cache, CacheLayer, check_next_positions, config_value, fixed_address, snapshot,
                              text_config)
from kvgen.cache.registry import register_cache
from kvgen.cache.static import repeat_batch_rows, select_batch_rows
from kvgen.rope import apply_rotary


def _check_sizes(window_length, num_sink_tokens) -> tuple[int, int]:
    for name, value in (("window_length", window_length), ("num_sink_tokens", num_sink_tokens)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {value!r}")
    if num_sink_tokens < 0:
        raise ValueError(f"num_sink_tokens must be >= 0, got {num_sink_tokens}")
    if window_length <= num_sink_tokens:
        raise ValueError(
            f"window_length ({window_length}) must be larger than num_sink_tokens ({num_sink_tokens}): the window "
            "includes the sink tokens and needs room for recent tokens, e.g. SinkCache(window_length=256, "
            "num_sink_tokens=4)"
        )
    return window_length, num_sink_tokens


def rotate_by(x: torch.Tensor, shift: torch.Tensor, rotary_emb) -> torch.Tensor:
    """Keys ``x`` (B, H, S, D) rotated at positions ``p`` -> the same keys rotated at ``p + shift``.

    ``shift`` is a (1,) integer tensor. RoPE rotations compose (``R(a) R(b) = R(a + b)`` for
    every rope type with fixed frequencies), so this is one more rotation by ``shift`` with the
    model's ``inv_freq``; channels past ``rotary_dim`` pass through (partial rotary). Computed
    in float32 from ``inv_freq`` directly (not ``rotary_emb.forward``, whose dynamic-NTK update
    must not see these positions); the sign convention is :func:`kvgen.rope.apply_rotary`'s.
    """
    inv_freq = rotary_emb.inv_freq  # (R/2,)
    freqs = shift.to(inv_freq.device).float().view(1, 1) * inv_freq  # (1, R/2)
    cos = torch.cat((freqs, freqs), dim=-1).cos()[None]  # (1, 1, R)
    sin = torch.cat((-freqs, freqs), dim=-1).sin()[None]
    return apply_rotary(x.float(), cos, sin).to(x.dtype)


class SinkLayer(CacheLayer):
    """One layer's sinks plus a ring buffer of recent tokens, with sink keys re-rotated as the window moves.

    ``update`` returns the sinks and the window (``window_length`` slots once full; the mask
    from :meth:`key_positions` orders them). Buffers are allocated on the first update (batch,
    heads, head_dim, device and dtype from the first keys unless given).

    Example:
        >>> import torch
        >>> from kvgen.config import PretrainedConfig
        >>> from kvgen.rope import RotaryEmbedding
        >>> rope = RotaryEmbedding(PretrainedConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1))
        >>> layer = SinkLayer(window_length=6, num_sink_tokens=2)
        >>> k = v = torch.randn(1, 1, 9, 8)
        >>> keys, _ = layer.update(k, v, torch.arange(9), rotary_emb=rope)  # a 9-token prompt attends to itself
        >>> tuple(keys.shape), layer.get_seq_length()
        ((1, 1, 9, 8), 9)
        >>> layer.key_positions(torch.tensor([9])).tolist()  # slot -> position after writing token 9
        [0, 1, 6, 7, 8, 9]
    """

    needs_rotary = True

    def __init__(self, window_length: int, num_sink_tokens: int, batch_size: int | None = None,
                 num_heads: int | None = None, head_dim: int | None = None, device=None, dtype=None):
        self.window_length, self.num_sink_tokens = _check_sizes(window_length, num_sink_tokens)
        self._ring = window_length - num_sink_tokens  # R: window slots
        self.batch_size, self.num_heads, self.head_dim = batch_size, num_heads, head_dim
        self.device, self.dtype = device, dtype
        self._k: torch.Tensor | None = None  # (B, H, W, D): sinks rotated by the current offset, then the ring
        self._v: torch.Tensor | None = None
        self._raw: torch.Tensor | None = None  # (B, H, S + 1, D): sink keys as the model rotated them; S: scratch
        self._seen: torch.Tensor | None = None  # (1,) int64: positions seen
        self._first: torch.Tensor | None = None  # (1,) int64: no window position below this is held
        if None not in (batch_size, num_heads, head_dim, dtype):
            self._allocate(batch_size, num_heads, head_dim, head_dim, torch.device(device or "cpu"), dtype)

    def _allocate(self, batch, heads, k_dim, v_dim, device, dtype):
        s = self.num_sink_tokens
        self._k = torch.zeros(batch, heads, self.window_length, k_dim, device=device, dtype=dtype)
        self._v = torch.zeros(batch, heads, self.window_length, v_dim, device=device, dtype=dtype)
        self._raw = torch.zeros(batch, heads, s + 1, k_dim, device=device, dtype=dtype)
        self._seen = torch.zeros(1, dtype=torch.long, device=device)
        self._first = torch.full((1,), s, dtype=torch.long, device=device)
        fixed_address(self._k, self._v, self._raw, self._seen, self._first)

    # -- the plan shared by update and key_positions -----------------------------------------------
    def _window_tokens(self, cache_position: torch.Tensor) -> int:
        """How many of the new tokens land in the window (the others fill sink slots); eager only."""
        t = cache_position.shape[0]
        return t - max(0, min(self.num_sink_tokens - self.get_seq_length(), t))

    def _concat(self, cache_position: torch.Tensor) -> bool:
        """True when the chunk's window tokens outnumber the ring: attend to sinks + chunk, keep its end."""
        if torch.compiler.is_compiling():
            if cache_position.shape[0] > self._ring:
                raise NotImplementedError(
                    f"under torch.compile a sink cache takes at most window_length - num_sink_tokens = {self._ring} "
                    f"tokens per forward, got {cache_position.shape[0]}; run longer chunks eagerly"
                )
            return False
        return self._window_tokens(cache_position) > self._ring

    def _slots(self, positions: torch.Tensor) -> torch.Tensor:
        s = self.num_sink_tokens
        return torch.where(positions < s, positions, s + (positions - s) % self._ring)  # (T,)

    def key_positions(self, cache_position):
        s, w = self.num_sink_tokens, self.window_length
        device = cache_position.device
        if self._concat(cache_position):  # sinks, then the chunk's window tokens
            n = cache_position.shape[0] - self._window_tokens(cache_position)
            return torch.cat([torch.arange(s, device=device), cache_position[n:]])
        last = cache_position[-1:]  # (1,)
        first = self._first.to(device) if self._first is not None else torch.full_like(last, s)
        first = torch.maximum(first, last - self._ring + 1)  # oldest window position after the write
        slot = torch.arange(w, device=device)
        newest = last - (last - slot) % self._ring  # (W,) newest position <= last that each ring slot can hold
        pos = torch.where(slot < s, torch.where(slot <= last, slot, -1), torch.where(newest >= first, newest, -1))
        if torch.compiler.is_compiling():
            return pos
        return pos[: min(w, int(last) + 1)]

    # -- update -------------------------------------------------------------------------------------
    def update(self, key, value, cache_position, rotary_emb=None):
        if self._k is None:
            if self.batch_size is not None and key.shape[0] != self.batch_size:
                raise ValueError(
                    f"the sink cache was built for max_batch_size={self.batch_size} but got a batch of "
                    f"{key.shape[0]}; build it with max_batch_size={key.shape[0]}"
                )
            self._allocate(key.shape[0], key.shape[1], key.shape[3], value.shape[3],
                           torch.device(self.device) if self.device is not None else key.device,
                           self.dtype or key.dtype)
        key, value = key.to(self._k.dtype), value.to(self._v.dtype)
        if not torch.compiler.is_compiling():
            self._check_rotary(rotary_emb, int(cache_position[-1]))
        if self._concat(cache_position):
            return self._update_concat(key, value, cache_position, rotary_emb)
        s = self.num_sink_tokens
        slots = self._slots(cache_position)
        self._k.index_copy_(2, slots, key)
        self._v.index_copy_(2, slots, value)
        last = cache_position[-1:]  # (1,)
        self._seen.copy_(last + 1)
        torch.maximum(self._first, last - self._ring + 1, out=self._first)
        if s:
            # sink keys: kept as rotated by the model (slot s is scratch for non-sink positions), then
            # written rotated by the window's offset
            self._raw.index_copy_(2, cache_position.clamp(max=s), key)
            self._write_sinks(self._first - s, rotary_emb)
        if torch.compiler.is_compiling():
            return self._k, self._v
        n = min(self.window_length, int(last) + 1)
        return self._k[:, :, :n], self._v[:, :, :n]

    def _update_concat(self, key, value, cache_position, rotary_emb):
        """A chunk longer than the ring (eager): attend to sinks + the chunk, keep the chunk's last tokens."""
        s, r = self.num_sink_tokens, self._ring
        seen = self.get_seq_length()
        n = cache_position.shape[0] - self._window_tokens(cache_position)  # new sink tokens
        if n:
            self._raw[:, :, seen:seen + n] = key[:, :, :n]
            self._k[:, :, seen:seen + n] = key[:, :, :n]
            self._v[:, :, seen:seen + n] = value[:, :, :n]
        out_k, out_v = key[:, :, n:], value[:, :, n:]
        if s:
            shift = max(seen, s) - s  # the chunk's first window token sits right after the sinks
            sinks = self._sinks_at(torch.tensor([shift], device=key.device), rotary_emb)
            out_k = torch.cat([sinks, out_k], dim=2)  # (B, H, S + window tokens, D)
            out_v = torch.cat([self._v[:, :, :s], out_v], dim=2)
        kept = cache_position[-r:]
        self._k.index_copy_(2, self._slots(kept), key[:, :, -r:])
        self._v.index_copy_(2, self._slots(kept), value[:, :, -r:])
        last = int(cache_position[-1])
        self._seen.fill_(last + 1)
        self._first.fill_(last + 1 - r)
        if s:
            self._write_sinks(self._first - s, rotary_emb)
        return out_k, out_v

    def _write_sinks(self, shift: torch.Tensor, rotary_emb) -> None:
        """Sink slots <- the model's sink keys moved ``shift`` (1,) positions on."""
        self._k[:, :, :self.num_sink_tokens] = self._sinks_at(shift, rotary_emb)

    def _sinks_at(self, shift: torch.Tensor, rotary_emb) -> torch.Tensor:
        """The sink keys (B, H, S, D) as the model rotated them, moved ``shift`` (1,) positions on."""
        raw = self._raw[:, :, :self.num_sink_tokens]
        if not torch.compiler.is_compiling() and int(shift) == 0:
            return raw
        if rotary_emb is None or not hasattr(rotary_emb, "inv_freq"):
            raise ValueError(
                "a sink cache re-rotates its sink keys and needs the model's rotary embedding: models pass it in "
                "cache_kwargs; when calling cache.update yourself, pass {'cache_position': ..., 'rotary_emb': "
                "model.model.rotary_emb}. Without RoPE, use num_sink_tokens=0 or another cache."
            )
        return rotate_by(raw, shift, rotary_emb)  # under torch.compile: every step (static shapes; S keys)

    @staticmethod
    def _check_rotary(rotary_emb, last: int) -> None:
        limit = getattr(rotary_emb, "max_position_embeddings", None)
        if getattr(rotary_emb, "rope_type", None) == "dynamic" and limit is not None and last >= limit:
            raise ValueError(
                f"position {last} is past max_position_embeddings={limit} of a dynamic-NTK RoPE model: its "
                "frequencies change there, so the keys in a sink cache would no longer match the new queries. "
                f"Keep the stream under {limit} tokens or use a model with fixed-frequency RoPE."
            )

    # -- bookkeeping ----------------------------------------------------------------------------------
    def check_cache_position(self, cache_position):
        check_next_positions(cache_position, self.get_seq_length(), "this sink cache has seen",
                             "cache_position counts every token streamed so far (evicted ones included): pass "
                             "torch.arange(cache.get_seq_length(), cache.get_seq_length() + new_tokens), or "
                             "cache.crop(n) / cache.reset() first.")

    def get_seq_length(self):
        return 0 if self._seen is None else int(self._seen)

    def get_max_cache_shape(self):
        return self.window_length

    def _stored(self) -> torch.Tensor:
        """Slot indices of the tokens kept now, oldest first."""
        positions = self.key_positions(self._seen - 1) if self.get_seq_length() else self._seen[:0]
        order = torch.argsort(positions)
        return order[positions[order] >= 0]

    @property
    def keys(self):
        """Sinks + window (B, H, kept, D), oldest first, keys rotated at their in-cache order (sinks shifted)."""
        if self._k is None:
            return None
        return self._k.index_select(2, self._stored())

    @property
    def values(self):
        if self._v is None:
            return None
        return self._v.index_select(2, self._stored())

    def reset(self):
        if self._k is not None:  # keep the buffers: compiled graphs hold them
            self._k.zero_()
            self._v.zero_()
            self._raw.zero_()
            self._seen.zero_()
            self._first.fill_(self.num_sink_tokens)

    def crop(self, max_length):
        """Forget positions from ``max_length`` on.

        Evicted tokens do not come back: the window keeps the surviving tokens before
        ``max_length`` (all of them unless the cache had evicted some) and refills as tokens
        come; cropping to ``num_sink_tokens`` or less keeps only sinks.
        """
        seen = self.get_seq_length()
        if self._k is None or max_length >= seen:
            return
        s = self.num_sink_tokens
        start = max(int(self._first), seen - self._ring)  # oldest window position held
        self._first.fill_(start if max_length > start else max(max_length, s))
        self._seen.fill_(max(max_length, 0))

    def checkpoint(self, new_tokens):
        if self._k is None or self.get_seq_length() + new_tokens <= self.window_length:
            return None  # nothing gets evicted
        return snapshot(self)

    def chunk_limit(self):
        # once full, each token shifts the window (and the keys' rotation) that the next one sees
        return max(self.window_length - self.get_seq_length(), 1)

    def batch_tensor(self):
        return self._k

    def batch_select_indices(self, indices):
        select_batch_rows(self, ("_k", "_v", "_raw"), indices)

    def batch_repeat_interleave(self, repeats):
        repeat_batch_rows(self, ("_k", "_v", "_raw"), repeats)

    def nbytes(self):
        if self._k is None:
            return 0
        return sum(buf.numel() * buf.element_size() for buf in (self._k, self._v, self._raw))


class StaticSinkLayer(SinkLayer):
    """A :class:`SinkLayer` that generate's compiled decode path may use (``is_compileable``)."""

    is_compileable = True


class SinkCache(Cache):
    """StreamingLLM cache: the first ``num_sink_tokens`` tokens plus the most recent ones, ``window_length`` in all.

    Generates past any length in bounded memory and without the quality collapse of a plain
    window: the sink tokens keep absorbing attention. Keys are kept consistent with in-cache
    positions (see :mod:`kvgen.cache.sink`), with every RoPE variant, partial rotary included.
    ``get_seq_length()`` counts every token streamed; ``get_max_length()`` is ``window_length``.

    Example:
        >>> from kvgen import SinkCache
        >>> past_key_values = SinkCache(window_length=256, num_sink_tokens=4)
        >>> past_key_values.get_max_length()
        256
        >>> out = model.generate(**inputs, max_new_tokens=300, past_key_values=past_key_values)  # doctest: +SKIP
        >>> out = model.generate(**inputs, cache_implementation="sink",
        ...                      cache_config={"window_length": 256, "num_sink_tokens": 4})   # doctest: +SKIP
    """

    layer_class = SinkLayer

    def __init__(self, window_length: int, num_sink_tokens: int, **unused_for_compatibility):
        self.window_length, self.num_sink_tokens = _check_sizes(window_length, num_sink_tokens)
        super().__init__(layer_factory=self._new_layer)

    def _new_layer(self, layer_idx: int) -> SinkLayer:
        return self.layer_class(self.window_length, self.num_sink_tokens)

    def _empty_max_cache_shape(self):
        return self.window_length

    def get_max_length(self) -> int:
        """The most tokens the cache holds (``window_length``): crop inputs to this, as the seeds do."""
        return self.window_length


class StaticSinkCache(SinkCache):
    """A :class:`SinkCache` with preallocated layers that ``generate()`` decodes with ``torch.compile``.

    Same tokens kept and same outputs as :class:`SinkCache`. ``max_cache_len`` (default: the
    config's ``max_position_embeddings``) is the longest sequence, prompt plus new tokens, that
    ``generate()``'s compiled decode step accepts: its padding mask spans every position. Eager
    ``forward()`` calls take streams of any length.

    Example:
        >>> cache = StaticSinkCache(config=model.config, window_length=1024, num_sink_tokens=4,
        ...                         max_cache_len=4096)                               # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=2000)  # doctest: +SKIP
        >>> out = model.generate(**inputs, cache_implementation="static_sink",
        ...                      cache_config={"window_length": 1024, "num_sink_tokens": 4})  # doctest: +SKIP
    """

    layer_class = StaticSinkLayer

    def __init__(self, config=None, window_length: int | None = None, num_sink_tokens: int | None = None,
                 max_cache_len: int | None = None, max_batch_size: int | None = None, device=None, dtype=None,
                 batch_size: int | None = None, **unused_for_compatibility):
        if config is None:
            raise ValueError(
                "StaticSinkCache needs the model's config: StaticSinkCache(config=model.config, window_length=..., "
                "num_sink_tokens=...)"
            )
        if window_length is None or num_sink_tokens is None:
            raise ValueError("StaticSinkCache needs window_length= and num_sink_tokens= (e.g. 1024 and 4)")
        super().__init__(window_length, num_sink_tokens)
        config = text_config(config)
        self.max_cache_len = max_cache_len or config_value(config, "max_position_embeddings")
        if self.max_cache_len is None:
            raise ValueError("StaticSinkCache needs max_cache_len (the longest prompt plus new tokens)")
        heads = config_value(config, "num_key_value_heads") or config_value(config, "num_attention_heads")
        head_dim = config_value(config, "head_dim") or (
            config_value(config, "hidden_size") // config_value(config, "num_attention_heads"))
        self.layers = [StaticSinkLayer(window_length, num_sink_tokens, max_batch_size or batch_size, heads, head_dim,
                                       device, dtype)
                       for _ in range(config_value(config, "num_hidden_layers"))]
        self._layer_factory = None

    def get_max_cache_shape(self, layer_idx: int | None = None) -> int | None:
        """Longest sequence generate's compiled path accepts (``max_cache_len``); with ``layer_idx``, its slots."""
        if layer_idx is None:
            return self.max_cache_len
        return super().get_max_cache_shape(layer_idx)

    def _empty_max_cache_shape(self):
        return self.max_cache_len


# -- cache_implementation="sink" / "static_sink" ---------------------------------------------------------

def _sink_arguments(name: str, config, cache_config) -> dict:
    if config is not None and "sliding_attention" in (config_value(text_config(config), "layer_types") or []):
        raise ValueError(
            f"cache_implementation={name!r} is not available for models with sliding-window attention layers: "
            "their window mask would hide the sink tokens. Use 'sliding_window' or 'hybrid' for this model."
        )
    if cache_config is None:
        raise ValueError(
            f"cache_implementation={name!r} needs cache_config={{'window_length': ..., 'num_sink_tokens': ...}}, "
            "e.g. {'window_length': 256, 'num_sink_tokens': 4}"
        )
    known = ("window_length", "num_sink_tokens")
    if isinstance(cache_config, dict):
        unknown = sorted(set(cache_config) - set(known))
        if unknown:
            raise ValueError(f"cache_config for {name!r} has unknown keys {unknown}; it takes {list(known)}")
    arguments = {k: config_value(cache_config, k) for k in known}
    missing = [k for k, v in arguments.items() if v is None]
    if missing:
        raise ValueError(f"cache_config for {name!r} lacks {missing}; e.g. {{'window_length': 256, "
                         "'num_sink_tokens': 4}")
    return arguments


@register_cache("sink")
def _sink(config, batch_size, max_cache_len, device, dtype, cache_config):
    return SinkCache(**_sink_arguments("sink", config, cache_config))


@register_cache("static_sink")
def _static_sink(config, batch_size, max_cache_len, device, dtype, cache_config):
    return StaticSinkCache(config=config, max_cache_len=max_cache_len, max_batch_size=batch_size, device=device,
                           dtype=dtype, **_sink_arguments("static_sink", config, cache_config))
