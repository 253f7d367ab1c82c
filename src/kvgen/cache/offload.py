"""Offloading, a placement policy for any cache layer: :class:`OffloadedLayer`, :class:`OffloadedCache`,
:class:`OffloadedStaticCache`, :func:`enable_offloading`.

Offloading is orthogonal to growth and storage: :func:`enable_offloading` wraps each
layer of any cache (dynamic, static, sliding, quantized, ...) in an :class:`OffloadedLayer`,
and the layers of one cache share an :class:`Offloader` that runs the schedule. The
model calls ``cache.update`` for layers ``0..n-1`` in order; when layer ``i`` is updated:

* layer ``i`` becomes resident on the compute device (the compute stream waits for the
  event of its prefetch: no host synchronisation);
* layer ``i - 1``, whose attention is queued, goes back to the offload device (pinned
  host memory) on an eviction stream that first waits for the compute stream;
* layer ``i + 1`` is prefetched on a prefetch stream (after its last eviction finished),
  while layer ``i`` computes; the last layer prefetches layer 0 for the next forward pass.

So the compute device holds the current and the next layer (plus the previous one until
its copy completes). Host-side calls (``get_seq_length``, ``crop``, ``keys``, ...) first
settle a layer's copies in flight. Beam reordering of an offloaded layer is deferred to
its next prefetch, and done on the compute device.

All device work goes through one small :class:`Placement` object (copies, streams,
events); tests swap in a fake that records and delays moves. Where the compute device
is the offload device (a machine without a GPU), nothing moves and the caches work as
their plain counterparts (the reference required CUDA).

Offloaded layers report ``is_compileable = False``: ``generate()`` runs their decode step
eagerly (per-layer streams and events are host-side work between layers).
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable

import torch

from kvgen.cache.base import Cache, CacheLayer, register_operation
from kvgen.cache.codec import register_persistable, register_policy
from kvgen.cache.dynamic import DynamicCache, LegacyCache
from kvgen.cache.registry import register_cache
from kvgen.cache.static import StaticCache

OFFLOADED, PREFETCHING, RESIDENT = "offloaded", "prefetching", "resident"


def infer_device() -> str:
    """The available accelerator's device type (``"cuda"``, ``"xpu"``, ``"mps"``, ...), else ``"cpu"``.

    As ``transformers.infer_device``, used by the seeds' ``resilient_generate`` example.

    Example:
        >>> from kvgen import infer_device
        >>> infer_device() in ("cpu", "cuda", "xpu", "mps", "npu", "hpu", "mlu")
        True
    """
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return accelerator.current_accelerator().type
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def _as_device(device) -> torch.device:
    """``torch.device`` with an explicit index for indexed accelerators (``"cuda"`` -> ``cuda:<current>``)."""
    device = torch.device(device)
    if device.index is None and device.type not in ("cpu", "meta"):
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "current_device") and module.is_available():
            device = torch.device(device.type, module.current_device())
    return device


class Placement:
    """Where offloaded layers live and how their tensors move; the only code that touches devices and streams.

    ``compute_device`` holds the layer being computed (``None``: the device of the first
    keys); ``offload_device`` holds the others. On devices with streams (CUDA, XPU) copies
    are asynchronous: offloaded tensors go to pinned host memory, prefetches and evictions
    run on side streams, and events order them with the compute stream. Where both
    devices are the same, nothing moves.

    The offloader uses: ``moves``, ``bind``, ``to_compute``, ``to_offload``,
    ``side_stream``, ``record_event``, ``wait_event``, ``synchronize`` and ``hold``.

    Example:
        >>> import torch
        >>> from kvgen.cache.offload import Placement
        >>> Placement("cpu", "cpu").moves
        False
        >>> Placement(offload_device="cpu").compute_device is None   # bound by the first keys
        True
    """

    def __init__(self, compute_device=None, offload_device="cpu"):
        self.compute_device = None if compute_device is None else _as_device(compute_device)
        self.offload_device = _as_device(offload_device)
        self._streams: dict[str, Any] = {}

    @property
    def moves(self) -> bool:
        """True when layers really move (the compute device is known and differs from the offload device)."""
        return self.compute_device is not None and self.compute_device != self.offload_device

    def bind(self, device) -> None:
        """Take ``device`` (where the first keys are) as the compute device, unless one was given."""
        if self.compute_device is None:
            self.compute_device = _as_device(device)

    @property
    def _module(self):
        """``torch.cuda`` / ``torch.xpu`` / ... when the compute device has streams and events, else ``None``."""
        device = self.compute_device
        if device is None or device.type in ("cpu", "meta"):
            return None
        module = getattr(torch, device.type, None)
        needed = ("Stream", "stream", "current_stream")
        return module if module is not None and all(hasattr(module, n) for n in needed) else None

    # -- copies (issued on the current stream) ------------------------------------------------------
    def to_compute(self, t: torch.Tensor) -> torch.Tensor:
        """Asynchronous copy of ``t`` onto the compute device (``t`` itself when it is there already)."""
        return t.to(self.compute_device, non_blocking=True)

    def to_offload(self, t: torch.Tensor) -> torch.Tensor:
        """Asynchronous copy of ``t`` onto the offload device; into pinned memory when that is the host."""
        if (self.offload_device.type == "cpu" and t.device.type != "cpu" and type(t) is torch.Tensor
                and self._module is not None):
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            return out.copy_(t, non_blocking=True)
        return t.to(self.offload_device, non_blocking=True)

    # -- streams and events -----------------------------------------------------------------------
    def side_stream(self, purpose: str):
        """Context in which work runs on the side stream for ``purpose`` (``"prefetch"`` or ``"evict"``)."""
        module = self._module
        if module is None:
            return contextlib.nullcontext()
        if purpose not in self._streams:
            self._streams[purpose] = module.Stream(device=self.compute_device)
        return module.stream(self._streams[purpose])

    def record_event(self):
        """An event marking the work issued so far on the current stream (``None`` without streams)."""
        module = self._module
        return None if module is None else module.current_stream(self.compute_device).record_event()

    def wait_event(self, event) -> None:
        """Make the current stream wait for ``event`` (on the device: the host does not block)."""
        if event is not None:
            self._module.current_stream(self.compute_device).wait_event(event)

    def synchronize(self, event) -> None:
        """Block the host until ``event`` has completed."""
        if event is not None:
            event.synchronize()

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        """Note that the current stream uses ``t``, so its memory is not reused before that work is done."""
        module = self._module
        if module is not None and type(t) is torch.Tensor and t.device == self.compute_device:
            t.record_stream(module.current_stream(self.compute_device))
        return t

    def __deepcopy__(self, memo) -> "Placement":
        new = copy.copy(self)  # same devices and settings (subclasses keep theirs), fresh streams
        new._streams = {}
        return new

    def __repr__(self) -> str:
        return f"{type(self).__name__}(compute_device={self.compute_device}, offload_device={self.offload_device})"


class Offloader:
    """The schedule shared by the :class:`OffloadedLayer` s of one cache (in their layer order).

    ``activate(layer)`` runs when the model reaches a layer: the layer becomes resident,
    every other layer on the compute device except the next one is evicted, and the next
    one (wrapping around to the first) is prefetched. ``settle(layer)`` makes a layer safe
    for host-side access.
    """

    def __init__(self, placement: Placement):
        self.placement = placement
        self.layers: list[OffloadedLayer] = []
        self.active: OffloadedLayer | None = None  # the layer being computed
        self._on_compute: list[OffloadedLayer] = []  # layers resident or being prefetched

    def register(self, layer: "OffloadedLayer") -> None:
        layer._slot = len(self.layers)
        self.layers.append(layer)

    def next_layer(self, layer: "OffloadedLayer") -> "OffloadedLayer":
        return self.layers[(layer._slot + 1) % len(self.layers)]

    def activate(self, layer: "OffloadedLayer", device) -> None:
        """``layer`` is about to be computed on ``device`` (where its keys are)."""
        p = self.placement
        p.bind(device)
        if not p.moves:
            layer._apply_rows()
            self.active = layer
            return
        if layer is self.active and layer.state == RESIDENT:
            return
        self._make_resident(layer)
        upcoming = self.next_layer(layer)
        for other in [x for x in self._on_compute if x is not layer and x is not upcoming]:
            self._evict(other)
        if upcoming.state == OFFLOADED:
            self._prefetch(upcoming)
        self.active = layer

    def settle(self, layer: "OffloadedLayer") -> None:
        """Finish the copies in flight of ``layer`` so the host may read or edit it where it lies."""
        if layer.state == PREFETCHING:
            self._make_resident(layer)
        elif layer._evicted is not None:
            self.placement.synchronize(layer._evicted)
            layer._evicted = None
        layer._apply_rows()

    def synchronize(self) -> None:
        """Settle every layer (before a deep copy)."""
        for layer in self.layers:
            self.settle(layer)

    # -- moves ------------------------------------------------------------------------------------
    def _prefetch(self, layer: "OffloadedLayer") -> None:
        p = self.placement
        with p.side_stream("prefetch"):
            p.wait_event(layer._evicted)  # its host copy must be complete before it is read
            layer.inner.map_tensors(p.to_compute)
            layer._ready = p.record_event()
        layer._evicted = None
        layer.state = PREFETCHING
        self._on_compute.append(layer)

    def _make_resident(self, layer: "OffloadedLayer") -> None:
        p = self.placement
        if layer.state == PREFETCHING:
            p.wait_event(layer._ready)  # the compute stream waits for the prefetch, the host does not
            layer.inner.map_tensors(p.hold)  # allocated on the prefetch stream, used on the compute stream
        elif layer.state == OFFLOADED:  # not prefetched (first use, or layers used out of order): fetch now
            p.wait_event(layer._evicted)
            layer.inner.map_tensors(p.to_compute)
            self._on_compute.append(layer)
        layer._ready = layer._evicted = None
        layer.state = RESIDENT
        layer._apply_rows()

    def _evict(self, layer: "OffloadedLayer") -> None:
        p = self.placement
        computed = p.record_event()  # the compute work queued so far, which read this layer
        with p.side_stream("evict"):
            p.wait_event(computed)
            p.wait_event(layer._ready)  # evicted straight after a prefetch: let the prefetch land first
            layer.inner.map_tensors(lambda t: p.to_offload(p.hold(t)))
            layer._evicted = p.record_event()
        layer._ready = None
        layer.state = OFFLOADED
        self._on_compute.remove(layer)
        if self.active is layer:
            self.active = None

    def __deepcopy__(self, memo) -> "Offloader":
        self.synchronize()
        return _copy_attributes(self, memo)


def _copy_attributes(obj, memo):
    """Deep copy of ``obj`` attribute by attribute (registered in ``memo`` first, for shared references)."""
    new = object.__new__(type(obj))
    memo[id(obj)] = new
    for name, value in vars(obj).items():
        object.__setattr__(new, name, copy.deepcopy(value, memo))
    return new


class OffloadedLayer(CacheLayer):
    """Any cache layer, kept on the offload device except while the model computes it.

    Wraps ``inner`` (dynamic, static, sliding, quantized, ...): the tensors it stores are
    enumerated with ``inner.map_tensors(fn)`` and moved by the shared :class:`Offloader`.
    Every other call is passed to ``inner`` once its copies in flight are settled.

    Example:
        >>> import torch
        >>> from kvgen.cache.dynamic import DynamicLayer
        >>> from kvgen.cache.offload import OffloadedLayer, Offloader, Placement
        >>> layer = OffloadedLayer(DynamicLayer(), Offloader(Placement(offload_device="cpu")))
        >>> k = v = torch.zeros(1, 2, 3, 4)
        >>> keys, _ = layer.update(k, v, torch.arange(3))
        >>> tuple(keys.shape), layer.get_seq_length(), layer.state
        ((1, 2, 3, 4), 3, 'offloaded')
    """

    is_compileable = False

    def __init__(self, inner: CacheLayer, offloader: Offloader):
        if isinstance(inner, OffloadedLayer):
            raise ValueError("this layer is offloaded already")
        self.inner = inner
        self.offloader = offloader
        self.state = OFFLOADED  # tensors on the offload device (or none yet)
        self._ready = None  # event: prefetch complete
        self._evicted = None  # event: eviction complete
        self._rows: torch.Tensor | None = None  # deferred batch_select_indices
        self._slot = -1
        offloader.register(self)

    # -- what the model calls ---------------------------------------------------------------------
    @property
    def sliding_window(self):
        return self.inner.sliding_window

    @property
    def needs_rotary(self):
        return self.inner.needs_rotary

    def update(self, key, value, cache_position, **kwargs):
        self.offloader.activate(self, key.device)
        return self.inner.update(key, value, cache_position, **kwargs)

    def key_positions(self, cache_position):
        self.offloader.activate(self, cache_position.device)  # the model asks right before it updates
        return self.inner.key_positions(cache_position)

    # -- host-side calls: settle, then ask the inner layer ----------------------------------------------
    def _settled(self) -> CacheLayer:
        self.offloader.settle(self)
        return self.inner

    def check_cache_position(self, cache_position):
        self._settled().check_cache_position(cache_position)

    def get_seq_length(self):
        return self._settled().get_seq_length()

    def get_max_cache_shape(self):
        return self.inner.get_max_cache_shape()

    @property
    def keys(self):
        """The stored keys on the compute device, as without offloading (a copy while the layer is offloaded)."""
        return self._on_compute_device(self._settled().keys)

    @property
    def values(self):
        return self._on_compute_device(self._settled().values)

    def _on_compute_device(self, t: torch.Tensor | None) -> torch.Tensor | None:
        placement = self.offloader.placement
        return t if t is None or not placement.moves else placement.to_compute(t)

    def reset(self):
        self._settled().reset()

    def crop(self, max_length):
        self._settled().crop(max_length)

    def checkpoint(self, new_tokens):
        return self._settled().checkpoint(new_tokens)

    def chunk_limit(self):
        return self._settled().chunk_limit()

    def batch_tensor(self):
        """The deferred row selection when there is one (its length is the batch), else the inner layer's tensor."""
        return self._rows if self._rows is not None else self.inner.batch_tensor()

    def batch_select_indices(self, indices):
        if self.state == OFFLOADED and self.offloader.placement.moves:
            # deferred to the compute device: applied right after the next prefetch lands
            self._rows = indices if self._rows is None else self._rows.index_select(0, indices.to(self._rows.device))
            return
        self._settled().batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats):
        self._settled().batch_repeat_interleave(repeats)

    def nbytes(self):
        """Bytes of the layer's tensors wherever they are (the same as the layer without offloading)."""
        return self._settled().nbytes()

    def map_tensors(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._settled().map_tensors(fn)

    def _apply_rows(self) -> None:
        if self._rows is not None:
            rows, self._rows = self._rows, None
            self.inner.batch_select_indices(rows)

    def __getattr__(self, name: str):
        # only called for names not found on the wrapper: the inner layer's own attributes and methods
        if name.startswith("__") or name in ("inner", "offloader", "state", "_rows", "_ready", "_evicted"):
            raise AttributeError(name)
        return getattr(self._settled(), name)

    def __deepcopy__(self, memo) -> "OffloadedLayer":
        self.offloader.synchronize()
        return _copy_attributes(self, memo)

    def __repr__(self) -> str:
        return f"OffloadedLayer({type(self.inner).__name__}, {self.state})"


class _OffloadingFactory:
    """Layer factory of a lazily grown offloaded cache: builds the plain layer, then wraps it."""

    def __init__(self, factory, offloader: Offloader, only_non_sliding: bool):
        self.factory, self.offloader, self.only_non_sliding = factory, offloader, only_non_sliding

    def __call__(self, layer_idx: int) -> CacheLayer:
        return _wrap(self.factory(layer_idx), self.offloader, self.only_non_sliding)


def _wrap(layer: CacheLayer, offloader: Offloader, only_non_sliding: bool) -> CacheLayer:
    if isinstance(layer, OffloadedLayer) or (only_non_sliding and layer.sliding_window is not None):
        return layer
    return OffloadedLayer(layer, offloader)


@register_operation("enable_offloading")
def enable_offloading(cache: Cache, offload_device="cpu", *, only_non_sliding: bool = False,
                      compute_device=None, placement: Placement | None = None) -> Cache:
    """Offload the layers of ``cache`` (any kind) to ``offload_device``; returns ``cache``.

    Layers created later (caches that grow their layer list) are offloaded too; calling it
    again wraps layers added since. ``only_non_sliding`` leaves sliding-window layers
    (short anyway) on the compute device. ``compute_device`` defaults to the device of the
    first keys; ``placement`` replaces the device logic altogether (tests use a fake).

    Example:
        >>> from kvgen import HybridCache, enable_offloading
        >>> cache = enable_offloading(HybridCache(config=model.config, max_cache_len=4096))  # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=20)           # doctest: +SKIP
    """
    offloader = getattr(cache, "offloader", None)
    if offloader is None:
        offloader = Offloader(placement if placement is not None else Placement(compute_device, offload_device))
        cache.offloader = offloader
        cache.offload_only_non_sliding = only_non_sliding
    elif placement is not None and placement is not offloader.placement:
        raise ValueError("this cache is offloaded already, with another placement; build a new cache to change it")
    only_non_sliding = cache.offload_only_non_sliding
    cache.layers[:] = [_wrap(layer, offloader, only_non_sliding) for layer in cache.layers]
    factory = cache._layer_factory
    if factory is not None and not isinstance(factory, _OffloadingFactory):
        cache._layer_factory = _OffloadingFactory(factory, offloader, only_non_sliding)
    return cache


class OffloadedCache(DynamicCache):
    """A :class:`DynamicCache` whose layers wait on the CPU while other layers compute.

    Same as ``DynamicCache(config=..., offloading=True)`` (the transformers 5 spelling);
    the output is identical to the dynamic cache's, with the GPU holding only about two
    layers of keys and values. Works without a GPU too (then nothing moves).

    Example:
        >>> from kvgen import OffloadedCache
        >>> cache = OffloadedCache()                                             # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=20)  # doctest: +SKIP
        >>> out = model.generate(**inputs, max_new_tokens=20, cache_implementation="offloaded")  # doctest: +SKIP
    """

    def __init__(self, config=None, offload_device="cpu", offload_only_non_sliding: bool = False,
                 **unused_for_compatibility):
        super().__init__(config=config)
        enable_offloading(self, offload_device, only_non_sliding=offload_only_non_sliding)

    @classmethod
    def from_legacy_cache(cls, past_key_values: LegacyCache | None) -> "OffloadedCache":
        return enable_offloading(super().from_legacy_cache(past_key_values))


class OffloadedStaticCache(StaticCache):
    """A :class:`StaticCache` preallocated on the offload device, one layer at a time on ``device``.

    Same as ``StaticCache(..., offloading=True)``. Buffers of ``max_cache_len`` slots per
    layer live in (pinned) host memory; the layer being computed and the next one are on
    ``device``.

    Example:
        >>> cache = OffloadedStaticCache(config=model.config, max_batch_size=1, max_cache_len=1024,
        ...                              device="cuda", dtype=torch.float16)      # doctest: +SKIP
        >>> out = model.generate(**inputs, past_key_values=cache, max_new_tokens=20)  # doctest: +SKIP
        >>> out = model.generate(**inputs, max_new_tokens=20, cache_implementation="offloaded_static")  # doctest: +SKIP
    """

    def __init__(self, config=None, max_batch_size: int | None = None, max_cache_len: int | None = None,
                 device=None, dtype=None, offload_device="cpu", layer_device_map=None,
                 **unused_for_compatibility):
        if layer_device_map is not None and len({str(d) for d in layer_device_map.values()}) > 1:
            raise ValueError("OffloadedStaticCache computes every layer on one device; layer_device_map must name one")
        super().__init__(config=config, max_batch_size=max_batch_size, max_cache_len=max_cache_len, device=device,
                         dtype=dtype, offloading=True, offload_device=offload_device,
                         offload_only_non_sliding=False, **unused_for_compatibility)


@register_cache("offloaded")
def _offloaded(config, batch_size, max_cache_len, device, dtype, cache_config):
    cache = OffloadedCache(config=config)
    if device is not None:
        cache.offloader.placement.bind(device)
    return cache


@register_cache("offloaded_static")
def _offloaded_static(config, batch_size, max_cache_len, device, dtype, cache_config):
    return OffloadedStaticCache(config=config, max_batch_size=batch_size, max_cache_len=max_cache_len, device=device,
                                dtype=dtype)


# what cache files keep of these (kvgen.cache.codec): a decoded offloaded cache has every layer on its offload device
for _helper in (Offloader, Placement, _OffloadingFactory):
    register_persistable(_helper)
register_policy(Placement, reset={"_streams": {}, "compute_device": None})  # bound again by the first keys
register_policy(Offloader, reset={"active": None, "_on_compute": []}, before_save=Offloader.synchronize)
register_policy(OffloadedLayer, reset={"state": OFFLOADED, "_ready": None, "_evicted": None, "_rows": None},
                inner_device=lambda layer: layer.offloader.placement.offload_device)
