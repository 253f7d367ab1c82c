"""Where kvgen keeps what it builds once per machine (kernels, GGUF indexes, converted models).

Example:
    >>> cache_dir().name  # doctest: +SKIP
    'kvgen'
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """kvgen's cache folder: ``$KVGEN_CACHE``, else ``$XDG_CACHE_HOME/kvgen``, else ``~/.cache/kvgen``."""
    if os.environ.get("KVGEN_CACHE"):
        return Path(os.environ["KVGEN_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kvgen"
    return Path.home() / ".cache" / "kvgen"
