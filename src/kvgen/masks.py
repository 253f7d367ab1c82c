"""Every attention mask, built from positions in one place.

A query at cache position ``q`` may attend to a slot holding position ``k`` when
``0 <= k <= q`` (causal, slot filled), ``k > q - window`` (sliding window), and the
padding mask says position ``k`` is a real token. Caches report which position each
slot holds, so ring buffers, sinks and preallocated buffers all get correct masks
from the same rule.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask


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


Q_BLOCK = 16  # query rows per row block of a block-sparse mask: flex_attention's smallest tile
#: whether this torch builds block masks from given key blocks alone (``compute_q_blocks``: torch 2.9 on)
BLOCK_MASKS = "compute_q_blocks" in inspect.signature(BlockMask.from_kv_blocks).parameters


def paged_block_mask(row_seq: torch.Tensor, row_pos: torch.Tensor, tables: torch.Tensor, block_size: int,
                     num_slots: int, sliding_window: int | None = None) -> BlockMask:
    """flex_attention's ``BlockMask`` of a ragged batch over a paged pool of ``num_slots`` slots: query row ``i``
    (sequence ``row_seq[i]`` at position ``row_pos[i]``) may read the slots of its sequence's blocks
    (``tables[row_seq[i]]``, (sequences, W) block ids in position order, -1 for none) that hold positions up to its
    own, and past ``row_pos[i] - sliding_window``. Each block of ``Q_BLOCK`` rows lists the distinct pool blocks
    any of its rows may read, so that attention reads those only; the mask function keeps each row to its own.

    Tensor ops only, no host synchronisation: a CUDA graph can hold it. A block shared by several sequences (a
    cached prefix) holds the same positions in each, so one logical index per block serves them all.

    Example:
        >>> mask = paged_block_mask(torch.tensor([0, 1]), torch.tensor([20, 3]),
        ...                         torch.tensor([[2, 0], [1, -1]]), block_size=16, num_slots=64)
        >>> mask.kv_num_blocks.tolist()  # the one row block reads pool blocks 0, 1 and 2
        [[[3]]]
    """
    device, width = tables.device, tables.shape[1]
    num_blocks = num_slots // block_size
    logical = torch.arange(width, device=device).expand_as(tables)  # (S, W)
    block_logical = torch.full((num_blocks + 1,), -1, dtype=torch.long, device=device)  # (+1: where -1s go)
    block_logical.scatter_(0, torch.where(tables >= 0, tables, num_blocks).flatten(), logical.flatten())

    first = torch.arange(width, device=device) * block_size  # (W,) first position of each logical block
    rows = tables[row_seq]  # (T, W) the blocks of each row's sequence
    visible = (rows >= 0) & (first <= row_pos[:, None])
    if sliding_window is not None:
        visible &= first + block_size - 1 > row_pos[:, None] - sliding_window
    count = row_seq.shape[0]
    groups = -(-count // Q_BLOCK)
    rows = torch.where(visible, rows, -1)
    rows = F.pad(rows, (0, 0, 0, groups * Q_BLOCK - count), value=-1).view(groups, Q_BLOCK * width)  # (G, 16 W)
    rows = rows.sort(dim=1).values
    repeated = torch.cat([torch.zeros_like(rows[:, :1], dtype=torch.bool), rows[:, 1:] == rows[:, :-1]], dim=1)
    rows = rows.masked_fill(repeated, -1).sort(dim=1, descending=True).values  # distinct blocks first, -1s last
    kv_num_blocks = (rows >= 0).sum(dim=1, dtype=torch.int32)  # (G,)

    def mask_mod(b, h, q, kv):
        block = kv // block_size
        j = block_logical[block]  # the logical index the block holds
        position = j * block_size + kv % block_size
        allowed = (j >= 0) & (tables[row_seq[q], j.clamp(min=0)] == block) & (position <= row_pos[q])
        if sliding_window is not None:
            allowed = allowed & (position > row_pos[q] - sliding_window)
        return allowed

    return BlockMask.from_kv_blocks(kv_num_blocks[None, None], rows.clamp(min=0).to(torch.int32)[None, None],
                                    BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
                                    seq_lengths=(count, num_slots), compute_q_blocks=False)
