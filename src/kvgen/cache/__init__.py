"""Cache classes; importing this package imports every cache module, so that each registers what it adds:
its ``cache_implementation`` names, its operations over caches (fork, save, offloading), its layer kinds
and what cache files keep of its classes."""

from kvgen.cache.base import Cache, CacheLayer
from kvgen.cache.codec import register_persistable
from kvgen.cache.dynamic import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from kvgen.cache.encoder_decoder import EncoderDecoderCache
from kvgen.cache.fingerprint import CacheModelMismatchError, model_fingerprint
from kvgen.cache.fork import fork_cache, share_rows
from kvgen.cache.offload import (OffloadedCache, OffloadedLayer, OffloadedStaticCache, Placement, enable_offloading,
                                 infer_device)
from kvgen.cache.persist import CacheFileError, load_cache, save_cache
from kvgen.cache.quantized import (HQQQuantizedCache, QuantizedCache, QuantizedCacheConfig, QuantizedLayer,
                                   QuantoQuantizedCache)
from kvgen.cache.paged import PagedAttentionCache
from kvgen.cache.registry import cache_implementations, create_cache, register_cache
from kvgen.cache.sink import SinkCache, SinkLayer, StaticSinkCache, StaticSinkLayer
from kvgen.cache.ssm import HybridMambaAttentionDynamicCache, MambaCache, SSMLayer
from kvgen.cache.static import StaticCache, StaticLayer
from kvgen.cache.window import HybridCache, SlidingWindowCache, SlidingWindowLayer

__all__ = [
    "Cache", "CacheLayer", "DynamicCache", "DynamicLayer", "DynamicSlidingWindowLayer", "EncoderDecoderCache",
    "StaticCache", "StaticLayer", "cache_implementations", "create_cache", "register_cache",
    "HybridCache", "SlidingWindowCache", "SlidingWindowLayer",
    "HybridMambaAttentionDynamicCache", "MambaCache", "SSMLayer",
    "SinkCache", "SinkLayer", "StaticSinkCache", "StaticSinkLayer",
    "HQQQuantizedCache", "QuantizedCache", "QuantizedCacheConfig", "QuantizedLayer", "QuantoQuantizedCache",
    "OffloadedCache", "OffloadedLayer", "OffloadedStaticCache", "Placement", "enable_offloading", "infer_device",
    "CacheFileError", "CacheModelMismatchError", "load_cache", "model_fingerprint", "register_persistable", "save_cache",
    "PagedAttentionCache", "fork_cache", "share_rows",
]
