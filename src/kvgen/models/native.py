"""RMSNorm and attention in kvgen's C++ kernels, for eager steps on the CPU.

A decode step's norms and attention are tiny: in eager mode their cost is kernel launches
and thread wake-ups (``F.rms_norm`` runs as ~8 ATen ops, SDPA's CPU kernel is built for long
queries), not arithmetic. For float32 CPU inputs of at most ``MAX_ROWS`` query rows, outside
``torch.compile`` and autograd, these run one C++ op each (``torch.ops.kvgen.rms_norm`` /
``attention``); anything else goes to torch. Results equal torch's up to float32 rounding order.

Attention of more rows (a prefill, or a ragged batch of many sequences flattened to one row of
a paged block pool) also runs the C++ op when its boolean mask is sparse enough: the op skips
the 16-key tiles the mask excludes, so its work follows the allowed pairs, while SDPA's CPU
kernel with an explicit mask computes every (query, key) pair (see :func:`attention`).

Example:
    >>> x = torch.randn(1, 1, 64)
    >>> torch.allclose(rms_norm(x, torch.ones(64), 1e-6), F.rms_norm(x, (64,), torch.ones(64), 1e-6), atol=1e-6)
    True
"""

from __future__ import annotations

import functools
import weakref

import torch
import torch.nn.functional as F

from kvgen.kernels import kernels_available
from kvgen.models.decode_blocks import MAX_ROWS
from kvgen.models.linear import Linear
from kvgen.models.quantized_linear import QuantizedLinear, products_rows_kind

#: above ``MAX_ROWS`` query rows, the C++ attention runs where at most this fraction of the mask's
#: (query, key) pairs is allowed; denser masks go to SDPA (see :func:`attention`)
SPARSE_FRACTION = 0.6

_SAMPLED_ROWS = 16

#: activations ``kvgen::gated_activation`` and ``kvgen::decoder_mlp`` compute, by config name
ACTIVATION_CODES = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}


def _native(x: torch.Tensor, rows: int | None) -> bool:
    return ((rows is None or rows <= MAX_ROWS) and x.is_cpu and x.dtype == torch.float32
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling() and kernels_available())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """``F.rms_norm(x, weight.shape, weight + offset, eps)`` over the last dim of ``x``, at any number of rows (rows
    in parallel: a 512-token prefill's norm 2-4x faster than ATen's, which runs ~8 ops)."""
    if _native(x, None) and weight.dtype == torch.float32:
        return torch.ops.kvgen.rms_norm(x.contiguous(), weight, eps, offset)
    return F.rms_norm(x, weight.shape, weight + offset if offset else weight, eps)


def gated_activation(gate_up: torch.Tensor, act_name: str) -> torch.Tensor | None:
    """``act(gate) * up`` of a gated MLP's fused product ``[gate, up]`` (..., 2 I) as one C++ op
    (``kvgen::gated_activation``, for the activations of :data:`ACTIVATION_CODES`); None where it does not
    apply. In place of ATen's activation and product of the two strided halves (two passes, ~2 ms a
    layer for a 512-token Gemma 3 prefill)."""
    act = ACTIVATION_CODES.get(act_name)
    if act is None or not _native(gate_up, None):
        return None
    return torch.ops.kvgen.gated_activation(gate_up.contiguous(), act)


@functools.lru_cache(maxsize=4)
def _causal_mask(n: int) -> torch.Tensor:
    """(1, 1, n, n) bool, True on and below the diagonal (kept: every layer of a prefill asks for it)."""
    return torch.ones(n, n, dtype=torch.bool).tril()[None, None]


def allowed_fraction(mask: torch.Tensor) -> float:
    """The fraction of allowed pairs of a bool mask (1, 1, T, S), estimated from at most 16 evenly
    spaced query rows (a few microseconds: the rows of one mask are alike or evenly varying)."""
    rows = mask[0, 0]
    if rows.shape[0] > _SAMPLED_ROWS:
        rows = rows[torch.linspace(0, rows.shape[0] - 1, _SAMPLED_ROWS, dtype=torch.long)]
    return rows.sum().item() / max(1, rows.numel())


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool,
              scale: float, softcap: float | None = None) -> torch.Tensor | None:
    """Attention of ``q`` (B, H, T, D) over ``k``/``v`` (B, Hkv, S, D): (B, H, T, D), or None when the
    native op does not apply (then the caller runs its torch path). ``mask``: bool, True where allowed.

    The op (``kvgen::attention``, flash attention over the 16-key tiles the mask allows; a query
    row allowing no key gets zeros) runs for float32 CPU inputs outside compile and autograd with a
    head size that is a multiple of 16, when either

    * B * T <= ``MAX_ROWS`` (decode steps), mask or not: faster than SDPA at any density; or
    * B == 1 with a bool mask that allows at most ``SPARSE_FRACTION`` (0.6) of its pairs,
      estimated from 16 sampled rows (:func:`allowed_fraction`).

    The rule: SDPA's CPU kernel with an explicit mask costs T * S pairs however sparse the mask;
    the op costs the allowed tiles (plus row blocks' slack), at 70-80% of SDPA's arithmetic rate
    on dense work (AMD EPYC / AVX2, 1 thread, float32: a full 512 x 512 mask 0.79x SDPA's speed at
    head dim 64, 0.69x at 256; a 256-token chunk after 768 cached 0.82x / 0.79x). So it wins below
    about 0.7 allowed and is used up to 0.6: a causal prefill (0.5: 1.5-1.8x at D 64, 1.2x at
    D 256), a prefill into a static cache with empty slots (0.25: ~3x), a sliding window
    (0.375: ~2x) and a ragged batch over a paged pool (0.01-0.05: 5x for 16 decode rows, 30x
    with a 256-token prompt chunk; ``benchmarks/attention_kernel.py``). Chunks appended to a
    long context (fraction near 1) go to SDPA, as do B > 1 prefills. ``is_causal`` over as many keys
    as queries (a prefill into an empty cache) runs the op with the causal mask: against SDPA's own
    causal kernel, which skips the excluded blocks too, 512 tokens on Zen 4: 1.8x at head dim 64 and
    256 with 2 threads, 1.7x / 1.8x with 1; with both built for AVX2 only, 1.25-1.6x.

    Keys and values stored in a cache's other precision (:mod:`kvgen.cache.precision`: float16, bfloat16,
    int8 rows) go to the op at any density: it reads them as stored, where SDPA would need a float copy.
    """
    if q.shape[-1] % (32 if k.dtype == torch.int8 else 16) or \
            (mask is not None and (not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 4)) \
            or not _native(q, None):
        return None
    if is_causal:
        if mask is not None or q.shape[2] != k.shape[2]:
            return None
        mask = _causal_mask(q.shape[2])
    if q.shape[0] * q.shape[2] > MAX_ROWS and k.dtype == q.dtype and (
            mask is None or q.shape[0] != 1 or mask.shape[0] != 1 or _fraction_of(mask) > SPARSE_FRACTION):
        return None
    return torch.ops.kvgen.attention(q, k, v, mask, scale, softcap or 0.0)


_last_mask: list = [lambda: None, 0.0]  # a weak reference to the last mask estimated, and its fraction


def _fraction_of(mask: torch.Tensor) -> float:
    """:func:`allowed_fraction`, estimated once for the mask that every layer of a pass shares (a 16-row
    step of the continuous-batching engine estimated it 30 times: ~1.8 ms of a 74 ms step)."""
    if _last_mask[0]() is not mask:
        _last_mask[:] = [weakref.ref(mask), allowed_fraction(mask)]
    return _last_mask[1]


def _packed(layer: torch.nn.Module) -> bool:
    return (type(layer) is QuantizedLinear and layer.bias is None) or (type(layer) is Linear and layer.runs_fused())


def _weight(norm: torch.nn.Module | None) -> torch.Tensor | None:
    return None if norm is None else norm.weight


def _biased(layer: torch.nn.Module) -> bool:
    """A stored-precision product with a bias the fused ops add (Qwen2's q/k/v): float32, one value a feature."""
    bias = layer.bias
    return (type(layer) is QuantizedLinear and bias is not None and bias.dtype == torch.float32
            and bias.is_contiguous() and bias.numel() == layer.out_features)


def attention_inputs_fuse(norm: torch.nn.Module, proj: torch.nn.Module, head_dim: int, heads: int,
                          kv_heads: int) -> bool:
    """Whether ``kvgen::decoder_attention_inputs`` computes this layer's ``q, k, v`` (its weights' side of it)."""
    return ((_packed(proj) or _biased(proj)) and head_dim % 32 == 0
            and head_dim * (heads + 2 * kv_heads) == proj.out_features and norm.weight.dtype == torch.float32)


def mlp_fuses(o_proj: torch.nn.Module, pre_norm: torch.nn.Module, mlp: torch.nn.Module) -> bool:
    """Whether ``kvgen::decoder_mlp`` computes this layer's MLP half (its weights' side of it)."""
    return (mlp.act_name in ACTIVATION_CODES and _packed(o_proj) and _packed(mlp.gate_up_proj)
            and _packed(mlp.down_proj) and pre_norm.weight.dtype == torch.float32)


# The two ops below run once per layer and decode step (where kvgen.models.decode_stack does not run the
# whole stack) or prefill: their wrappers read each attribute once.

def decoder_attention_inputs(x: torch.Tensor, norm: torch.nn.Module, proj: torch.nn.Module, cos: torch.Tensor,
                             sin: torch.Tensor, heads: int, kv_heads: int, q_norm: torch.nn.Module | None = None,
                             k_norm: torch.nn.Module | None = None) -> list[torch.Tensor] | None:
    """``q, k, v`` of a decode step or prefill as one C++ op (``kvgen::decoder_attention_inputs``): ``norm(x)``,
    the fused q/k/v product ``proj`` on stored-precision weights (plus its bias, if any), the optional per-head
    norms, rotary on every query and key channel. Norms are RMSNorm modules with ``weight``, ``eps`` and ``offset``
    (they scale by ``weight + offset``; one offset for all of a model's norms). None
    where it does not apply (float weights with a bias, partial rotary, a product that this many rows would
    dequantize first, rows of a prompt's and of generated tokens whose products differ: :func:`products_rows_kind`):
    then the caller runs its modules, which compute the same."""
    rows = x.shape[0] * x.shape[1]
    prompt = products_rows_kind(rows, proj)
    if not (isinstance(prompt, bool) and cos.dtype == torch.float32 and _native(x, None)
            and attention_inputs_fuse(norm, proj, cos.shape[-1], heads, kv_heads) and proj.takes_qmatmul(rows)):
        return None
    return torch.ops.kvgen.decoder_attention_inputs(
        x, norm.weight, norm.eps, proj._segments, proj.formats, cos, sin, heads, kv_heads, _weight(q_norm),
        _weight(k_norm), 0.0 if q_norm is None else q_norm.eps, norm.offset, proj.bias, prompt)


def decoder_mlp(x: torch.Tensor, attn: torch.Tensor, o_proj: torch.nn.Module, pre_norm: torch.nn.Module,
                mlp: torch.nn.Module, post_attention: torch.nn.Module | None = None,
                post_feedforward: torch.nn.Module | None = None) -> torch.Tensor | None:
    """``h = x + post_attention(o_proj(attn)); h + post_feedforward(mlp(pre_norm(h)))`` of a decode step or
    prefill as one C++ op (``kvgen::decoder_mlp``: a gated MLP with ``mlp.act_name`` in
    :data:`ACTIVATION_CODES`, on stored-precision weights; the post norms are Gemma's, absent
    for Llama). None where it does not apply (as :func:`decoder_attention_inputs`)."""
    rows, gate_up, down = x.shape[0] * x.shape[1], mlp.gate_up_proj, mlp.down_proj
    prompt = products_rows_kind(rows, o_proj, gate_up, down)
    if not (isinstance(prompt, bool) and _native(x, None) and mlp_fuses(o_proj, pre_norm, mlp)
            and all(p.takes_qmatmul(rows) for p in (o_proj, gate_up, down))):
        return None
    return torch.ops.kvgen.decoder_mlp(
        x, attn, o_proj._segments, o_proj.formats, _weight(post_attention), pre_norm.weight, _weight(post_feedforward),
        pre_norm.eps, gate_up._segments, gate_up.formats, down._segments, down.formats,
        ACTIVATION_CODES[mlp.act_name], pre_norm.offset, prompt)
