"""``cache_implementation`` names -> cache factories.

Every cache module registers its names here with :func:`register_cache`; ``generate()``
builds caches with :func:`create_cache`. A factory takes
``(config, batch_size, max_cache_len, device, dtype, cache_config)``.
"""

from __future__ import annotations

from typing import Any, Callable

CacheFactory = Callable[..., Any]
_FACTORIES: dict[str, CacheFactory] = {}


def register_cache(name: str) -> Callable[[CacheFactory], CacheFactory]:
    def decorator(factory: CacheFactory) -> CacheFactory:
        if name in _FACTORIES:
            raise ValueError(f"cache_implementation {name!r} is registered twice")
        _FACTORIES[name] = factory
        return factory

    return decorator


def cache_implementations() -> list[str]:
    return sorted(_FACTORIES)


def create_cache(name: str, *, config, batch_size: int, max_cache_len: int, device, dtype,
                 cache_config: Any = None):
    """Build the cache registered as ``name`` for a model with ``config``."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(
            f"unknown cache_implementation {name!r}; valid names are: {', '.join(cache_implementations())}"
        ) from None
    return factory(config, batch_size, max_cache_len, device, dtype, cache_config)
