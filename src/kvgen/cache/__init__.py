"""Cache classes; importing this package registers every ``cache_implementation``."""

from kvgen.cache.base import Cache, CacheLayer
from kvgen.cache.dynamic import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from kvgen.cache.offload import (OffloadedCache, OffloadedLayer, OffloadedStaticCache, Placement, enable_offloading,
                                 infer_device)
from kvgen.cache.quantized import (HQQQuantizedCache, QuantizedCache, QuantizedCacheConfig, QuantizedLayer,
                                   QuantoQuantizedCache)
from kvgen.cache.registry import cache_implementations, create_cache, register_cache
from kvgen.cache.sink import SinkCache, SinkLayer, StaticSinkCache, StaticSinkLayer
from kvgen.cache.static import StaticCache, StaticLayer
from kvgen.cache.window import HybridCache, SlidingWindowCache, SlidingWindowLayer

__all__ = [
    "Cache", "CacheLayer", "DynamicCache", "DynamicLayer", "DynamicSlidingWindowLayer", "StaticCache",
    "StaticLayer", "cache_implementations", "create_cache", "register_cache",
    "HybridCache", "SlidingWindowCache", "SlidingWindowLayer",
    "SinkCache", "SinkLayer", "StaticSinkCache", "StaticSinkLayer",
    "HQQQuantizedCache", "QuantizedCache", "QuantizedCacheConfig", "QuantizedLayer", "QuantoQuantizedCache",
    "OffloadedCache", "OffloadedLayer", "OffloadedStaticCache", "Placement", "enable_offloading", "infer_device",
]
