"""The Llama family in one file: llama, mistral, qwen2, qwen3 and phi3, told apart by config flags.

* mistral: ``sliding_window`` on every layer;
* qwen2: biases on q/k/v, sliding window on layers past ``max_window_layers`` when enabled;
* qwen3: RMSNorm on each query and key head (``q_norm``/``k_norm``);
* phi3: fused ``qkv_proj`` and ``gate_up_proj`` in the checkpoint, partial rotary.

Every family runs fused q/k/v and gate/up projections (one matmul each per layer);
separate checkpoint tensors are concatenated at load time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import kvgen.models.native as native
from kvgen.models.base import LayerMasks, PreTrainedModel, finish_cache, keep_logit_rows, prepare_decoder_inputs
from kvgen.models.decode_blocks import decode_block, runs_fused
from kvgen.models.decode_stack import CountedSettings, DecodeStack, LayerParts, fuses
from kvgen.models.linear import Linear
from kvgen.models.packed import cat_rows
from kvgen.models.sdpa import scaled_dot_product_attention
from kvgen.outputs import CausalLMOutputWithPast
from kvgen.rope import RotaryEmbedding, apply_rotary

ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu, "relu": F.relu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class RMSNorm(CountedSettings, nn.Module):
    offset = 0.0  # scales by weight + offset (Gemma's norms: 1)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused kernel (float32 rounding aside, the same as below)
            return native.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(CountedSettings, nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = self.head_dim ** -0.5
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.get("attention_bias", False)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=bias)
        o_bias = bias and config.model_type != "qwen2"  # qwen2 has biases on q/k/v only
        self.o_proj = Linear(q_size, config.hidden_size, bias=o_bias)
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if is_sliding else None

    def project(self, x, cos, sin):
        """Queries (B, H, T, D), keys and values (B, Hkv, T, D) of the normed hidden states, rotated."""
        b, t, _ = x.shape
        heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(b, t, heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is None:  # rotate the query and key heads together
            qk = apply_rotary(qkv[:, :, :heads].transpose(1, 2), cos, sin)  # (B, H + Hkv, T, D)
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads:]
        else:
            q = apply_rotary(self.q_norm(qkv[:, :, : self.num_heads]).transpose(1, 2), cos, sin)  # (B, H, T, D)
            k = apply_rotary(self.k_norm(qkv[:, :, self.num_heads: heads]).transpose(1, 2), cos, sin)
        return q, k, qkv[:, :, heads:].transpose(1, 2)

    def attend(self, q, k, v, masks: LayerMasks, cache, cache_kwargs: dict):
        """Store k/v in the cache and attend to everything it returns: (B, T, H * D).

        ``cache_kwargs``: ``cache_position`` and ``rotary_emb`` (for caches that re-rotate keys).
        """
        mask, is_causal = masks(self.layer_idx, self.sliding_window)  # before the update: it asks the cache
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, cache_kwargs)
        out = native.attention(q, k, v, mask, is_causal, self.scaling)
        if out is None:
            out = scaled_dot_product_attention(q, k, v, mask, is_causal, self.scaling,
                                               self.num_heads != self.num_kv_heads)
        return out.transpose(1, 2).flatten(2)


class MLP(CountedSettings, nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size,
                                      bias=config.get("mlp_bias", False))
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=config.get("mlp_bias", False))
        self.act_name = config.hidden_act
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x):
        return gated_mlp(self, x)


def gated_mlp(mlp: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``down_proj(act(gate) * up)`` with ``[gate, up] = gate_up_proj(x)`` (Llama family, Gemma)."""
    gate_up = mlp.gate_up_proj(x)
    fused = native.gated_activation(gate_up, mlp.act_name)  # one C++ pass where it applies
    if fused is None:
        gate, up = gate_up.chunk(2, dim=-1)
        fused = mlp.act(gate) * up
    return mlp.down_proj(fused)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def runs_fused(self) -> bool:
        """Whether kvgen's fused C++ ops compute this layer's decode steps (then its blocks run eagerly)."""
        return fuses(layer_parts(self))

    def forward(self, x, cos, sin, masks, cache, cache_kwargs):
        q, k, v = _attention_inputs(self, x, cos, sin)
        return _finish_layer(self, x, self.self_attn.attend(q, k, v, masks, cache, cache_kwargs))


def attention_inputs(layer, x, cos, sin):
    """``q, k, v`` of a layer with ``input_layernorm`` and ``self_attn`` (Llama family, Gemma)."""
    attn = layer.self_attn  # stored-precision weights: one C++ op (same arithmetic) where it applies
    fused = native.decoder_attention_inputs(x, layer.input_layernorm, attn.qkv_proj, cos, sin, attn.num_heads,
                                            attn.num_kv_heads, attn.q_norm, attn.k_norm)
    if fused is not None:
        return fused
    return attn.project(layer.input_layernorm(x), cos, sin)


@decode_block  # its own code object, so that each model file's compiled graphs stay apart
def _attention_inputs(layer: DecoderLayer, x, cos, sin):
    return attention_inputs(layer, x, cos, sin)


@decode_block
def _finish_layer(layer: DecoderLayer, x, attn):
    fused = native.decoder_mlp(x, attn, layer.self_attn.o_proj, layer.post_attention_layernorm, layer.mlp)
    if fused is not None:
        return fused
    x = x + layer.self_attn.o_proj(attn)
    return x + layer.mlp(layer.post_attention_layernorm(x))


def layer_parts(layer: DecoderLayer) -> LayerParts:
    """What a fused decode step reads of a layer (:mod:`kvgen.models.decode_stack`)."""
    return LayerParts(layer.input_layernorm, layer.self_attn, layer.post_attention_layernorm, layer.mlp)


@decode_block
def _logits(model: LlamaForCausalLM, x):
    return model.lm_head(model.model.norm(x))


class LlamaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class LlamaForCausalLM(PreTrainedModel):
    """Decoder-only Llama-family language model.

    Example:
        >>> from kvgen import AutoModelForCausalLM, AutoTokenizer          # doctest: +SKIP
        >>> model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # doctest: +SKIP
        >>> out = model(**tokenizer("Hello", return_tensors="pt"))         # doctest: +SKIP
        >>> out.logits.shape, out.past_key_values.get_seq_length()         # doctest: +SKIP
    """

    model_types = ("llama", "mistral", "qwen2", "qwen3", "phi3")

    def __init__(self, config):
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.decode_stack = DecodeStack(layer_parts)
        self.tie_weights()

    def runs_fused(self) -> bool:
        """Whether the head block (final norm, lm_head) runs eagerly: where the layers' fused C++ ops run, a float32
        lm_head is as fast through oneDNN as compiled, and compiling it would cost seconds of tracing."""
        return runs_fused(self.lm_head) and self.model.layers[0].runs_fused()

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self, device):
        self.model.rotary_emb = RotaryEmbedding(self.config, device=device)

    @classmethod
    def convert_checkpoint(cls, state_dict, config):
        """Fuse q/k/v and gate/up tensors of separate-projection checkpoints; drop tied/unused tensors.

        Consumes ``state_dict`` so that each original tensor is freed once it has been fused.
        """
        out = {}
        for name in list(state_dict):
            tensor = state_dict.pop(name)
            if name.endswith("rotary_emb.inv_freq") or (config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            out[name] = tensor
        for i in range(config.num_hidden_layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            for kind in ("weight", "bias"):
                parts = [attn + p + "_proj." + kind for p in "qkv"]
                if all(p in out for p in parts):
                    out[attn + "qkv_proj." + kind] = cat_rows([out.pop(p) for p in parts])
                parts = [mlp + p + "_proj." + kind for p in ("gate", "up")]
                if all(p in out for p in parts):
                    out[mlp + "gate_up_proj." + kind] = cat_rows([out.pop(p) for p in parts])
        return out

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values=None,
                cache_position: torch.LongTensor | None = None, use_cache: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0,
                return_dict: bool = True) -> CausalLMOutputWithPast:
        """Run the new tokens through the model, reading and extending ``past_key_values``.

        ``attention_mask`` is (batch, past + new) with 0 on padding; ``cache_position`` holds
        the new tokens' indices in the cache (padding counted); ``logits_to_keep=n`` computes
        logits for the last ``n`` positions only (0: all).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds  # (B, T, hidden)
        b, t = x.shape[:2]
        cache, legacy, cache_position, position_ids = prepare_decoder_inputs(
            self.config, input_ids, b, t, x.device, past_key_values, use_cache, cache_position, position_ids,
            attention_mask)
        cos, sin = self.model.rotary_emb(position_ids, x.dtype)
        masks = LayerMasks(cache, cache_position, attention_mask)
        cache_kwargs = {"cache_position": cache_position, "rotary_emb": self.model.rotary_emb}
        layers = self.model.layers
        stacked = self.decode_stack.run(layers, x, [(cos, sin)], [0] * len(layers), masks, cache)
        if stacked is not None:
            x = stacked
        else:
            for layer in layers:
                x = layer(x, cos, sin, masks, cache, cache_kwargs)
        logits = _logits(self, keep_logit_rows(x, logits_to_keep))
        out = CausalLMOutputWithPast(logits=logits, past_key_values=finish_cache(cache, legacy))
        return out if return_dict else out.to_tuple()


class MistralForCausalLM(LlamaForCausalLM):
    model_types = ("mistral",)


class Qwen2ForCausalLM(LlamaForCausalLM):
    model_types = ("qwen2",)


class Qwen3ForCausalLM(LlamaForCausalLM):
    model_types = ("qwen3",)


class Phi3ForCausalLM(LlamaForCausalLM):
    model_types = ("phi3",)
