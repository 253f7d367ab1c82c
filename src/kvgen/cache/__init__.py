"""Cache classes; importing this package registers every ``cache_implementation``."""

from kvgen.cache.base import Cache, CacheLayer
from kvgen.cache.dynamic import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer
from kvgen.cache.registry import cache_implementations, create_cache, register_cache
from kvgen.cache.static import StaticCache, StaticLayer

__all__ = [
    "Cache", "CacheLayer", "DynamicCache", "DynamicLayer", "DynamicSlidingWindowLayer", "StaticCache",
    "StaticLayer", "cache_implementations", "create_cache", "register_cache",
]
