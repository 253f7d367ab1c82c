"""``EncoderDecoderCache``: a self-attention cache and a cross-attention cache side by side.

The decoder's self-attention grows one token per step; its cross-attention attends to the
encoder output, whose keys and values are computed once, on the first decoder step, and
read back afterwards. The two halves are ordinary caches and can be of different types
(e.g. a ``StaticCache`` for the self-attention and a ``DynamicCache`` for the cross-attention).

Models ask the cache, per layer, whether the cross-attention is already filled
(:meth:`EncoderDecoderCache.cross_attention_filled`); they never look at cache types.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from kvgen.cache.base import Cache, CacheLayer, row_indices
from kvgen.cache.dynamic import DynamicCache

#: per layer: (self-attention key, value, cross-attention key, value)
LegacyEncoderDecoderCache = tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], ...]


class EncoderDecoderCache(Cache):
    """The cache of an encoder-decoder model: ``self_attention_cache`` and ``cross_attention_cache``.

    Everything the generic machinery asks a :class:`Cache` (``get_seq_length``, ``crop``,
    ``update``, masks, ``token_ids``, ``is_compileable``, ``get_max_cache_shape``) is
    answered by the self-attention half. ``reset``, ``reorder_cache``,
    ``batch_select_indices`` and ``batch_repeat_interleave`` act on both halves.
    ``EncoderDecoderCache(legacy)`` with one argument, a tuple of 4-tuples per layer,
    builds two ``DynamicCache`` halves (as ``from_legacy_cache``).

    Example:
        >>> from kvgen import DynamicCache, EncoderDecoderCache
        >>> cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        >>> k = v = torch.zeros(1, 2, 7, 4)  # encoder length 7
        >>> _ = cache.update_cross_attention(k, v, 0)
        >>> cache.cross_attention_filled(0), cache.get_seq_length()
        (True, 0)
    """

    # Cache.__init__ is not called: ``layers`` and ``token_ids`` belong to the self-attention half.
    def __init__(self, *caches: Any) -> None:
        if len(caches) == 1:
            legacy = EncoderDecoderCache.from_legacy_cache(caches[0])
            caches = (legacy.self_attention_cache, legacy.cross_attention_cache)
        if len(caches) != 2:
            raise TypeError(
                f"EncoderDecoderCache takes (self_attention_cache, cross_attention_cache), or one legacy tuple of "
                f"(self key, self value, cross key, cross value) per layer; got {len(caches)} arguments"
            )
        for name, cache in zip(("self_attention_cache", "cross_attention_cache"), caches):
            if not isinstance(cache, Cache) or isinstance(cache, EncoderDecoderCache):
                raise TypeError(f"{name} must be a kvgen Cache (e.g. DynamicCache()), got {type(cache).__name__}")
        self.self_attention_cache: Cache = caches[0]
        self.cross_attention_cache: Cache = caches[1]
        #: layer index -> whether its cross-attention keys/values are stored (transformers' ``is_updated``)
        self.is_updated: dict[int, bool] = {
            i: layer.keys is not None and layer.get_seq_length() > 0
            for i, layer in enumerate(self.cross_attention_cache.layers)
        }

    # -- cross-attention (model-facing) ------------------------------------------------------------
    def cross_attention_filled(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` already holds its cross-attention keys/values."""
        return self.is_updated.get(layer_idx, False)

    def update_cross_attention(self, key_states: torch.Tensor, value_states: torch.Tensor,
                               layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the encoder keys/values (B, H, S, D) of ``layer_idx`` at positions 0..S-1; return them."""
        s = key_states.shape[-2]
        positions = torch.arange(s, device=key_states.device)
        layer = self.cross_attention_cache.layer(layer_idx)
        if layer.keys is not None and layer.get_seq_length() > 0:
            layer.reset()  # refilled (e.g. after a reset of the whole cache): start from position 0 again
        if not torch.compiler.is_compiling():
            layer.check_cache_position(positions)
        keys, values = self.cross_attention_cache.update(key_states, value_states, layer_idx,
                                                         {"cache_position": positions})
        self.is_updated[layer_idx] = True
        return keys[:, :, :s], values[:, :, :s]  # a preallocated layer may return more (empty) slots

    def cross_attention_states(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored cross-attention keys and values (B, H, S, D) of ``layer_idx``."""
        if not self.cross_attention_filled(layer_idx):
            raise ValueError(f"the cross-attention of layer {layer_idx} is not filled yet; run the encoder first")
        layer = self.cross_attention_cache.layers[layer_idx]
        return layer.keys, layer.values

    # -- the Cache interface, answered by the self-attention half ----------------------------------
    @property
    def layers(self) -> list[CacheLayer]:
        return self.self_attention_cache.layers

    @property
    def token_ids(self) -> torch.Tensor | None:
        return self.self_attention_cache.token_ids

    @token_ids.setter
    def token_ids(self, value: torch.Tensor | None) -> None:
        self.self_attention_cache.token_ids = value

    def layer(self, layer_idx: int) -> CacheLayer:
        return self.self_attention_cache.layer(layer_idx)

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        """Self-attention update (see :meth:`Cache.update`)."""
        return self.self_attention_cache.update(key_states, value_states, layer_idx, cache_kwargs)

    def key_positions(self, layer_idx, cache_position):
        return self.self_attention_cache.key_positions(layer_idx, cache_position)

    def mask_group(self, layer_idx):
        return self.self_attention_cache.mask_group(layer_idx)

    def check_cache_position(self, cache_position):
        self.self_attention_cache.check_cache_position(cache_position)

    def record_token_ids(self, input_ids, cache_position):
        self.self_attention_cache.record_token_ids(input_ids, cache_position)

    def common_prefix_length(self, input_ids):
        return self.self_attention_cache.common_prefix_length(input_ids)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by the decoder's self-attention (the next token's ``cache_position``)."""
        return self.self_attention_cache.get_seq_length(layer_idx)

    def get_max_cache_shape(self, layer_idx: int = 0):
        return self.self_attention_cache.get_max_cache_shape(layer_idx)

    def get_max_length(self):
        return self.self_attention_cache.get_max_length()

    @property
    def is_compileable(self) -> bool:
        return self.self_attention_cache.is_compileable

    def nbytes(self) -> int:
        return self.self_attention_cache.nbytes() + self.cross_attention_cache.nbytes()

    # -- editing -----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty both halves: the next forward pass recomputes the cross-attention."""
        self.self_attention_cache.reset()
        self.cross_attention_cache.reset()
        self.is_updated = {i: False for i in self.is_updated}

    def crop(self, max_length: int) -> None:
        """Crop the self-attention half (the encoder output does not change)."""
        self.self_attention_cache.crop(max_length)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor | list[int] | tuple[int, ...]) -> None:
        """Keep (and reorder) batch rows ``indices`` of both halves, checked against either before either changes."""
        indices = row_indices(indices, [*self.self_attention_cache.layers, *self.cross_attention_cache.layers])
        self.self_attention_cache.batch_select_indices(indices)
        self.cross_attention_cache.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.self_attention_cache.batch_repeat_interleave(repeats)
        self.cross_attention_cache.batch_repeat_interleave(repeats)

    def share_rows(self, repeats: int) -> None:
        """Both halves repeat their rows, sharing storage where they can (the encoder's keys above all)."""
        self.self_attention_cache.share_rows(repeats)
        self.cross_attention_cache.share_rows(repeats)

    def fork(self, n: int) -> list["EncoderDecoderCache"]:
        """``n`` caches sharing both halves' tokens (see :meth:`Cache.fork`)."""
        forks = [EncoderDecoderCache(own, cross) for own, cross in
                 zip(self.self_attention_cache.fork(n), self.cross_attention_cache.fork(n))]
        for fork in forks:
            fork.is_updated = dict(self.is_updated)
        return forks

    # -- legacy views ------------------------------------------------------------------------------
    @classmethod
    def from_legacy_cache(cls, past_key_values: LegacyEncoderDecoderCache | None) -> "EncoderDecoderCache":
        """Build from one ``(self key, self value, cross key, cross value)`` tuple per layer (dynamic halves)."""
        self_pairs, cross_pairs = [], []
        for i, entry in enumerate(past_key_values or ()):
            if len(entry) != 4:
                raise ValueError(
                    f"legacy encoder-decoder cache layer {i} must hold 4 tensors (self-attention key, value, "
                    f"cross-attention key, value); got {len(entry)}"
                )
            self_pairs.append(tuple(entry[:2]))
            cross_pairs.append(tuple(entry[2:]))
        return cls(DynamicCache.from_legacy_cache(self_pairs), DynamicCache.from_legacy_cache(cross_pairs))

    def to_legacy_cache(self) -> LegacyEncoderDecoderCache:
        """One ``(self key, self value, cross key, cross value)`` tuple per layer."""
        self_pairs = self.self_attention_cache.to_legacy_cache()
        cross_pairs = self.cross_attention_cache.to_legacy_cache()
        if len(self_pairs) != len(cross_pairs):
            raise ValueError(
                f"the self-attention half has {len(self_pairs)} layers but the cross-attention half "
                f"{len(cross_pairs)}; there is no 4-tuple per layer to make"
            )
        return tuple(s + c for s, c in zip(self_pairs, cross_pairs))

    def __len__(self) -> int:
        return len(self.self_attention_cache)

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, ...]:
        return tuple(self.self_attention_cache[layer_idx]) + tuple(self.cross_attention_cache[layer_idx])

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        for i in range(len(self)):
            yield self[i]

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(self_attention_cache={self.self_attention_cache!r}, "
                f"cross_attention_cache={self.cross_attention_cache!r})")


def _batch_rows(layers: list[CacheLayer]) -> int | None:
    """Batch rows stored by the first of ``layers`` (``None`` when there is none or it is empty)."""
    keys = layers[0].keys if layers else None
    return None if keys is None else keys.shape[0]


def as_encoder_decoder_cache(past_key_values) -> tuple[EncoderDecoderCache | None, bool]:
    """``(cache, was_legacy)`` for a model's ``past_key_values`` argument.

    ``None`` stays ``None``; a plain cache becomes the self-attention half next to a new
    ``DynamicCache``; a legacy tuple of 4-tuples is converted (and ``was_legacy`` is True).
    """
    if past_key_values is None or isinstance(past_key_values, EncoderDecoderCache):
        return past_key_values, False
    if isinstance(past_key_values, (tuple, list)):
        return EncoderDecoderCache.from_legacy_cache(past_key_values), True
    if isinstance(past_key_values, Cache):
        return EncoderDecoderCache(past_key_values, DynamicCache()), False
    raise TypeError(
        "past_key_values must be an EncoderDecoderCache, a kvgen Cache (used for the self-attention) or a legacy "
        f"tuple of (self key, self value, cross key, cross value) per layer; got {type(past_key_values).__name__}"
    )
