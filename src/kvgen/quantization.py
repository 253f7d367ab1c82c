"""Quantizing a float checkpoint's linear layers at load: int8 per output channel, int4 in groups.

``from_pretrained(path, quantization_config=TorchAoConfig("int8_weight_only"))`` (or
``"int4_weight_only"`` with ``group_size`` 32, 64 or 128), named as transformers names its
torchao weight-only settings. The layers become :class:`~kvgen.models.quantized_linear.QuantizedLinear`
over kvgen's formats (:mod:`kvgen.models.packed`):

* int8: symmetric, one float32 scale per output row (``absmax / 127``), row = K int8 + scale;
* int4: asymmetric groups, float32 scale ``(high - low) / 15`` and ``low``, codes 0..15, where
  ``[low, high]`` is the group's [min, max] narrowed by the least-squared-error pick among 25
  cuts (as the KIVI cache quantizer picks its 2-bit key ranges).

On a CPU with AVX-512 VNNI the layers keep their rows in tiles of 16 (:func:`~kvgen.models.packed.tile_rows`),
whose products take integer dot products (a decode step of SmolLM2 in int8 1.1x faster, 2 threads).

As transformers does, ``lm_head`` (the output embedding) stays in float unless
``modules_to_not_convert`` says otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kvgen.cache.quantizers import _search_range
from kvgen.models.packed import PackedWeight, tile_rows

_INT4_GROUPS = (32, 64, 128)
_CUTS = (0.0, 0.05, 0.1, 0.15, 0.2)
_RANGE_CUTS = tuple((a, b) for a in _CUTS for b in _CUTS)  # 25 candidate ranges per int4 group


def quantize_int8(w: torch.Tensor) -> PackedWeight:
    """(N, K) float -> int8 rows, each followed by its float32 scale."""
    w = w.float()
    scale = w.abs().amax(dim=1, keepdim=True) / 127  # (N, 1)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)  # (N, K)
    rows = torch.cat([q.view(torch.uint8), scale.view(torch.uint8)], dim=1)  # (N, K + 4)
    return PackedWeight([(1008, rows)], w.shape[1])


def quantize_int4(w: torch.Tensor, group_size: int) -> PackedWeight:
    """(N, K) float -> int4 groups: per group float32 scale, float32 min, group/2 bytes of nibbles."""
    if group_size not in _INT4_GROUPS:
        raise ValueError(f"int4 group_size must be one of {_INT4_GROUPS}, not {group_size}")
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 groups of {group_size} do not divide {k} input features; choose a group "
                         f"size among {[g for g in _INT4_GROUPS if k % g == 0] or _INT4_GROUPS} that does")
    g = w.float().reshape(n, k // group_size, group_size)
    low, high = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)  # (N, groups, 1)
    # per group, the narrowed range [low + a span, high - b span] of least squared error (outliers clip)
    low, high = _search_range(g, low, high, _RANGE_CUTS, 15, torch.float32)
    scale = (high - low) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round((g - low) / scale).clamp_(0, 15).to(torch.uint8)  # (N, groups, G)
    half = group_size // 2
    nibbles = q[..., :half] | (q[..., half:] << 4)  # (N, groups, G / 2)
    blocks = torch.cat([scale.view(torch.uint8), low.view(torch.uint8), nibbles], dim=-1)  # (N, groups, 8 + G / 2)
    return PackedWeight([(1000 + group_size, blocks.reshape(n, -1))], k)


@dataclass
class TorchAoConfig:
    """Weight-only quantization at load, as transformers' ``TorchAoConfig`` names it.

    ``quant_type``: ``"int8_weight_only"`` (per output channel) or ``"int4_weight_only"``
    (groups of ``group_size``: 32, 64 or 128). ``modules_to_not_convert``: names of linear
    layers kept in float (default ``["lm_head"]``; ``[]`` quantizes it too).

    Example:
        >>> from kvgen import AutoModelForCausalLM, TorchAoConfig
        >>> config = TorchAoConfig("int4_weight_only", group_size=32)
        >>> model = AutoModelForCausalLM.from_pretrained(path, quantization_config=config)  # doctest: +SKIP
    """

    quant_type: str
    group_size: int = 128
    modules_to_not_convert: list[str] = field(default_factory=lambda: ["lm_head"])

    def __post_init__(self):
        if self.quant_type not in ("int8_weight_only", "int4_weight_only"):
            raise ValueError(f"quant_type {self.quant_type!r} is not supported; use 'int8_weight_only' or "
                             "'int4_weight_only'")
        if self.quant_type == "int4_weight_only" and self.group_size not in _INT4_GROUPS:
            raise ValueError(f"int4 group_size must be one of {_INT4_GROUPS}, not {self.group_size}")

    def quantize(self, w: torch.Tensor) -> PackedWeight:
        return quantize_int8(w) if self.quant_type == "int8_weight_only" else quantize_int4(w, self.group_size)

    def quantize_model(self, model: nn.Module) -> None:
        """Replace every linear layer of ``model`` (except ``modules_to_not_convert``) by a quantized one."""
        from kvgen.kernels import kernels_available, unavailable_reason
        from kvgen.models.decode_blocks import run_blocks_eagerly
        from kvgen.models.quantized_linear import QuantizedLinear

        if model.device.type == "cpu" and not kernels_available():
            raise RuntimeError(f"quantization needs kvgen's kernels, which are unavailable: {unavailable_reason()}")
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] not in self.modules_to_not_convert \
                    and name not in self.modules_to_not_convert:
                bias = None if module.bias is None else module.bias.detach().float()
                weight = self.quantize(module.weight.detach())
                if module.weight.device.type == "cpu":  # tiles of 16 rows where integer dot products run
                    weight = tile_rows(weight)
                model.set_submodule(name, QuantizedLinear(weight, bias))
        run_blocks_eagerly(model)


def parse_quantization_config(config) -> TorchAoConfig | None:
    """A :class:`TorchAoConfig`, its dict (``{"quant_type": ..., "group_size": ...}``), or None."""
    if config is None or isinstance(config, TorchAoConfig):
        return config
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if k != "quant_method"}
        return TorchAoConfig(**config)
    raise TypeError(f"quantization_config must be a kvgen.TorchAoConfig or a dict, not {type(config).__name__}")
