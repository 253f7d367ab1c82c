"""Which input rows of a forward pass feed a prompt's tokens: their products may trade exactness for speed.

A prompt is prefilled once, bound by arithmetic; a generated token's row is decoded, bound by memory. So the
stored-precision products of a prompt's rows may take cheaper inputs (:func:`~kvgen.kernels.prefill_inputs`: logits
within 1e-2 of the dequantized float32 run) where every other row keeps the decode contract (1e-3). A row's numerics
depend only on its kind and values, never on how its prompt was split into chunks or on what else shares its
forward pass, so that the serving engine gives ``generate()``'s tokens. ``generate()`` marks its prefills, the
engine its steps' prompt rows; any other forward pass (one called directly, a decode step) is exact.

A mark holds for the products of as many rows as it names (the layers' products); products of other row counts (the
output head's, of the kept rows only) are exact.

Example:
    >>> import torch
    >>> with prompt_rows(12):
    ...     rows_kind(12), rows_kind(1)
    (True, False)
    >>> with prompt_rows(torch.tensor([True, True, False])):
    ...     rows_kind(3)
    tensor([ True,  True, False])
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar

import torch

_MARK: ContextVar[int | torch.Tensor | None] = ContextVar("kvgen_prompt_rows", default=None)


@contextmanager
def prompt_rows(rows: int | torch.Tensor):
    """Marks the rows of the forward passes inside: ``rows`` (an int) of them all feed a prompt's tokens, or the bool
    mask ``rows`` (T,) says which do (True) and which feed generated tokens (False)."""
    if isinstance(rows, torch.Tensor):
        if rows.dtype != torch.bool or rows.dim() != 1:
            raise ValueError(f"prompt_rows takes a row count or a 1-d bool mask, not a {rows.dtype} tensor of shape "
                             f"{tuple(rows.shape)}")
        rows = len(rows) if bool(rows.all()) else rows.cpu() if bool(rows.any()) else None
    token = _MARK.set(rows)
    try:
        yield
    finally:
        _MARK.reset(token)


def rows_kind(rows: int) -> bool | torch.Tensor:
    """For a product of ``rows`` input rows: True where they all feed a prompt's tokens, a bool mask (rows,) where
    some do, False where none does or nothing marked them (and while compiling: compiled graphs run decode steps)."""
    if torch.compiler.is_compiling():  # (first: the context variable is not traced)
        return False
    mark = _MARK.get()
    if mark is None:
        return False
    if isinstance(mark, int):
        return mark == rows
    return mark if len(mark) == rows else False
