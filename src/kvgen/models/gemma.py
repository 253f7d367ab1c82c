"""Gemma 2 and Gemma 3 (text) in one file, told apart by config fields.

What both share, and where they differ from Llama:

* embeddings scaled by ``sqrt(hidden_size)`` (in the compute dtype), tied output head;
* RMSNorm with a ``1 + weight`` scale, and "sandwich" norms: every attention and MLP block
  is normed before *and* after (``post_attention_layernorm``, ``pre_``/``post_feedforward_layernorm``);
* a ``gelu_pytorch_tanh`` gated MLP; attention scaled by ``query_pre_attn_scalar ** -0.5``;
* local (sliding-window) and global layers from ``config.layer_types``: Gemma 2 alternates,
  Gemma 3 makes every ``sliding_window_pattern``-th layer global;
* Gemma 2: tanh soft-capping of attention scores (``attn_logit_softcapping``) and of the
  final logits (``final_logit_softcapping``); SDPA has no soft-cap, so those layers attend eagerly;
* Gemma 3: RMSNorm on each query and key head, and separate rotary tables for local
  (``local_rope_parameters``, base ``rope_local_base_freq``) and global layers (``rope_parameters``,
  which may carry linear scaling).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask

from kvgen.config import GEMMA3_TYPES
import kvgen.models.native as native
from kvgen.models.base import LayerMasks, PreTrainedModel, finish_cache, keep_logit_rows, prepare_decoder_inputs
from kvgen.models.decode_blocks import decode_block
from kvgen.models.decode_stack import CountedSettings, DecodeStack, LayerParts, fuses
from kvgen.models.linear import Linear
from kvgen.models.llama import LlamaForCausalLM, attention_inputs, gated_mlp
from kvgen.models.sdpa import block_sparse_attention, scaled_dot_product_attention
from kvgen.outputs import CausalLMOutputWithPast
from kvgen.rope import RotaryEmbedding, apply_rotary

ACTIVATIONS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu, "silu": F.silu}
SLIDING, FULL = "sliding_attention", "full_attention"


class GemmaRMSNorm(CountedSettings, nn.Module):
    """RMSNorm scaled by ``1 + weight`` (the stored weight is centred on 0), computed in float32.

    Example:
        >>> norm = GemmaRMSNorm(4, eps=0.0)  # weight 0: a plain RMS normalisation
        >>> norm(torch.tensor([[2.0, -2.0, 2.0, -2.0]])).tolist()
        [[1.0, -1.0, 1.0, -1.0]]
    """

    offset = 1.0  # scales by weight + offset

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return native.rms_norm(x, self.weight, self.eps, self.offset)  # (weight + offset: the same float32 sum)
        scale = self.offset + self.weight.float()
        if x.dtype == torch.float32:
            return native.rms_norm(x, scale, self.eps)
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * scale).to(x.dtype)  # Gemma scales in float32, then casts (Llama casts first)


@functools.cache
def _embedding_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """``sqrt(hidden_size)`` rounded to ``dtype`` first, as transformers scales the embeddings (sqrt(640) -> 25.25 in
    bf16); a Python float, which multiplies as that tensor would (the step then makes no tensor of it)."""
    return float(torch.tensor(hidden_size ** 0.5, dtype=torch.float32).to(dtype))


def softcapped_attention(q, k, v, mask, is_causal: bool, scale: float, softcap: float) -> torch.Tensor:
    """Eager attention with ``tanh`` soft-capping of the scores, as Gemma 2 needs: (B, H, T, D).

    ``q`` is (B, H, T, D), ``k``/``v`` (B, Hkv, S, D) with H a multiple of Hkv; ``mask`` is a
    boolean (B or 1, 1, T, S) where True may attend, or ``None`` (all, or causal with ``is_causal``); a
    ``BlockMask`` goes to :func:`~kvgen.models.sdpa.block_sparse_attention`.
    """
    if isinstance(mask, BlockMask):
        return block_sparse_attention(q, k, v, mask, scale, softcap)
    b, h, t, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    q = q.view(b, hkv, h // hkv, t, d)  # the query heads that share each key head
    scores = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale  # (B, Hkv, G, T, S)
    scores = torch.tanh(scores / softcap) * softcap
    if mask is None and is_causal:
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    if mask is not None:
        mask = mask.unsqueeze(2) if mask.dim() == 4 else mask  # (B or 1, 1, 1, T, S)
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v.unsqueeze(2)).view(b, h, t, d)  # (B, Hkv, G, T, D) -> (B, H, T, D)


class GemmaAttention(CountedSettings, nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scaling = config.query_pre_attn_scalar ** -0.5
        self.softcap = config.get("attn_logit_softcapping")
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = config.get("attention_bias", False)
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=bias)
        if config.model_type in GEMMA3_TYPES:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.is_sliding = config.layer_types[layer_idx] == SLIDING
        self.sliding_window = config.sliding_window if self.is_sliding else None

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
        """Store k/v in the cache and attend to everything it returns: (B, T, H * D)."""
        mask, is_causal = masks(self.layer_idx, self.sliding_window)  # before the update: it asks the cache
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, cache_kwargs)
        out = native.attention(q, k, v, mask, is_causal, self.scaling, self.softcap)
        if out is None and self.softcap is None:
            out = scaled_dot_product_attention(q, k, v, mask, is_causal, self.scaling,
                                               self.num_heads != self.num_kv_heads)
        elif out is None:
            out = softcapped_attention(q, k, v, mask, is_causal, self.scaling, self.softcap)
        return out.transpose(1, 2).flatten(2)


class GemmaMLP(CountedSettings, nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        act = config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ACTIVATIONS:
            raise ValueError(f"hidden_activation {act!r} is not supported; supported: {', '.join(ACTIVATIONS)}")
        self.act_name = act
        self.act = ACTIVATIONS[act]

    def forward(self, x):
        return gated_mlp(self, x)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.self_attn = GemmaAttention(config, layer_idx)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.mlp = GemmaMLP(config)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def runs_fused(self) -> bool:
        """Whether kvgen's fused C++ ops compute this layer's decode steps (then its blocks run eagerly)."""
        return fuses(layer_parts(self))

    def forward(self, x, cos, sin, masks, cache, cache_kwargs):
        q, k, v = _attention_inputs(self, x, cos, sin)
        return _finish_layer(self, x, self.self_attn.attend(q, k, v, masks, cache, cache_kwargs))


@decode_block  # Llama's body in a compiled block of Gemma's own
def _attention_inputs(layer: GemmaDecoderLayer, x, cos, sin):
    return attention_inputs(layer, x, cos, sin)


@decode_block
def _finish_layer(layer: GemmaDecoderLayer, x, attn):
    fused = native.decoder_mlp(x, attn, layer.self_attn.o_proj, layer.pre_feedforward_layernorm, layer.mlp,
                               layer.post_attention_layernorm, layer.post_feedforward_layernorm)
    if fused is not None:
        return fused
    x = x + layer.post_attention_layernorm(layer.self_attn.o_proj(attn))
    return x + layer.post_feedforward_layernorm(layer.mlp(layer.pre_feedforward_layernorm(x)))


def layer_parts(layer: GemmaDecoderLayer) -> LayerParts:
    """What a fused decode step reads of a layer (:mod:`kvgen.models.decode_stack`): the sandwich norms too."""
    return LayerParts(layer.input_layernorm, layer.self_attn, layer.pre_feedforward_layernorm, layer.mlp,
                      layer.post_attention_layernorm, layer.post_feedforward_layernorm)


@decode_block
def _logits(model: GemmaForCausalLM, x):
    logits = model.lm_head(model.model.norm(x))
    cap = model.config.get("final_logit_softcapping")
    return logits if cap is None else torch.tanh(logits / cap) * cap


class GemmaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.init_rotary(config)

    def init_rotary(self, config, device=None):
        """``rotary_emb`` for global layers; Gemma 3 adds ``rotary_emb_local`` for sliding ones."""
        self.rotary_emb = RotaryEmbedding(config, device=device)
        local = config.get("local_rope_parameters")
        self.rotary_emb_local = RotaryEmbedding(config, params=local, device=device) if local else None


class GemmaForCausalLM(PreTrainedModel):
    """Gemma 2 / Gemma 3 text language model with local (sliding-window) and global layers.

    Loads any of ``gemma2``, ``gemma3_text`` (and a flat ``gemma3``) checkpoints, so the seeds'
    ``GemmaForCausalLM.from_pretrained(<a Gemma 2 checkpoint>)`` works; Gemma 1 (``gemma``) is
    not supported.

    Example:
        >>> from kvgen import AutoModelForCausalLM, AutoTokenizer                         # doctest: +SKIP
        >>> model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="gemma-3-270m-q4_k_m.gguf")  # doctest: +SKIP
        >>> inputs = tokenizer("Hello", return_tensors="pt")                              # doctest: +SKIP
        >>> out = model.generate(**inputs, cache_implementation="hybrid")                 # doctest: +SKIP
    """

    model_types = ("gemma2", "gemma3_text", "gemma3")

    def __init__(self, config):
        super().__init__(config)
        if config.get("use_bidirectional_attention"):
            raise NotImplementedError("Gemma with use_bidirectional_attention=True (an encoder) is not supported")
        if config.model_type == "gemma3" and config.get("text_config") is not None:
            raise ValueError("this is a multimodal Gemma 3 config (it nests text_config); kvgen loads the text "
                             "model only: use a gemma3_text checkpoint or the GGUF of its text part")
        self.model = GemmaModel(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.decode_stack = DecodeStack(layer_parts)
        self.tie_weights()

    runs_fused = LlamaForCausalLM.runs_fused

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_buffers(self, device):
        self.model.init_rotary(self.config, device)

    @classmethod
    def convert_checkpoint(cls, state_dict, config):
        """Fuse q/k/v and gate/up tensors; drop tied and rotary tensors. Consumes ``state_dict``."""
        return LlamaForCausalLM.convert_checkpoint(state_dict, config)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values=None,
                cache_position: torch.LongTensor | None = None, use_cache: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, logits_to_keep: int | torch.Tensor = 0,
                return_dict: bool = True) -> CausalLMOutputWithPast:
        """Run the new tokens through the model, reading and extending ``past_key_values``.

        Arguments as :meth:`kvgen.models.llama.LlamaForCausalLM.forward`. ``inputs_embeds``
        are used as given (not scaled by ``sqrt(hidden_size)``, as in transformers).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            x = self.model.embed_tokens(input_ids)  # (B, T, hidden)
            x = x * _embedding_scale(self.config.hidden_size, x.dtype)
        else:
            x = inputs_embeds
        b, t = x.shape[:2]
        cache, legacy, cache_position, position_ids = prepare_decoder_inputs(
            self.config, input_ids, b, t, x.device, past_key_values, use_cache, cache_position, position_ids,
            attention_mask)
        full, local = self.model.rotary_emb, self.model.rotary_emb_local
        tables = {FULL: full(position_ids, x.dtype)}  # cos, sin: (B, T, D) each
        tables[SLIDING] = tables[FULL] if local is None else local(position_ids, x.dtype)
        cache_kwargs = {FULL: {"cache_position": cache_position, "rotary_emb": full},
                        SLIDING: {"cache_position": cache_position, "rotary_emb": local or full}}
        masks = LayerMasks(cache, cache_position, attention_mask)
        kinds = [SLIDING if kind == SLIDING else FULL for kind in self.config.layer_types]
        stacked = self.decode_stack.run(self.model.layers, x, [tables[FULL], tables[SLIDING]],
                                        [int(kind == SLIDING) for kind in kinds], masks, cache)
        if stacked is not None:
            x = stacked
        else:
            for layer, kind in zip(self.model.layers, kinds):
                x = layer(x, *tables[kind], masks, cache, cache_kwargs[kind])
        logits = _logits(self, keep_logit_rows(x, logits_to_keep))
        out = CausalLMOutputWithPast(logits=logits, past_key_values=finish_cache(cache, legacy))
        return out if return_dict else out.to_tuple()


class Gemma2ForCausalLM(GemmaForCausalLM):
    """Gemma 2: alternating local/global layers, attention and final logit soft-capping.

    Example:
        >>> model = Gemma2ForCausalLM.from_pretrained("path/to/gemma-2-2b", dtype=torch.bfloat16)  # doctest: +SKIP
    """

    model_types = ("gemma2",)


class Gemma3ForCausalLM(GemmaForCausalLM):
    """Gemma 3 (text): q/k norm, five local layers per global one, separate local/global rope.

    Example:
        >>> from kvgen.loading.default_model import gemma3_gguf_path
        >>> model = Gemma3ForCausalLM.from_pretrained(gemma3_gguf_path())  # doctest: +SKIP
    """

    model_types = ("gemma3_text", "gemma3")
