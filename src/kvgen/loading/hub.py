"""Resolve a model reference (local folder, local file or hub id) to a local folder.

A hub id such as ``HuggingFaceTB/SmolLM2-135M-Instruct`` is looked up in the local
Hugging Face cache (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``).
When it is not there, ``huggingface_hub`` (optional) is asked to download it; when that
is missing or the network is unreachable, the error says so and what to do.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*/[\w.\-]+$")


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _cached_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    repo_dir = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    snapshots = repo_dir / "snapshots"
    if not snapshots.is_dir():
        return None
    ref = repo_dir / "refs" / revision
    if ref.is_file():
        candidate = snapshots / ref.read_text().strip()
        if candidate.is_dir():
            return candidate
    if (snapshots / revision).is_dir():  # revision given as a commit hash
        return snapshots / revision
    found = sorted(p for p in snapshots.iterdir() if p.is_dir())
    return found[-1] if found else None


def resolve_model_dir(reference: str | os.PathLike, revision: str = "main") -> Path:
    """Return a local folder for ``reference``: a folder, a hub id in the local cache, or a download."""
    path = Path(reference).expanduser()
    if path.is_dir():
        return path
    if path.is_file():
        return path.parent
    text = str(reference)
    if not _HUB_ID.match(text):
        raise FileNotFoundError(
            f"model path {text!r} does not exist and is not a hub id of the form 'org/name'; "
            "pass a folder with config.json and *.safetensors, or a .gguf file."
        )
    snapshot = _cached_snapshot(text, revision)
    if snapshot is not None:
        return snapshot
    return _download(text, revision)


def _download(repo_id: str, revision: str) -> Path:
    where = hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise FileNotFoundError(
            f"{repo_id!r} is not in the local Hugging Face cache ({where}) and huggingface_hub is not "
            "installed to download it. Install it with `pip install 'kvgen[hub]'`, or download the model "
            "on a connected machine and pass its local folder."
        ) from None
    try:
        return Path(snapshot_download(repo_id, revision=revision,
                                      allow_patterns=["*.json", "*.jinja", "*.safetensors", "*.model", "*.txt", "*.gguf"]))
    except Exception as e:  # huggingface_hub raises many connection error types
        raise OSError(
            f"{repo_id!r} is not in the local Hugging Face cache ({where}) and downloading it failed "
            f"({type(e).__name__}: {e}). The hub is unreachable from this machine: download the model "
            f"where the network is available (`hf download {repo_id}`), copy the cache folder here, or "
            "pass a local folder or .gguf file instead."
        ) from None
