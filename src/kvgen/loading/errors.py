"""The error of a model file that cannot be trusted: damaged, truncated or inconsistent."""

from __future__ import annotations

import os


class ModelFileError(ValueError):
    """A model file (GGUF, safetensors + ``config.json``, CTranslate2) that kvgen refuses to run.

    The message names the file, the tensor or key, what was expected and what was found.

    Example:
        >>> raise ModelFileError("model.gguf", "tensor blk.0.attn_q.weight", "offset a multiple of 32", "offset 7")
        Traceback (most recent call last):
        kvgen.loading.errors.ModelFileError: model.gguf: tensor blk.0.attn_q.weight: expected offset a multiple of 32, found offset 7
    """

    def __init__(self, path: str | os.PathLike, where: str, expected: str, found: str):
        self.path, self.where, self.expected, self.found = str(path), where, expected, found
        super().__init__(f"{path}: {where}: expected {expected}, found {found}")
