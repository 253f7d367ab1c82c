"""Rotary position embeddings: default, linear, dynamic (NTK), llama3 scaling and partial rotary.

``RotaryEmbedding(config)(position_ids)`` gives ``cos, sin`` of shape (B, T, rotary_dim)
once per forward pass; :func:`apply_rotary` rotates queries and keys with them (the
first ``rotary_dim`` channels; the rest pass through, for partial rotary).
"""

from __future__ import annotations

import math

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3")
_BLOCK = 64  # positions whose tables one-token steps compute at once


def _base_inv_freq(base: float, dim: int, device=None) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))  # (dim/2,)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    factor = params["factor"]
    low, high = params["low_freq_factor"], params["high_freq_factor"]
    old_context = params["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for a model config (``rope_parameters``, ``head_dim``, ``max_position_embeddings``).

    Example:
        >>> from kvgen.config import PretrainedConfig
        >>> cfg = PretrainedConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=1)
        >>> cos, sin = RotaryEmbedding(cfg)(torch.arange(5)[None])
        >>> tuple(cos.shape)
        (1, 5, 16)
    """

    def __init__(self, config, params: dict | None = None, device=None):
        super().__init__()
        self.params = dict(params or config.rope_parameters)
        self.rope_type = self.params.get("rope_type", "default")
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported; supported types: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        self.rotary_dim = int(config.head_dim * self.params.get("partial_rotary_factor", 1.0))
        self.max_position_embeddings = config.max_position_embeddings
        self.max_seq_len_cached = config.max_position_embeddings
        inv_freq = self._inv_freq(seq_len=None, device=device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)
        self._block: tuple | None = None  # (first position, dtype, inv_freq, cos, sin) of the last one-token steps

    def _inv_freq(self, seq_len: int | None, device=None) -> torch.Tensor:
        base = self.params["rope_theta"]
        if self.rope_type == "dynamic":
            factor = self.params["factor"]
            seq_len = max(seq_len or 0, self.max_position_embeddings)
            base = base * ((factor * seq_len / self.max_position_embeddings) - (factor - 1)) ** (
                self.rotary_dim / (self.rotary_dim - 2))
        inv_freq = _base_inv_freq(base, self.rotary_dim, device)
        if self.rope_type == "linear":
            inv_freq = inv_freq / self.params["factor"]
        elif self.rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, self.params)
        return inv_freq

    def _dynamic_update(self, position_ids: torch.Tensor) -> None:
        """Dynamic NTK: grow the base past the trained length, return to it for short inputs."""
        seq_len = int(position_ids.max()) + 1
        if seq_len > self.max_seq_len_cached:
            self.inv_freq = self._inv_freq(seq_len, position_ids.device)
            self.max_seq_len_cached = seq_len
        if seq_len < self.max_position_embeddings < self.max_seq_len_cached:
            self.inv_freq = self.original_inv_freq.to(position_ids.device)
            self.max_seq_len_cached = self.max_position_embeddings

    @torch.no_grad()
    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32):
        """``position_ids`` (B, T) -> ``cos, sin`` (B, T, rotary_dim) in ``dtype``.

        ``sin`` has its first half negated: the sign of ``rotate_half`` is folded in, so
        :func:`apply_rotary` is ``x * cos + roll(x) * sin`` (the same arithmetic, fewer kernels).
        """
        if self.rope_type == "dynamic":
            self._dynamic_update(position_ids)
        elif position_ids.dim() == 2 and position_ids.shape[1] == 1 and (position_ids.shape[0] == 1 or
                                                                         position_ids.stride(0) == 0):
            if not torch.compiler.is_compiling() and not (position_ids.is_cuda and
                                                          torch.cuda.is_current_stream_capturing()):
                return self._one_position(position_ids, dtype)  # one position for all rows: a decode step
        return self._tables(position_ids, dtype)

    def _tables(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(position_ids.device)  # (B, T, dim/2)
        return torch.cat((freqs, freqs), dim=-1).cos().to(dtype), torch.cat((-freqs, freqs), dim=-1).sin().to(dtype)

    def _one_position(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` (B, 1, rotary_dim) of a (B, 1) ``position_ids`` holding one position, sliced from tables of
        the ``_BLOCK`` positions around it, computed together and kept for the next steps (each step computing its
        own: ~0.1 ms of seven small ops, 2% of a SmolLM2 Q4_1 step)."""
        position = int(position_ids[0, 0]) if position_ids.shape[0] > 1 else int(position_ids)
        block = self._block
        if (block is None or not 0 <= position - block[0] < _BLOCK or block[1] != dtype or block[2] is not self.inv_freq
                or block[3].device != position_ids.device):
            if position < 0:
                return self._tables(position_ids, dtype)
            first = position - position % _BLOCK
            cos, sin = self._tables(torch.arange(first, first + _BLOCK, device=position_ids.device)[None], dtype)
            block = self._block = (first, dtype, self.inv_freq, cos, sin)  # cos, sin: (1, _BLOCK, rotary_dim)
        i, rows = position - block[0], position_ids.shape[0]
        cos, sin = block[3][:, i:i + 1], block[4][:, i:i + 1]  # (1, 1, rotary_dim)
        return (cos, sin) if rows == 1 else (cos.expand(rows, 1, -1), sin.expand(rows, 1, -1))


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (B, H, T, D) by :class:`RotaryEmbedding`'s ``cos``/``sin`` (B, T, R), R <= D.

    Channels past R pass through (partial rotary). Equal, bit for bit, to transformers'
    ``x * cos + rotate_half(x) * sin`` with an unsigned ``sin``.
    """
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # (B, 1, T, R)
    rotary_dim = cos.shape[-1]
    x_rot = x[..., :rotary_dim]
    rotated = x_rot * cos + x_rot.roll(rotary_dim // 2, dims=-1) * sin
    return rotated if rotary_dim == x.shape[-1] else torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
