"""Quantized caches: :class:`QuantizedCacheConfig`, :class:`QuantizedLayer`, :class:`QuantizedCache`,
:class:`QuantoQuantizedCache`, :class:`HQQQuantizedCache`.

A quantized layer keeps the most recent ``residual_length`` tokens (and at most one more
block) in full precision and everything older quantized, in blocks appended as the
residual fills (KIVI, Liu et al. 2024: the latest tokens matter most, and a prefill is
not quantized all at once including its last tokens, as the reference does). The first
``num_sink_tokens`` tokens (attention sinks) stay in full precision too. ``update``
dequantizes the quantized part into a workspace shared by the layers of the cache
and returns it with the residual appended: memory holds only the codes plus one layer's
worth of full-precision keys/values at a time.

Backends (``QuantizedCacheConfig.backend``):

* ``"kivi"``: kvgen's own, pure PyTorch, 2/4/8 bits; keys per channel, values per token.
* ``"quanto"`` (default, as in the seeds): optimum-quanto, 2/4 bits (``pip install optimum-quanto``).
* ``"hqq"``: HQQ, 1/2/3/4/8 bits (``pip install hqq``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from kvgen.cache.base import Cache, CacheLayer, check_next_positions, config_value, operation, text_config
from kvgen.cache.codec import register_persistable, register_policy
from kvgen.cache.dynamic import DynamicSlidingWindowLayer
from kvgen.cache.quantizers import HQQBackend, KiviStore, LibraryStore, QuantoBackend, scale_dtype
from kvgen.cache.registry import register_cache

#: backend -> (allowed nbits, allowed axis values, what an axis means there)
_BACKENDS = {
    "kivi": ((2, 4, 8), (0,), "kivi always quantizes keys per channel and values per token (KIVI); "
                                "axis_key/axis_value are quanto/hqq settings: leave them at 0"),
    "quanto": ((2, 4), (0, -1), "quanto: 0 groups along head_dim (per token), -1 along tokens (per channel)"),
    "hqq": ((1, 2, 3, 4, 8), (0, 1), "hqq: 1 groups along head_dim (per token), 0 along the flattened tensor"),
}


@dataclass
class QuantizedCacheConfig:
    """Settings of a :class:`QuantizedCache`, with the defaults of the seeds (backend ``"quanto"``).

    Args:
        backend: ``"kivi"`` (kvgen's own), ``"quanto"`` or ``"hqq"``.
        nbits: bits per code (kivi 2/4/8, quanto 2/4, hqq 1/2/3/4/8).
        axis_key / axis_value: the library's grouping axis (quanto 0/-1, hqq 0/1; kivi: 0).
        q_group_size: elements sharing one scale and zero point; left unset: 64 (the seeds' default),
            but 32 for 2-bit kivi, the KIVI paper's 2-bit setting (+4.5% perplexity on SmolLM2 + KJV where
            64 gives +6.8%, ``benchmarks/quantized_quality.py``).
        residual_length: the most recent tokens kept in full precision.
        compute_dtype / device: accepted for compatibility; the cache follows the dtype and device
            of the keys and values it is given.
        num_sink_tokens: kvgen's addition: the first tokens of the sequence stay in full precision
            too (attention sinks, as in StreamingLLM; most heads attend to them heavily, and on
            SmolLM2-135M quantizing them costs more than everything else at 4 bits). ``0`` is
            plain KIVI.

    Example:
        >>> from kvgen import QuantizedCacheConfig
        >>> QuantizedCacheConfig(backend="kivi", nbits=2).q_group_size
        32
        >>> QuantizedCacheConfig(backend="quanto", nbits=8)
        Traceback (most recent call last):
        ...
        ValueError: nbits=8 is not supported by the 'quanto' backend; it supports 2, 4 ...
    """

    backend: str = "quanto"
    nbits: int = 4
    axis_key: int = 0
    axis_value: int = 0
    q_group_size: int | None = None  # resolved in __post_init__ (see Args)
    residual_length: int = 128
    compute_dtype: torch.dtype = torch.float16
    device: Any = "cpu"
    num_sink_tokens: int = 4

    cache_implementation = "quantized"

    def __post_init__(self) -> None:
        self._group_unset = self.q_group_size is None  # (not a field: to_dict() holds the resolved value)
        self._resolve_group()
        if isinstance(self.compute_dtype, str):
            name = self.compute_dtype.removeprefix("torch.")
            if not isinstance(getattr(torch, name, None), torch.dtype):
                raise ValueError(f"compute_dtype {self.compute_dtype!r} is not a torch dtype name (e.g. 'float16')")
            self.compute_dtype = getattr(torch, name)
        self.validate()

    def _resolve_group(self) -> None:
        if self._group_unset:
            self.q_group_size = 32 if (self.backend, self.nbits) == ("kivi", 2) else 64

    def validate(self) -> None:
        """Raise ``ValueError`` naming the setting and what is allowed when a setting is invalid."""
        if self.backend not in _BACKENDS:
            raise ValueError(f"unknown quantization backend {self.backend!r}; valid backends are: "
                             f"{', '.join(sorted(_BACKENDS))}")
        bits, axes, axis_help = _BACKENDS[self.backend]
        if not _is_int(self.nbits) or self.nbits not in bits:
            raise ValueError(f"nbits={self.nbits!r} is not supported by the {self.backend!r} backend; it supports "
                             f"{', '.join(map(str, bits))} (kivi: 2, 4, 8; hqq: 1, 2, 3, 4, 8)")
        for name in ("axis_key", "axis_value"):
            value = getattr(self, name)
            if not _is_int(value) or value not in axes:
                raise ValueError(f"{name}={value!r} is not valid for the {self.backend!r} backend; allowed: "
                                 f"{', '.join(map(str, axes))} ({axis_help})")
        if not _is_int(self.q_group_size) or self.q_group_size < 1:
            raise ValueError(f"q_group_size must be a positive integer, got {self.q_group_size!r}")
        if self.backend == "kivi" and self.q_group_size % (8 // self.nbits):
            raise ValueError(f"the kivi backend packs {8 // self.nbits} tokens per byte at nbits={self.nbits}: "
                             f"q_group_size must be a multiple of {8 // self.nbits}, got {self.q_group_size}")
        if not _is_int(self.residual_length) or self.residual_length < 0:
            raise ValueError(f"residual_length must be a non-negative integer, got {self.residual_length!r}")
        if not _is_int(self.num_sink_tokens) or self.num_sink_tokens < 0:
            raise ValueError(f"num_sink_tokens must be a non-negative integer, got {self.num_sink_tokens!r}")
        if not isinstance(self.compute_dtype, torch.dtype) or not self.compute_dtype.is_floating_point:
            raise ValueError(f"compute_dtype must be a floating torch dtype, got {self.compute_dtype!r}")

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs) -> "QuantizedCacheConfig":
        """Build from a dict such as ``{"backend": "kivi", "nbits": 2}``; ``kwargs`` override it."""
        merged = {**config_dict, **kwargs}
        merged.pop("cache_implementation", None)
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - fields)
        if unknown:
            raise ValueError(f"unknown quantized cache_config keys {unknown}; valid keys are: {', '.join(sorted(fields))}")
        return cls(**merged)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def update(self, **kwargs) -> dict:
        """Set the given attributes that exist, validate, and return the ones that don't."""
        unused = {}
        for key, value in kwargs.items():
            if hasattr(self, key):
                setattr(self, key, value)
            else:
                unused[key] = value
        if "q_group_size" in kwargs:
            self._group_unset = kwargs["q_group_size"] is None
        self._resolve_group()
        self.validate()
        return unused


def _is_cache_config(x) -> bool:
    """A QuantizedCacheConfig, or a non-empty dict of its settings (rather than a model config)."""
    if isinstance(x, QuantizedCacheConfig):
        return True
    names = {f.name for f in dataclasses.fields(QuantizedCacheConfig)} | {"cache_implementation"}
    return isinstance(x, dict) and bool(x) and set(x) <= names


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def as_quantized_config(cache_config=None, **overrides) -> QuantizedCacheConfig:
    """A :class:`QuantizedCacheConfig` from ``None``, a dict or a config; non-None ``overrides`` win."""
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if cache_config is None:
        return QuantizedCacheConfig.from_dict(overrides)
    if isinstance(cache_config, QuantizedCacheConfig):
        settings = cache_config.to_dict()
        if cache_config._group_unset:  # still the default: let the overrides' backend and nbits choose it
            settings.pop("q_group_size")
        return QuantizedCacheConfig.from_dict(settings, **overrides)
    if isinstance(cache_config, dict):
        return QuantizedCacheConfig.from_dict(cache_config, **overrides)
    raise TypeError(f"cache_config must be a dict or a QuantizedCacheConfig, got {type(cache_config).__name__}")


class Workspace:
    """Scratch buffers shared by the layers of one cache (grown as needed, never copied).

    The keys/values a quantized layer returns live here until the next ``update`` of any
    layer of the same cache: attention consumes them at once.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        #: bumped whenever a buffer is replaced, so views prepared earlier can be recognised as stale
        self.generation = 0

    def __call__(self, name: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        n = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != dtype or buf.device != torch.device(device):
            size = max(n, buf.numel() * 5 // 4) if buf is not None and buf.dtype == dtype else n
            buf = self._buffers[name] = torch.empty(size, dtype=dtype, device=device)
            self.generation += 1
        return buf[:n].view(shape)

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def __deepcopy__(self, memo) -> "Workspace":
        return Workspace()


def make_stores(config: QuantizedCacheConfig):
    """``(key_store, value_store)`` factories for ``config`` (raises ImportError for a missing library)."""
    if config.backend == "kivi":
        return (lambda: KiviStore(config.nbits, config.q_group_size, per_channel=True),
                lambda: KiviStore(config.nbits, config.q_group_size, per_channel=False))
    backend = (QuantoBackend if config.backend == "quanto" else HQQBackend)(config.nbits, config.q_group_size)
    # One library call per block: blocks of residual_length tokens (whole groups) keep the calls few.
    g = config.q_group_size
    block = max(g, -(-config.residual_length // g) * g)
    return (lambda: LibraryStore(backend, config.axis_key, block),
            lambda: LibraryStore(backend, config.axis_value, block))


class QuantizedLayer(CacheLayer):
    """A layer whose older tokens are quantized; the first and the newest tokens stay exact.

    Its full-precision buffer holds the first ``num_sink_tokens`` tokens (attention sinks,
    which most heads attend to heavily) followed by the residual: between
    ``residual_length`` and ``residual_length + block - 1`` of the newest tokens once that
    many were seen. Each time the residual reaches ``residual_length + block``, its oldest
    whole blocks are quantized. ``update`` returns ``[sinks | dequantized | residual]``:
    slot ``i`` holds position ``i``. With the ``kivi`` backend that buffer is 16-bit for a
    float32 model (as its scales are: float32 would be a third of the cache at 4 bits; the
    perplexity is unchanged, see ``benchmarks/README.md``); keys and values come back in the
    model's dtype.

    Example:
        >>> import torch
        >>> from kvgen.cache.quantized import QuantizedLayer
        >>> layer = QuantizedLayer({"backend": "kivi", "residual_length": 16, "q_group_size": 16})
        >>> k = v = torch.randn(1, 2, 40, 16)
        >>> keys, values = layer.update(k, v, torch.arange(40))
        >>> layer.quantized_length, layer.residual_length_now, tuple(keys.shape)
        (16, 20, (1, 2, 40, 16))
    """

    #: dtype of the keys and values ``update`` returns: the model's (``None``: the exact buffer's, in caches saved
    #: before the buffer could be narrower)
    compute_dtype: torch.dtype | None = None

    def __init__(self, config: QuantizedCacheConfig | dict | None = None, workspace: Workspace | None = None,
                 stores=None):
        self.config = config if isinstance(config, QuantizedCacheConfig) else as_quantized_config(config)
        key_store, value_store = stores or make_stores(self.config)
        self._kq, self._vq = key_store(), value_store()
        self.block = self._kq.block_tokens
        self.sinks = self.config.num_sink_tokens
        self.workspace = workspace if workspace is not None else Workspace()
        self.reset()

    def reset(self) -> None:
        self._kq.reset()
        self._vq.reset()
        # (B, H, sinks + residual_length + block, D): sink slots, then the residual
        self._rk: torch.Tensor | None = None
        self._rv: torch.Tensor | None = None
        self._n_sink = 0
        self._n_res = 0
        self._seen = 0
        self._plan = None  # prepared views into the workspace (see _gather)

    def map_tensors(self, fn) -> None:
        self._plan = None  # its views would point at the old tensors
        super().map_tensors(fn)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_plan"] = None  # views into the old workspace: rebuilt on the copy's next update
        return state

    @property
    def quantized_length(self) -> int:
        return self._kq.length

    @property
    def residual_length_now(self) -> int:
        return self._n_res

    # -- update ------------------------------------------------------------------------------------
    def _flush_count(self, n_res: int) -> int:
        """Tokens to quantize out of a residual of ``n_res``: whole blocks, keeping ``residual_length``."""
        excess = n_res - self.config.residual_length
        return (excess // self.block) * self.block if excess >= self.block else 0

    def update(self, key, value, cache_position):
        b, h, t, _ = key.shape
        if self._rk is None:
            capacity = self.sinks + self.config.residual_length + self.block
            self.compute_dtype = key.dtype
            exact = scale_dtype(key.dtype) if self.config.backend == "kivi" else key.dtype
            self._rk = key.new_empty(b, h, capacity, key.shape[3], dtype=exact)
            self._rv = value.new_empty(b, h, capacity, value.shape[3], dtype=exact)
        elif (b, h) != tuple(self._rk.shape[:2]):
            raise ValueError(
                f"new keys have batch {b} and {h} heads but the cache holds batch {self._rk.shape[0]} with "
                f"{self._rk.shape[1]} heads; use one cache per batch shape"
            )
        self._seen += t
        if self._n_sink < self.sinks:  # the first tokens fill the sink slots
            take = min(self.sinks - self._n_sink, t)
            self._rk[:, :, self._n_sink:self._n_sink + take] = key[:, :, :take]
            self._rv[:, :, self._n_sink:self._n_sink + take] = value[:, :, :take]
            self._n_sink += take
            key, value, t = key[:, :, take:], value[:, :, take:], t - take
        s, n = self.sinks, self._n_res
        flush = self._flush_count(n + t)
        if flush == 0:
            self._rk[:, :, s + n:s + n + t] = key
            self._rv[:, :, s + n:s + n + t] = value
            self._n_res = n + t
        else:
            k_all = torch.cat([self._rk[:, :, s:s + n], key], 2) if n else key  # (B, H, n + t, D)
            v_all = torch.cat([self._rv[:, :, s:s + n], value], 2) if n else value
            self._kq.append(k_all[:, :, :flush])
            self._vq.append(v_all[:, :, :flush])
            rest = n + t - flush
            self._rk[:, :, s:s + rest] = k_all[:, :, flush:]
            self._rv[:, :, s:s + rest] = v_all[:, :, flush:]
            self._n_res = rest
        return self._gather(self.workspace)

    def _gather(self, workspace: Workspace | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Sinks, dequantized part and residual, in order: (B, H, seen, D) keys and values.

        With a workspace, the result lives there (views, valid until the next update of any
        layer sharing it); the views and the dequantization steps are prepared once per
        quantized length (:meth:`_prepare`), so a decode step runs little but arithmetic.
        """
        ns, nq, nr = self._n_sink, self._kq.length, self._n_res
        if nq == 0:  # the sinks are full whenever the residual holds anything: one contiguous view
            dtype = self.compute_dtype or self._rk.dtype
            return self._rk[:, :, :ns + nr].to(dtype), self._rv[:, :, :ns + nr].to(dtype)
        if workspace is None:
            full_k, full_v, run = self._prepare(None, nq + nr)
        else:
            if self._plan is None or self._plan[0] != (workspace.generation, nq):
                self._plan = None  # drop old views before allocating
                plan = self._prepare(workspace, nq + self.config.residual_length + self.block)
                self._plan = ((workspace.generation, nq), *plan)
            _, full_k, full_v, run = self._plan
        run()
        s = self.sinks
        n = s + nq + nr
        full_k[:, :, s + nq:n] = self._rk[:, :, s:s + nr]
        full_v[:, :, s + nq:n] = self._rv[:, :, s:s + nr]
        return full_k[:, :, :n], full_v[:, :, :n]

    def _prepare(self, workspace: Workspace | None, tokens: int):
        """``(keys, values, run)``: buffers for ``sinks + tokens`` slots and a function writing sinks + dequantized part."""
        s, nq, steps, out = self.sinks, self._kq.length, [], []
        for store, buf, name in ((self._kq, self._rk, "keys"), (self._vq, self._rv, "values")):
            shape = (buf.shape[0], buf.shape[1], s + tokens, buf.shape[3])
            dtype = self.compute_dtype or buf.dtype
            full = workspace(name, shape, dtype, buf.device) if workspace else buf.new_empty(shape, dtype=dtype)
            steps.append((full[:, :, :s], buf[:, :, :s]))
            steps.append(store.dequantizer(full[:, :, s:s + nq], workspace))
            out.append(full)

        def run() -> None:
            for step in steps:
                if callable(step):
                    step()
                else:
                    step[0].copy_(step[1])

        return out[0], out[1], run

    def key_positions(self, cache_position):
        return torch.arange(self._seen + cache_position.shape[0], device=cache_position.device)

    def check_cache_position(self, cache_position):
        check_next_positions(cache_position, self._seen, "this quantized layer holds",
                             "Crop the cache first to rewrite earlier positions.")

    def get_seq_length(self):
        return self._seen

    @property
    def keys(self):
        return None if self._rk is None else self._gather(None)[0]

    @property
    def values(self):
        return None if self._rk is None else self._gather(None)[1]

    # -- editing -----------------------------------------------------------------------------------
    def crop(self, max_length):
        if max_length >= self._seen:
            return
        self._plan = None
        s, nq = self.sinks, self._kq.length
        if max_length <= s:
            self._n_sink = max_length
            self._kq.reset()
            self._vq.reset()
            self._n_res = 0
        elif max_length >= s + nq:
            self._n_res = max_length - s - nq
        else:  # the tokens past the last whole block come back (dequantized) into the residual
            tail_k = self._kq.crop(max_length - s, self._rk.dtype)
            tail_v = self._vq.crop(max_length - s, self._rv.dtype)
            r = 0 if tail_k is None else tail_k.shape[2]
            if r:
                self._rk[:, :, s:s + r] = tail_k
                self._rv[:, :, s:s + r] = tail_v
            self._n_res = r
        self._seen = max_length

    def checkpoint(self, new_tokens):
        """``None`` while the new tokens stay in the residual; when they would quantize blocks, a restore that
        drops those blocks and puts back the residual (``crop`` would bring their tokens back dequantized)."""
        if self._rk is None or not self._flush_count(self._n_res + new_tokens):
            return None
        quantized, state = self._kq.length, (self._n_sink, self._n_res, self._seen)
        kept = self.sinks + self._n_res
        residual = self._rk[:, :, :kept].clone(), self._rv[:, :, :kept].clone()  # (B, H, sinks + residual, D)

        def restore():
            self._kq.crop(quantized, self._rk.dtype)  # whole blocks: nothing comes back
            self._vq.crop(quantized, self._rv.dtype)
            self._rk[:, :, :kept], self._rv[:, :, :kept] = residual
            self._n_sink, self._n_res, self._seen = state
            self._plan = None

        return restore

    def chunk_limit(self):
        # one by one, the tokens before the one that fills the residual see it unquantized; from that one on,
        # a block less of it until the next block fills
        before = self.config.residual_length + self.block - 1 - self._n_res
        return before if before > 0 else self.block

    def batch_tensor(self):
        return self._rk

    def batch_select_indices(self, indices):
        self._plan = None
        if self._rk is not None:
            indices = indices.to(self._rk.device)
            self._rk, self._rv = self._rk.index_select(0, indices), self._rv.index_select(0, indices)
            self._kq.batch_select(indices)
            self._vq.batch_select(indices)

    def batch_repeat_interleave(self, repeats):
        self._plan = None
        if self._rk is not None:
            self._rk = self._rk.repeat_interleave(repeats, dim=0)
            self._rv = self._rv.repeat_interleave(repeats, dim=0)
            self._kq.batch_repeat(repeats)
            self._vq.batch_repeat(repeats)

    def nbytes(self):
        """Bytes held: codes, scales and zero points of both stores, and the full-precision sink/residual buffers."""
        exact = 0 if self._rk is None else sum(t.numel() * t.element_size() for t in (self._rk, self._rv))
        return self._kq.nbytes() + self._vq.nbytes() + exact


class QuantizedCache(Cache):
    """A cache that quantizes all but the latest tokens (KIVI), to fit longer contexts in memory.

    Accepts every spelling of the seeds and transformers versions:
    ``QuantizedCache(cache_config)`` / ``QuantizedCache(cache_config={...})`` (transformers 4.4x),
    ``QuantizedCache("kivi", model.config, nbits=2)`` (transformers 5), keyword settings, or
    ``generate(..., cache_implementation="quantized", cache_config={"backend": "kivi", "nbits": 4})``.
    Layers of sliding-window attention (``config.layer_types``) keep a bounded full-precision window.
    ``offloading=True`` also keeps all but the layer being computed (codes, scales and residual)
    on the CPU, as :class:`~kvgen.cache.offload.OffloadedCache` does.

    Example:
        >>> from kvgen import QuantizedCache
        >>> cache = QuantizedCache(backend="kivi", nbits=4)                      # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=20)  # doctest: +SKIP
        >>> out = model.generate(**inputs, max_new_tokens=20, cache_implementation="quantized",
        ...                      cache_config={"backend": "kivi", "nbits": 2})    # doctest: +SKIP
    """

    _backend: str | None = None  # subclasses fix the backend

    def __init__(self, backend=None, config=None, nbits: int | None = None, axis_key: int | None = None,
                 axis_value: int | None = None, q_group_size: int | None = None,
                 residual_length: int | None = None, *, cache_config=None, compute_dtype=None, device=None,
                 offloading: bool = False, offload_only_non_sliding: bool = False):
        if backend is not None and not isinstance(backend, str):  # QuantizedCache(cache_config or model config)
            if config is not None:
                raise TypeError(f"backend must be a string, got {type(backend).__name__}")
            backend, config = None, backend
        if _is_cache_config(config):  # QuantizedCache(cache_config) / QuantoQuantizedCache(cache_config)
            if cache_config is not None:
                raise TypeError("pass the QuantizedCacheConfig once (positionally or as cache_config=)")
            config, cache_config = None, config
        if self._backend is not None:  # QuantoQuantizedCache / HQQQuantizedCache: the class decides
            backend = self._backend
        self.cache_config = as_quantized_config(
            cache_config, backend=backend, nbits=nbits, axis_key=axis_key, axis_value=axis_value,
            q_group_size=q_group_size, residual_length=residual_length, compute_dtype=compute_dtype, device=device)
        self._stores = make_stores(self.cache_config)  # fails early when the backend's library is missing
        self.workspace = Workspace()
        if config is None:
            super().__init__(layer_factory=self._new_layer)
        else:
            config = text_config(config)
            n_layers = config_value(config, "num_hidden_layers")
            kinds = config_value(config, "layer_types") or ["full_attention"] * (n_layers or 0)
            window = config_value(config, "sliding_window")
            layers = [DynamicSlidingWindowLayer(window) if kind == "sliding_attention" and window
                      else self._new_layer(i) for i, kind in enumerate(kinds)]
            super().__init__(layers=layers, layer_factory=None if layers else self._new_layer)
        if offloading:
            operation("enable_offloading")(self, only_non_sliding=offload_only_non_sliding)

    def _new_layer(self, layer_idx: int) -> QuantizedLayer:
        """A method (not a closure), so a deep copy's new layers share the copy's workspace."""
        return QuantizedLayer(self.cache_config, self.workspace, self._stores)

    def workspace_nbytes(self) -> int:
        """Bytes of the shared scratch (one layer's dequantized keys/values and unpacked codes)."""
        return self.workspace.nbytes()


def _init_with_fixed_backend(self, config=None, nbits: int | None = None, axis_key: int | None = None,
                             axis_value: int | None = None, q_group_size: int | None = None,
                             residual_length: int | None = None, *, cache_config=None, compute_dtype=None,
                             device=None, offloading: bool = False, offload_only_non_sliding: bool = False):
    """The constructor of the one-backend classes: :class:`QuantizedCache`'s, less its ``backend`` argument."""
    QuantizedCache.__init__(self, None, config, nbits, axis_key, axis_value, q_group_size, residual_length,
                            cache_config=cache_config, compute_dtype=compute_dtype, device=device,
                            offloading=offloading, offload_only_non_sliding=offload_only_non_sliding)


class QuantoQuantizedCache(QuantizedCache):
    """:class:`QuantizedCache` with the optimum-quanto backend (2 or 4 bits; ``pip install optimum-quanto``).

    Example:
        >>> cache = QuantoQuantizedCache(config=model.config, nbits=4)                # doctest: +SKIP
        >>> cache = QuantoQuantizedCache(cache_config=QuantizedCacheConfig(nbits=2))  # doctest: +SKIP
    """

    _backend = "quanto"
    __init__ = _init_with_fixed_backend


class HQQQuantizedCache(QuantizedCache):
    """:class:`QuantizedCache` with the HQQ backend (1, 2, 3, 4 or 8 bits; ``pip install hqq``).

    Example:
        >>> cache = HQQQuantizedCache(config=model.config, nbits=4, axis_key=1, axis_value=1)  # doctest: +SKIP
    """

    _backend = "hqq"
    __init__ = _init_with_fixed_backend


@register_cache("quantized")
def _quantized(config, batch_size, max_cache_len, device, dtype, cache_config):
    return QuantizedCache(config=config, cache_config=cache_config)


# what cache files keep of these (kvgen.cache.codec): the scratch afresh, the stores rebuilt from the config
register_persistable(QuantizedCacheConfig)
register_persistable(Workspace)
register_policy(Workspace, reset={"_buffers": {}, "generation": 0})
register_policy(QuantizedCache, rebuilt={"_stores": lambda cache: make_stores(cache.cache_config)})
