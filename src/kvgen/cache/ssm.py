"""State-space layers: :class:`SSMLayer`, :class:`MambaCache`, :class:`HybridMambaAttentionDynamicCache`.

A Mamba mixer does not keep one entry per token: it keeps a fixed-size state, the last
``d_conv`` inputs of its causal convolution and the recurrent SSM state. :class:`SSMLayer`
is one more layer kind of the cache list; the mixer reads it with
``cache.read_ssm_states(layer_idx)`` and writes it back with ``cache.write_ssm_states(...)``.

Layer kinds come from ``config.layer_types``: ``"mamba"`` (kvgen's name) or
``"linear_attention"`` (transformers' name) give an :class:`SSMLayer`, so
``DynamicCache(config=...)`` and ``StaticCache(config=...)`` of a Mamba or Jamba config hold
SSM layers where the model has Mamba mixers. :class:`MambaCache` and
:class:`HybridMambaAttentionDynamicCache` are the seeds' names for those same lists, with
the states allocated up front when the batch size and dtype are given.

The state mixes every token seen, so it can move forward only: it cannot be cropped to an
earlier length (``crop`` raises), and ``cache_position`` must continue where it stopped.
"""

from __future__ import annotations

import torch

from kvgen.cache.base import CacheLayer, check_next_positions, config_value, register_layer_kind, snapshot, text_config
from kvgen.cache.dynamic import DynamicCache
from kvgen.cache.registry import register_cache
from kvgen.cache.static import repeat_batch_rows, select_batch_rows

#: ``layer_types`` entries that name a state-space (Mamba) layer
SSM_LAYER_TYPES = ("mamba", "linear_attention")
_STATES = ("conv_state", "ssm_state")


def ssm_dims(config) -> tuple[int | None, int | None, int | None]:
    """``(d_inner, d_conv, d_state)`` of a Mamba config (``state_size``...) or a Jamba one (``mamba_*``)."""
    hidden = config_value(config, "hidden_size")
    if config_value(config, "mamba_d_state") is not None:  # Jamba
        expand = config_value(config, "mamba_expand")
        return (expand * hidden if expand and hidden else None, config_value(config, "mamba_d_conv"),
                config_value(config, "mamba_d_state"))
    expand = config_value(config, "expand")
    d_inner = config_value(config, "intermediate_size") or (expand * hidden if expand and hidden else None)
    return d_inner, config_value(config, "conv_kernel"), config_value(config, "state_size")


class SSMLayer(CacheLayer):
    """The state of one Mamba mixer: ``conv_state`` (B, d_inner, d_conv) and ``ssm_state`` (B, d_inner, d_state).

    ``conv_state`` holds the last ``d_conv`` inputs of the causal convolution (oldest
    first, as in transformers) in the model's dtype; ``ssm_state`` is kept in float32
    whatever the model's dtype, as transformers does. The states are allocated on the
    first write, or up front with :meth:`allocate` (given batch size and dtype).

    Example:
        >>> layer = SSMLayer(d_inner=8, d_conv=4, d_state=2, batch_size=1, dtype=torch.float32)
        >>> layer.read_ssm_states()  # nothing seen yet
        (None, None)
        >>> layer.write_ssm_states(torch.ones(1, 8, 4), torch.ones(1, 8, 2), torch.arange(5))
        >>> layer.get_seq_length(), tuple(layer.read_ssm_states()[1].shape)
        (5, (1, 8, 2))
    """

    def __init__(self, d_inner: int | None = None, d_conv: int | None = None, d_state: int | None = None,
                 batch_size: int | None = None, dtype: torch.dtype | None = None, device=None):
        self.d_inner, self.d_conv, self.d_state = d_inner, d_conv, d_state
        self.batch_size = batch_size
        self.conv_state: torch.Tensor | None = None  # (B, d_inner, d_conv)
        self.ssm_state: torch.Tensor | None = None  # (B, d_inner, d_state), float32
        self._seen = 0
        if batch_size is not None and dtype is not None:
            self.allocate(batch_size, dtype, device)

    def allocate(self, batch_size: int, dtype: torch.dtype, device=None) -> None:
        """Allocate zero states for ``batch_size`` sequences (needs the layer's sizes)."""
        if None in (self.d_inner, self.d_conv, self.d_state):
            raise ValueError(
                "cannot allocate a state-space layer without its sizes: build it from the model's config "
                "(MambaCache(model.config, batch_size, dtype, device)), which gives d_inner, d_conv and d_state"
            )
        self.batch_size = batch_size
        self.conv_state = torch.zeros(batch_size, self.d_inner, self.d_conv, dtype=dtype, device=device)
        self.ssm_state = torch.zeros(batch_size, self.d_inner, self.d_state, dtype=torch.float32, device=device)

    # -- the mixer's interface ---------------------------------------------------------------------
    def read_ssm_states(self):
        if self._seen == 0:
            return None, None
        return self.conv_state, self.ssm_state

    def write_ssm_states(self, conv_state, ssm_state, cache_position):
        if self.conv_state is None:  # first write: take the mixer's tensors as they are
            self.conv_state, self.ssm_state = conv_state, ssm_state.float()
            self.batch_size = conv_state.shape[0]
            self.d_inner, self.d_conv, self.d_state = conv_state.shape[1], conv_state.shape[2], ssm_state.shape[2]
        else:
            if conv_state.shape != self.conv_state.shape or ssm_state.shape != self.ssm_state.shape:
                raise ValueError(
                    f"new states have shapes {tuple(conv_state.shape)} and {tuple(ssm_state.shape)} but this layer "
                    f"holds {tuple(self.conv_state.shape)} and {tuple(self.ssm_state.shape)} (batch, d_inner, "
                    f"d_conv / d_state): build the cache for batch size {conv_state.shape[0]} and this model's config"
                )
            if self.conv_state.device != conv_state.device:  # built on another device than the model's
                self.conv_state = self.conv_state.to(conv_state.device)
                self.ssm_state = self.ssm_state.to(conv_state.device)
            self.conv_state.copy_(conv_state)  # in place: the buffers keep their address
            self.ssm_state.copy_(ssm_state)
        self._seen += cache_position.shape[0]

    def check_cache_position(self, cache_position):
        check_next_positions(cache_position, self._seen, "this state-space (Mamba) layer has seen",
                             "Its state can only move forward: pass cache_position=torch.arange("
                             "cache.get_seq_length(), cache.get_seq_length() + new_tokens), or call cache.reset() "
                             "to start again from an empty state.")

    # -- sizes and editing ---------------------------------------------------------------------------
    def get_seq_length(self):
        return self._seen

    @property
    def keys(self):
        raise TypeError(
            "a state-space (Mamba) layer holds conv and SSM states, not keys and values; read them with "
            "cache.conv_states / cache.ssm_states. Mamba and Jamba caches have no legacy tuple form: keep the Cache."
        )

    values = keys

    def reset(self):
        if self.conv_state is not None:
            self.conv_state.zero_()
            self.ssm_state.zero_()
        self._seen = 0

    def crop(self, max_length):
        if max_length < self._seen:
            raise ValueError(
                f"cannot crop a state-space (Mamba) layer to {max_length} tokens: its state mixes all {self._seen} "
                "tokens seen and cannot be taken back to an earlier length. Call cache.reset() and feed the first "
                f"{max_length} tokens again (or keep a copy.deepcopy of the cache from that point)."
            )

    def checkpoint(self, new_tokens):
        return snapshot(self)  # the state mixes every token in: no crop can take one out

    def batch_tensor(self):
        return self.conv_state

    def batch_select_indices(self, indices):
        select_batch_rows(self, _STATES, indices)

    def batch_repeat_interleave(self, repeats):
        repeat_batch_rows(self, _STATES, repeats)

    def nbytes(self):
        return sum(t.numel() * t.element_size() for t in (self.conv_state, self.ssm_state) if t is not None)


def ssm_layer(config, batch_size: int | None = None, dtype=None, device=None) -> SSMLayer:
    """An :class:`SSMLayer` sized for ``config``; allocated now when ``batch_size`` and ``dtype`` are given."""
    return SSMLayer(*ssm_dims(config), batch_size=batch_size, dtype=dtype, device=device)


register_layer_kind(SSM_LAYER_TYPES, ssm_layer)


def _allocate_ssm_layers(cache: DynamicCache, batch_size, dtype, device) -> None:
    if batch_size is not None:
        for layer in cache.layers:
            if isinstance(layer, SSMLayer):
                layer.allocate(batch_size, dtype or torch.float32, device)


class MambaCache(DynamicCache):
    """The conv and SSM states of every layer of a Mamba model: one :class:`SSMLayer` per layer.

    ``generate()`` and ``forward()`` build the same layers on their own
    (``DynamicCache(config=model.config)``); build one by hand to keep or reuse the
    state. With ``batch_size`` the states are allocated now (in ``dtype``, default
    float32, on ``device``); without it, on the first forward pass.

    Example:
        >>> cache = MambaCache(model.config, batch_size=1, dtype=model.dtype, device=model.device)  # doctest: +SKIP
        >>> out = model(input_ids, past_key_values=cache)                                          # doctest: +SKIP
        >>> cache.get_seq_length() == input_ids.shape[1]                                           # doctest: +SKIP
        True
    """

    def __init__(self, config, batch_size: int | None = None, dtype: torch.dtype | None = None, device=None,
                 max_batch_size: int | None = None, **unused_for_compatibility):
        if config is None:
            raise ValueError("MambaCache needs the model's config: MambaCache(model.config, batch_size, dtype, device)")
        config = text_config(config)
        kinds = list(config_value(config, "layer_types") or [])
        if not kinds or any(kind not in SSM_LAYER_TYPES for kind in kinds):
            raise ValueError(
                f"MambaCache holds state-space layers only, but this config's layer_types are {sorted(set(kinds))}: "
                "use HybridMambaAttentionDynamicCache(config, batch_size, dtype, device) for models that mix "
                "attention and Mamba layers (Jamba), or DynamicCache(config=model.config)"
            )
        super().__init__(config=config)
        _allocate_ssm_layers(self, batch_size or max_batch_size, dtype, device)


class HybridMambaAttentionDynamicCache(DynamicCache):
    """The cache of a model that mixes attention and Mamba layers (Jamba).

    Attention layers grow like :class:`~kvgen.DynamicCache` layers; Mamba layers hold an
    :class:`SSMLayer` (allocated now when ``batch_size`` is given). ``generate()`` builds
    the same layers on its own.

    Example:
        >>> cache = HybridMambaAttentionDynamicCache(model.config, batch_size=1, dtype=model.dtype,
        ...                                          device=model.device)  # doctest: +SKIP
        >>> logits = model(input_ids, past_key_values=cache).logits       # doctest: +SKIP
    """

    def __init__(self, config, batch_size: int | None = None, dtype: torch.dtype | None = None, device=None,
                 max_batch_size: int | None = None, **unused_for_compatibility):
        if config is None:
            raise ValueError("HybridMambaAttentionDynamicCache needs the model's config: "
                             "HybridMambaAttentionDynamicCache(model.config, batch_size, dtype, device)")
        super().__init__(config=config)
        _allocate_ssm_layers(self, batch_size or max_batch_size, dtype, device)


@register_cache("mamba")
def _mamba(config, batch_size, max_cache_len, device, dtype, cache_config):
    return MambaCache(config, batch_size=batch_size, dtype=dtype, device=device)
