"""Mamba (state-spaces/mamba-*-hf checkpoints): a stack of selective state-space mixers, no attention.

Each layer keeps a fixed-size state in the cache (its conv inputs and SSM state, see
:mod:`kvgen.cache.ssm`), so decoding costs the same at every length. Prompts and decoded
tokens run through the selective scan of :mod:`kvgen.models.selective_scan` (kvgen's C++
scan on the CPU). Padding (a 0 in ``attention_mask``) is zeroed before
the projection and after the convolution, as transformers does, so left-padded
sequences start from a clean state.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.cache.dynamic import as_cache
from kvgen.config import PretrainedConfig
from kvgen.models.base import PreTrainedModel, finish_cache, keep_logit_rows, prepare_decoder_inputs
from kvgen.models.linear import Linear
from kvgen.models.llama import ACTIVATIONS, RMSNorm
from kvgen.models.selective_scan import causal_conv, selective_ssm
from kvgen.outputs import CausalLMOutputWithPast


class MambaConfig(PretrainedConfig):
    """A :class:`~kvgen.PretrainedConfig` of ``model_type`` "mamba" (transformers' defaults for the rest).

    Example:
        >>> MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=100).layer_types
        ['mamba', 'mamba']
    """

    def __init__(self, **kwargs):
        super().__init__(**{"model_type": "mamba", "vocab_size": 50280, "hidden_size": 768, "num_hidden_layers": 32,
                            **kwargs})


class MambaCausalLMOutput(CausalLMOutputWithPast):
    """``logits`` and ``past_key_values``; ``cache_params`` is transformers' name for the same cache."""

    @property
    def cache_params(self):
        return self.past_key_values


def padding_of_new_tokens(attention_mask: torch.Tensor | None, cache_position: torch.Tensor) -> torch.Tensor | None:
    """The new tokens' columns of a (B, past + new) padding mask, as (B, T, 1); ``None`` when none is padding."""
    if attention_mask is None:
        return None
    mask = attention_mask[:, cache_position]  # (B, T)
    return None if bool(mask.all()) else mask[..., None]


class MambaMixer(nn.Module):
    """Selective SSM mixer: in_proj -> causal conv -> x_proj (dt, B, C) -> scan -> gate -> out_proj.

    ``ssm_inputs`` turns the projected ``x_proj`` output into ``(dt, B, C)``; Jamba's mixer
    overrides it to normalise them.
    """

    def __init__(self, layer_idx: int, hidden_size: int, d_inner: int, d_conv: int, d_state: int, dt_rank: int,
                 conv_bias: bool, proj_bias: bool, act: str):
        super().__init__()
        self.layer_idx, self.d_state, self.dt_rank = layer_idx, d_state, dt_rank
        self.in_proj = Linear(hidden_size, 2 * d_inner, bias=proj_bias)
        # depthwise causal convolution: the module holds the weights, causal_conv runs it (with the cached inputs)
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, padding=d_conv - 1, bias=conv_bias)
        self.x_proj = Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = Linear(dt_rank, d_inner, bias=True)
        self.A_log = nn.Parameter(torch.zeros(d_inner, d_state))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = Linear(d_inner, hidden_size, bias=proj_bias)
        self.act = ACTIVATIONS[act]

    def ssm_inputs(self, projected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x_proj output (B, T, dt_rank + 2N) -> low-rank dt (B, T, dt_rank), B and C (B, T, N)."""
        return torch.split(projected, [self.dt_rank, self.d_state, self.d_state], dim=-1)

    def forward(self, h: torch.Tensor, cache, cache_position: torch.Tensor, padding: torch.Tensor | None):
        """``h`` (B, T, hidden) -> (B, T, hidden); reads and advances this layer's state in ``cache``."""
        dtype = h.dtype
        if padding is not None:
            h = h * padding
        x, z = self.in_proj(h).chunk(2, dim=-1)  # (B, T, d_inner) each
        conv_state, ssm_state = cache.read_ssm_states(self.layer_idx) if cache is not None else (None, None)
        x, conv_state = causal_conv(x, self.conv1d.weight[:, 0], self.conv1d.bias, conv_state)
        x = self.act(x)
        if padding is not None:
            x = x * padding
        dt, B, C = self.ssm_inputs(self.x_proj(x))
        # (B, T, d_inner); its bias is added in float32 by the scan. F.linear: oneDNN's matmul (kvgen's Linear) took
        # 60-135 us for this rank-48 product of one row, F.linear 16 (mamba-130m's shape, 2 threads, Zen 3)
        dt = F.linear(dt, self.dt_proj.weight)
        A = -torch.exp(self.A_log.float())  # (d_inner, N)
        y, ssm_state = selective_ssm(x, dt, A, B, C, self.D, z, self.dt_proj.bias, ssm_state)
        if cache is not None:
            cache.write_ssm_states(self.layer_idx, conv_state, ssm_state, cache_position)
        return self.out_proj(y.to(dtype))


class MambaBlock(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        rank = config.time_step_rank
        hidden = config.hidden_size
        self.residual_in_fp32 = config.residual_in_fp32
        self.norm = RMSNorm(hidden, config.layer_norm_epsilon)
        self.mixer = MambaMixer(layer_idx, hidden, config.get("intermediate_size") or config.expand * hidden,
                                config.conv_kernel, config.state_size,
                                math.ceil(hidden / 16) if rank == "auto" else rank, config.use_conv_bias,
                                config.use_bias, config.hidden_act)

    def forward(self, x, cache, cache_position, padding):
        residual = x.float() if self.residual_in_fp32 else x
        return residual + self.mixer(self.norm(x.to(self.norm.weight.dtype)), cache, cache_position, padding)


class MambaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(MambaBlock(config, i) for i in range(config.num_hidden_layers))
        self.norm_f = RMSNorm(config.hidden_size, config.layer_norm_epsilon)


class MambaForCausalLM(PreTrainedModel):
    """Mamba language model (``model_type`` "mamba") with the HF checkpoint layout.

    ``forward`` and ``generate`` keep each layer's conv and SSM state in the cache
    (``DynamicCache(config=model.config)`` when none is passed, the same layers as
    :class:`~kvgen.MambaCache`). A cache that already holds tokens needs ``cache_position``.

    Example:
        >>> model = MambaForCausalLM.from_pretrained("state-spaces/mamba-130m-hf")  # doctest: +SKIP
        >>> out = model.generate(input_ids, max_new_tokens=10)                     # doctest: +SKIP
        >>> cache = MambaCache(model.config, batch_size=1, dtype=model.dtype)       # doctest: +SKIP
        >>> logits = model(input_ids, past_key_values=cache).logits                # doctest: +SKIP
    """

    model_types = ("mamba",)

    def __init__(self, config):
        super().__init__(config)
        self.backbone = MambaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    @classmethod
    def convert_checkpoint(cls, state_dict, config):
        """The original ``backbone.embedding`` name -> ``backbone.embeddings``; drop a tied ``lm_head``."""
        out = {}
        for name in list(state_dict):
            tensor = state_dict.pop(name)
            if config.tie_word_embeddings and name == "lm_head.weight":
                continue
            out[name.replace("backbone.embedding.", "backbone.embeddings.")] = tensor
        return out

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values=None,
                cache_position: torch.LongTensor | None = None, use_cache: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0, return_dict: bool = True,
                cache_params=None) -> MambaCausalLMOutput:
        """Run the new tokens through the model, reading and advancing the state in ``past_key_values``.

        ``cache_params`` is transformers' name for ``past_key_values``. ``cache_position`` (the
        new tokens' indices, padding counted) is required with a cache that already holds
        tokens. ``attention_mask`` is (batch, past + new) with 0 on padding; ``position_ids``
        are accepted and unused (Mamba has no positions).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if cache_params is not None:
            if past_key_values is not None:
                raise ValueError("pass the cache as past_key_values or as cache_params (its older name), not both")
            past_key_values = cache_params
        cache, _ = as_cache(past_key_values)
        if cache is not None and cache_position is None and cache.get_seq_length() > 0:
            raise ValueError(
                f"the cache already holds {cache.get_seq_length()} tokens: pass cache_position (the new tokens' "
                "indices in the sequence, padding counted), e.g. cache_position=torch.arange(seen, seen + new) "
                "with seen = cache.get_seq_length(); or pass an empty cache to start a new sequence"
            )
        x = self.backbone.embeddings(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, hidden)
        b, t = x.shape[:2]
        cache, legacy, cache_position, _ = prepare_decoder_inputs(
            self.config, input_ids, b, t, x.device, past_key_values, use_cache, cache_position, position_ids,
            attention_mask)
        padding = padding_of_new_tokens(attention_mask, cache_position)
        for layer in self.backbone.layers:
            x = layer(x, cache, cache_position, padding)
        x = keep_logit_rows(x, logits_to_keep)
        x = self.backbone.norm_f(x.to(self.backbone.norm_f.weight.dtype))
        logits = self.lm_head(x.to(self.lm_head.weight.dtype)).float()
        out = MambaCausalLMOutput(logits=logits, past_key_values=finish_cache(cache, legacy))
        return out if return_dict else out.to_tuple()
