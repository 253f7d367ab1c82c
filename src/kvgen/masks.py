"""Every attention mask, built from positions in one place.

A query at cache position ``q`` may attend to a slot holding position ``k`` when
``0 <= k <= q`` (causal, slot filled), ``k > q - window`` (sliding window), and the
padding mask says position ``k`` is a real token. Caches report which position each
slot holds, so ring buffers, sinks and preallocated buffers all get correct masks
from the same rule.
"""

from __future__ import annotations

import torch


def attention_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                   padding_mask: torch.Tensor | None = None, sliding_window: int | None = None,
                   static: bool = False) -> tuple[torch.Tensor | None, bool]:
    """Boolean mask (B or 1, 1, Q, K) for SDPA, True where attention is allowed.

    Args:
        query_positions: (Q,) cache positions of the queries.
        key_positions: (K,) cache position held by each key slot, -1 for an empty slot; or (Q, K)
            when each query row has slots of its own (a ragged batch over a paged cache: -1 where
            a slot is not the row's sequence).
        padding_mask: (B, L) with 1 for real tokens and 0 for padding, indexed by cache
            position; ``L`` must cover every position in ``key_positions``.
        sliding_window: a query sees at most this many positions, itself included.
        static: always return a tensor, with no data-dependent shortcut (for torch.compile).

    Returns:
        ``(mask, is_causal)``: ``(None, False)`` when every query may see every key,
        ``(None, True)`` when the plain causal mask of SDPA is exact, else ``(mask, False)``.
    """
    q = query_positions.view(-1, 1)  # (Q, 1)
    k = key_positions if key_positions.dim() == 2 else key_positions.view(1, -1)  # (Q or 1, K)
    allowed = (k >= 0) & (k <= q)  # (Q, K)
    if sliding_window is not None:
        allowed &= k > q - sliding_window
    has_padding = padding_mask is not None and (static or not bool(padding_mask.all()))
    if not static and not has_padding:
        if bool(allowed.all()):
            return None, False
        n = key_positions.shape[-1]
        if (key_positions.dim() == 1 and query_positions.shape[0] == n and sliding_window is None
                and torch.equal(query_positions, key_positions)):
            return None, True
    mask = allowed[None, None]  # (1, 1, Q, K)
    if has_padding:
        # Slots past the mask's end hold future positions, which the causal rule already hides.
        if key_positions.dim() == 2:
            raise ValueError("a padding mask cannot be combined with per-row key positions (ragged batches have "
                             "no padding)")
        real = padding_mask.bool()[:, key_positions.clamp(0, padding_mask.shape[1] - 1)]  # (B, K)
        mask = mask & real[:, None, None, :]
    # A query that may see nothing (a padding token before any real one) attends to itself,
    # which keeps SDPA free of NaN; its output is never used.
    return mask | (k == q)[None, None], False


def range_attention_mask(query_position: int, key_positions: range, sliding_window: int | None = None,
                         device: torch.device | None = None) -> tuple[torch.Tensor | None, bool]:
    """:func:`attention_mask` of one query without padding over slots holding the consecutive positions
    ``key_positions`` (``start >= 0``), worked out from integers: ``(None, False)`` where every key is visible, else
    one fill of the visible slots (a decode step's mask from tensors took seven small ops, ~0.1-0.2 ms)."""
    first = key_positions.start
    if sliding_window is not None:
        first = max(first, query_position - sliding_window + 1)
    last = min(key_positions.stop - 1, query_position)  # the visible positions: first .. last
    if first == key_positions.start and last == key_positions.stop - 1:
        return None, False
    mask = torch.zeros(1, 1, 1, len(key_positions), dtype=torch.bool, device=device)  # (1, 1, 1, K)
    if first <= last:
        mask[..., first - key_positions.start: last - key_positions.start + 1] = True
    return mask, False


def check_padding_mask(padding_mask: torch.Tensor, needed: int) -> None:
    """Raise when a 2-D attention mask does not cover the positions the cache holds."""
    if padding_mask.dim() != 2:
        raise ValueError(
            f"attention_mask must be 2-D (batch, past + new tokens); got shape {tuple(padding_mask.shape)}"
        )
    if padding_mask.shape[1] < needed:
        raise ValueError(
            f"attention_mask covers {padding_mask.shape[1]} positions but the cache and the new tokens span "
            f"{needed}: its shape must be (batch, past_kv_length + new_tokens_length) = "
            f"({padding_mask.shape[0]}, {needed}). Append a column of ones for every token fed so far."
        )
