"""Jamba (ai21labs/Jamba-*): attention and Mamba layers, dense and mixture-of-experts feed-forwards.

Layer ``i`` is attention when ``i % attn_layer_period == attn_layer_offset`` (else Mamba;
``config.layer_types`` says which) and has a mixture of ``num_experts`` experts when
``i % expert_layer_period == expert_layer_offset`` (else a dense MLP). The attention has
no positional encoding; its masks come from :mod:`kvgen.masks` like every model's. The
Mamba mixer is Mamba's with RMSNorms on dt, B and C. The cache is a list of mixed layers:
attention layers hold keys/values, Mamba layers their conv and SSM states.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.config import PretrainedConfig
from kvgen.models.base import LayerMasks, PreTrainedModel, finish_cache, keep_logit_rows, prepare_decoder_inputs
from kvgen.models.linear import Linear
from kvgen.models.llama import ACTIVATIONS, RMSNorm
from kvgen.models.mamba import MambaMixer, padding_of_new_tokens
from kvgen.models.sdpa import scaled_dot_product_attention
from kvgen.outputs import CausalLMOutputWithPast


class JambaConfig(PretrainedConfig):
    """A :class:`~kvgen.PretrainedConfig` of ``model_type`` "jamba" (transformers' defaults for the rest).

    Example:
        >>> JambaConfig(num_hidden_layers=4, attn_layer_period=2, attn_layer_offset=1).layer_types
        ['mamba', 'full_attention', 'mamba', 'full_attention']
    """

    def __init__(self, **kwargs):
        super().__init__(**{"model_type": "jamba", "vocab_size": 65536, "hidden_size": 4096, "intermediate_size": 14336,
                            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, **kwargs})


class JambaMambaMixer(MambaMixer):
    """Mamba's mixer with RMSNorms on the low-rank dt, on B and on C."""

    def __init__(self, config, layer_idx: int):
        rank = config.mamba_dt_rank
        rank = math.ceil(config.hidden_size / 16) if rank == "auto" else rank
        super().__init__(layer_idx, config.hidden_size, config.mamba_expand * config.hidden_size, config.mamba_d_conv,
                         config.mamba_d_state, rank, config.mamba_conv_bias, config.mamba_proj_bias, config.hidden_act)
        self.dt_layernorm = RMSNorm(rank, config.rms_norm_eps)
        self.b_layernorm = RMSNorm(config.mamba_d_state, config.rms_norm_eps)
        self.c_layernorm = RMSNorm(config.mamba_d_state, config.rms_norm_eps)

    def ssm_inputs(self, projected):
        dt, B, C = super().ssm_inputs(projected)
        return self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)


class JambaAttention(nn.Module):
    """Multi-head (grouped-query) attention without positional encoding."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        self.q_proj = Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x, masks: LayerMasks, cache, cache_position):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        mask, is_causal = masks(self.layer_idx, None)  # before the update: it asks the cache
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, {"cache_position": cache_position})
        out = scaled_dot_product_attention(q, k, v, mask, is_causal, None, self.num_heads != self.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).flatten(2))


class JambaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class JambaExperts(nn.Module):
    """The experts' weights stacked: ``gate_up_proj`` (E, 2I, H) (gate rows first), ``down_proj`` (E, H, I)."""

    def __init__(self, config):
        super().__init__()
        e, h, i = config.num_experts, config.hidden_size, config.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.zeros(e, h, i))


class JambaSparseMoe(nn.Module):
    """Each token goes to its ``num_experts_per_tok`` best experts, weighted by their (unnormalised) softmax."""

    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.router = Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = JambaExperts(config)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])  # (tokens, H)
        probs = F.softmax(self.router(flat), dim=-1, dtype=torch.float)  # (tokens, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (tokens, k)
        weights = weights.to(x.dtype)
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():
            token, slot = torch.where(chosen == e)
            gate, up = F.linear(flat[token], self.experts.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.experts.down_proj[e])  # (tokens of e, H)
            out.index_add_(0, token, y * weights[token, slot, None])
        return out.view_as(x)


class JambaLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.is_mamba = config.layer_types[layer_idx] == "mamba"
        if self.is_mamba:
            self.mamba = JambaMambaMixer(config, layer_idx)
        else:
            self.self_attn = JambaAttention(config, layer_idx)
        self.pre_ff_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        has_experts = layer_idx % config.expert_layer_period == config.expert_layer_offset and config.num_experts > 1
        self.feed_forward = JambaSparseMoe(config) if has_experts else JambaMLP(config)

    def forward(self, x, masks, cache, cache_position, padding):
        h = self.input_layernorm(x)
        if self.is_mamba:
            h = self.mamba(h, cache, cache_position, padding)
        else:
            h = self.self_attn(h, masks, cache, cache_position)
        x = x + h
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class JambaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(JambaLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class JambaForCausalLM(PreTrainedModel):
    """Jamba language model (``model_type`` "jamba"): attention, Mamba and mixture-of-experts layers.

    ``generate`` and ``forward`` build the cache on their own (``DynamicCache(config=...)``, the
    layers of a :class:`~kvgen.HybridMambaAttentionDynamicCache`); or pass one by hand.

    Example:
        >>> model = JambaForCausalLM.from_pretrained("ai21labs/Jamba-v0.1")          # doctest: +SKIP
        >>> cache = HybridMambaAttentionDynamicCache(model.config, batch_size=1,
        ...                                          dtype=model.dtype, device=model.device)  # doctest: +SKIP
        >>> logits = model(input_ids, past_key_values=cache).logits                  # doctest: +SKIP
    """

    model_types = ("jamba",)

    def __init__(self, config):
        super().__init__(config)
        self.model = JambaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def convert_checkpoint(cls, state_dict, config):
        """Stack per-expert tensors (``experts.{j}.gate_proj`` ...) into ``experts.gate_up_proj`` / ``down_proj``."""
        out = {}
        for name in list(state_dict):
            tensor = state_dict.pop(name)
            if not (config.tie_word_embeddings and name == "lm_head.weight"):
                out[name] = tensor
        for i in range(config.num_hidden_layers):
            prefix = f"model.layers.{i}.feed_forward.experts."
            names = [f"{prefix}{j}.{p}_proj.weight" for j in range(config.num_experts) for p in ("gate", "up", "down")]
            if all(name in out for name in names):
                parts = [[out.pop(f"{prefix}{j}.{p}_proj.weight") for p in ("gate", "up", "down")]
                         for j in range(config.num_experts)]
                out[prefix + "gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u, _ in parts])
                out[prefix + "down_proj"] = torch.stack([d for _, _, d in parts])
        return out

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values=None,
                cache_position: torch.LongTensor | None = None, use_cache: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0,
                return_dict: bool = True) -> CausalLMOutputWithPast:
        """Run the new tokens through the model, reading and extending ``past_key_values``.

        ``attention_mask`` is (batch, past + new) with 0 on padding; ``cache_position`` holds
        the new tokens' indices (padding counted; default: after what the cache holds);
        ``position_ids`` are accepted and unused (Jamba has no positional encoding).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, hidden)
        b, t = x.shape[:2]
        cache, legacy, cache_position, _ = prepare_decoder_inputs(
            self.config, input_ids, b, t, x.device, past_key_values, use_cache, cache_position, position_ids,
            attention_mask)
        masks = LayerMasks(cache, cache_position, attention_mask)
        padding = padding_of_new_tokens(attention_mask, cache_position)
        for layer in self.model.layers:
            x = layer(x, masks, cache, cache_position, padding)
        x = self.model.final_layernorm(keep_logit_rows(x, logits_to_keep))
        out = CausalLMOutputWithPast(logits=self.lm_head(x), past_key_values=finish_cache(cache, legacy))
        return out if return_dict else out.to_tuple()
