"""A decode step's whole stack of decoder layers as one C++ op, on stored-precision weights.

Per layer, an eager decode step on packed weights is three C++ ops (``kvgen::decoder_attention_inputs``,
``kvgen::attention``, ``kvgen::decoder_mlp``) and the Python around them: module calls, the checks of
each op's wrapper, the mask lookup and the cache update, ~60-100 us a layer, a quarter of a SmolLM2
Q4_1 step on 2 cores (2.5 of ~10 ms). Where every layer's cache can hand out the slots its new keys and
values go to (:meth:`kvgen.cache.base.Cache.reserve`), :meth:`DecodeStack.run` runs all layers as one
op, ``kvgen::decoder_layers``: the C++ functions of the per-layer ops in the same order, in one parallel
region, the new keys and values written straight into the reserved slots, so it gives the bits the
per-layer path gives.

The op's weight-side arguments (every layer's weights, norms, formats) are gathered once and registered
with ``kvgen::decoder_stack``, which keeps them in C++ under an id the steps pass (not ~300 tensors in
Python lists, converted at every call). They are gathered again when anything under the layers changes:
the ``_modules``, ``_parameters``, ``_buffers`` and hook dicts of every module below them are swapped for
watched dicts (:func:`_counting`), which count their changes, so a step compares one number (comparing the identity
of every entry instead took 0.12-0.2 ms of a SmolLM2 step: ~540 entries, their cache lines cold after the
step's 100 MB of weights). A tensor whose data is set anew (``param.data = ...``, as ``module.to()`` does)
changes no dict: the op compares each registered tensor's data pointer with the one it registered and, where
one moved, does nothing; :meth:`DecodeStack.run` then registers the weights again. The layers' settings (scales,
epsilons, activations: plain attributes, copied into C++ too) count their assignments (:class:`CountedSettings`).

Example:
    >>> stack = DecodeStack(llama_layer_parts)                                        # doctest: +SKIP
    >>> x = stack.run(model.model.layers, x, [(cos, sin)], [0] * len(layers), masks, cache)  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import operator
import weakref
from typing import Callable, NamedTuple

import torch

from kvgen.kernels.prompt_rows import rows_kind
from kvgen.models.native import ACTIVATION_CODES, _native, _weight, attention_inputs_fuse, mlp_fuses
from kvgen.models.quantized_linear import prompt_products_differ


class LayerParts(NamedTuple):
    """The modules of one decoder layer that the fused step reads (the post norms are Gemma's, else None)."""

    input_norm: torch.nn.Module
    attn: torch.nn.Module  # qkv_proj, o_proj, q_norm, k_norm, num_heads, num_kv_heads, scaling, sliding_window
    pre_feedforward: torch.nn.Module
    mlp: torch.nn.Module  # gate_up_proj, down_proj, act_name
    post_attention: torch.nn.Module | None = None
    post_feedforward: torch.nn.Module | None = None


#: most rows (batch x new tokens) a step runs through the stack; more (a prefill) take the per-layer path. The serving
#: engine's decode steps of 16 sequences (SmolLM2's GGUF, float16 pool, AMD EPYC Zen 3, 2 threads, alternating in one
#: process): 109-126 ms a step through the per-layer path (its ops past 8 rows are ATen's), 80-89 ms through the
#: stack; 32 sequences 211-230 against 197-212 ms; steps of prompt chunks and decodes at a 64-token budget alike
STACK_ROWS = 32


def fuses(parts: LayerParts) -> bool:
    """Whether kvgen's fused C++ ops compute this layer's decode step (its weights' side of it: packed or float32
    weights on the CPU, see :func:`~kvgen.models.native.attention_inputs_fuse`)."""
    attn = parts.attn
    return (attention_inputs_fuse(parts.input_norm, attn.qkv_proj, attn.head_dim, attn.num_heads, attn.num_kv_heads)
            and mlp_fuses(attn.o_proj, parts.pre_feedforward, parts.mlp))


_changes = [0]  # changes made to any watched dict so far


def _counting(base: type) -> type:
    """A subclass of ``base`` (``dict``, ``OrderedDict``) whose every change adds one to ``_changes[0]``: item
    assignment and deletion, ``|=``, ``pop``, ``popitem``, ``clear``, ``update``, ``setdefault``. Pickled and
    copied as a plain ``base``."""
    def counted(method):
        def call(self, *args, **kwargs):
            _changes[0] += 1
            return method(self, *args, **kwargs)
        return call

    names = ("__setitem__", "__delitem__", "__ior__", "pop", "popitem", "clear", "update", "setdefault")
    namespace = {name: counted(getattr(base, name)) for name in names}
    namespace.update(__slots__=(), __reduce__=lambda self: (base, (list(self.items()),)))
    return type(f"_Watched{base.__name__}", (base,), namespace)


_Watched, _WatchedHooks = _counting(dict), _counting(collections.OrderedDict)


class CountedSettings:
    """Mixin of the modules whose settings (plain attributes: attention scale, soft-cap, norm epsilon, activation
    name, ...) the stack copies into C++ when it registers their weights: assigning any of their attributes counts
    as a change. ``nn.Module.__setattr__`` keeps plain values in the instance's own dict, which no watched dict sees.

    Example:
        >>> class Norm(CountedSettings, torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.eps = 1e-6
        >>> norm, before = Norm(), _changes[0]
        >>> norm.eps = 1e-5
        >>> _changes[0] == before + 1
        True
    """

    def __setattr__(self, name: str, value) -> None:
        _changes[0] += 1
        super().__setattr__(name, value)


_STORES = ("_modules", "_parameters", "_buffers")
_HOOKS = ("_forward_hooks", "_forward_pre_hooks")


def _watch(layers: torch.nn.ModuleList) -> None:
    """Swap the dicts of ``layers`` and every module below for watched ones (their contents kept)."""
    for module in layers.modules():
        held = module.__dict__
        for name in _STORES:
            if type(held.get(name)) is dict:
                held[name] = _Watched(held[name])
        for name in _HOOKS:
            if type(held.get(name)) is collections.OrderedDict:
                held[name] = _WatchedHooks(held[name])


class _Registered:
    """Weights registered with ``kvgen::decoder_stack`` (``args``: its arguments), forgotten there
    (``kvgen::decoder_stack_free``) when this object is collected."""

    def __init__(self, args: tuple):
        self.id = torch.ops.kvgen.decoder_stack(*args)
        weakref.finalize(self, torch.ops.kvgen.decoder_stack_free, self.id)


class _Plan(NamedTuple):
    windows: list[int | None]  # each layer's sliding window
    kv_heads: int
    head_dim: int
    weights: _Registered
    formats: frozenset[int]  # every product's weight formats (a prompt's rows: prompt_products_differ)


class DecodeStack:
    """Runs the decoder layers of a decode step (at most ``MAX_ROWS`` token rows) as one op where it applies.

    ``parts(layer)`` names a layer's modules (:class:`LayerParts`). :meth:`run` returns ``None``, having changed
    nothing, where the fused op does not apply: float weights, more rows, autograd or compile, a cache that
    stores only through ``update``, a causal mask (a prefill into an empty cache), layers of different shapes,
    forward hooks on a layer (they see each layer's call).
    """

    def __init__(self, parts: Callable[[torch.nn.Module], LayerParts]):
        self.parts = parts
        self._layers: torch.nn.ModuleList | None = None
        self._gathered_at = -1  # _changes[0] when the plan was gathered
        self._plan: _Plan | None = None
        self._mask_layers: list[weakref.ref] = []  # the cache layers _mask_askers was worked out for (weakly)
        self._mask_windows: list[int | None] = []  # and the layers' windows
        self._mask_askers: list[int] = []  # per layer, the first layer of its mask group

    def __deepcopy__(self, memo) -> "DecodeStack":
        return DecodeStack(self.parts)  # (a copy's weights are other tensors: gathered and registered anew)

    def __getstate__(self) -> dict:
        return {"parts": self.parts}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["parts"])

    def _current_plan(self, layers: torch.nn.ModuleList) -> _Plan | None:
        if layers is self._layers and _changes[0] == self._gathered_at:
            return self._plan
        _watch(layers)
        self._layers, self._gathered_at = layers, _changes[0]
        self._plan = self._gather(layers)
        return self._plan

    def _gather(self, layers: torch.nn.ModuleList) -> _Plan | None:
        parts = [self.parts(layer) for layer in layers]
        if not parts or any(getattr(layer, name) for layer in layers for name in _HOOKS):
            return None  # (hooks see each layer's call)
        first = parts[0].attn
        heads, kv_heads, head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        norms = [p.input_norm for p in parts] + [p.pre_feedforward for p in parts]
        eps, offset = norms[0].eps, norms[0].offset
        act = ACTIVATION_CODES.get(parts[0].mlp.act_name)
        for p in parts:
            a = p.attn
            if ((a.num_heads, a.num_kv_heads, a.head_dim) != (heads, kv_heads, head_dim)
                    or p.mlp.act_name != parts[0].mlp.act_name or not fuses(p)):
                return None
        head_norms = [n for p in parts for n in (p.attn.q_norm, p.attn.k_norm) if n is not None]
        if any((n.eps, n.offset) != (eps, offset) for n in norms) or \
                len({n.eps for n in head_norms}) > 1 or any(n.weight.dtype != torch.float32 for n in head_norms):
            return None

        def segments(linears):
            return ([w for m in linears for w in m._segments], [f for m in linears for f in m.formats],
                    [len(m.formats) for m in linears])

        args = (
            [p.attn.scaling for p in parts], [getattr(p.attn, "softcap", None) or 0.0 for p in parts],  # 0: none
            [p.input_norm.weight for p in parts], [_weight(p.attn.q_norm) for p in parts],
            [_weight(p.attn.k_norm) for p in parts], *segments([p.attn.qkv_proj for p in parts]),
            *segments([p.attn.o_proj for p in parts]), [_weight(p.post_attention) for p in parts],
            [p.pre_feedforward.weight for p in parts], [_weight(p.post_feedforward) for p in parts],
            *segments([p.mlp.gate_up_proj for p in parts]), *segments([p.mlp.down_proj for p in parts]),
            heads, kv_heads, eps, head_norms[0].eps if head_norms else 0.0, offset, act,
            [p.attn.qkv_proj.bias for p in parts])
        formats = frozenset(f for p in parts for m in (p.attn.qkv_proj, p.attn.o_proj, p.mlp.gate_up_proj,
                                                       p.mlp.down_proj) for f in m.formats)
        return _Plan([p.attn.sliding_window for p in parts], kv_heads, head_dim, _Registered(args), formats)

    def _layer_masks(self, masks, cache, windows: list[int | None]) -> list[torch.Tensor | None] | None:
        """Each layer's mask, asked of ``masks`` once per group of layers sharing one; ``None`` if one is causal.

        A cache layer's mask group (:meth:`~kvgen.cache.base.Cache.mask_group`: its type, window, size) is fixed
        while the cache holds the same layer object, so the groups are worked out again only when the cache's
        layers change (asking each layer's group costs ~3 us a layer in a step: 0.1 ms for 30 layers).
        """
        layers, known = cache.layers[:len(windows)], self._mask_layers
        if windows != self._mask_windows or len(known) != len(windows) or \
                not all(map(operator.is_, map(operator.call, known), layers)):
            firsts: dict[tuple, int] = {}
            self._mask_askers = [firsts.setdefault((cache.mask_group(i), w), i) for i, w in enumerate(windows)]
            self._mask_layers = list(map(weakref.ref, cache.layers[:len(windows)]))  # (mask_group may add layers)
            self._mask_windows = list(windows)
        asked = {i: masks(i, windows[i]) for i in set(self._mask_askers)}
        if any(is_causal for _, is_causal in asked.values()):
            return None
        return [asked[i][0] for i in self._mask_askers]

    def run(self, layers: torch.nn.ModuleList, x: torch.Tensor, tables: list[tuple[torch.Tensor, torch.Tensor]],
            table_of: list[int], masks, cache) -> torch.Tensor | None:
        """The hidden states after every layer, or ``None`` (nothing done) where the fused op does not apply.

        ``layers``: the decoder layers; ``x``: (B, T, hidden); ``tables``: the rotary ``(cos, sin)`` tables, (B, T,
        D) each, layer ``i`` taking ``tables[table_of[i]]``; ``masks``: the forward pass's
        :class:`~kvgen.models.base.LayerMasks`; ``cache``: the cache to extend.
        """
        out = self._step(layers, x, tables, table_of, masks, cache)
        if out is not None and out.numel() == 0:  # a registered tensor's data was set anew (`param.data = ...`)
            self._layers = None  # gathered and registered again
            out = self._step(layers, x, tables, table_of, masks, cache)
            if out is not None and out.numel() == 0:
                raise RuntimeError("kvgen: the decode stack's weights moved between their registration and the step")
        return out

    def _step(self, layers, x, tables, table_of, masks, cache) -> torch.Tensor | None:
        """:meth:`run`'s step: ``None`` where the fused op does not apply, an empty tensor (nothing done, the cache
        as it was) where a registered tensor's data moved since its registration."""
        b, t = x.shape[0], x.shape[1]
        if cache is None or b * t > STACK_ROWS or not _native(x, None) or tables[0][0].dtype != torch.float32:
            return None
        plan = self._current_plan(layers)
        if plan is None or tables[0][0].shape[-1] != plan.head_dim:
            return None
        if rows_kind(b * t) is not False and prompt_products_differ(plan.formats):
            return None  # a prompt's rows, whose products differ from the stack's: the per-layer ops' (prompt_rows)
        count = len(plan.windows)
        layer_masks = self._layer_masks(masks, cache, plan.windows)  # before reserving: it asks the cache
        if layer_masks is None:
            return None
        new = x.new_empty(()).expand(b, plan.kv_heads, t, plan.head_dim)  # the shape of each layer's new keys
        length, reserved = cache.get_seq_length(), None
        try:
            reserved = cache.reserve([new] * count, [new] * count, int(masks.cache_position.reshape(-1)[0]))
            if reserved is None:
                return None
            keys, values, starts, ends, slots = zip(*reserved)
            out = torch.ops.kvgen.decoder_layers(x, [c for c, _ in tables], [s for _, s in tables], table_of, keys,
                                                 values, starts, ends, layer_masks, slots, plan.weights.id)
        except BaseException:
            _give_back(cache, reserved, length)  # reserved, not all written (a layer refusing, a failing op)
            raise
        if out.numel() == 0:
            _give_back(cache, reserved, length)
        return out


def _give_back(cache, reserved: list[tuple] | None, length: int) -> None:
    """Undo ``cache.reserve``: the cache cropped back to ``length``, unless its layers store where the step placed
    the new tokens (a paged pool: nothing reserved to undo)."""
    if reserved is None or any(slots is None for *_, slots in reserved):
        cache.crop(length)
