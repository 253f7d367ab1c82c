"""A paged KV cache: one pool of fixed-size blocks per attention layer, shared by many sequences.

Each layer's keys and values live in one preallocated tensor ``(1, kv_heads, num_blocks *
block_size, head_dim)`` each (wider for int8 rows, which carry their scales: :mod:`kvgen.cache.precision`);
a sequence's tokens sit in the slots of the blocks its block table
lists (bookkeeping in :mod:`kvgen.serving.blocks`). A forward pass takes a *ragged* batch,
flattened to batch 1: the new tokens of several sequences side by side, with no padding.
Before the pass the runner says where each new token goes (``slot_mapping``) and which
position every pool slot holds *for each query row* (``key_positions``, -1 where the slot is
not the row's sequence). To the model this is one more cache behind the two calls of the
seam: ``update()`` writes the new keys/values in place and returns the pool in use, and
``key_positions()`` gives :mod:`kvgen.masks` what it needs to build the mask (own sequence,
causal, sliding window) from positions, as for every other cache.

Example:
    >>> cache = PagedAttentionCache(model.config, num_blocks=64)            # doctest: +SKIP
    >>> cache.begin_step({"full_attention": (slot_mapping, key_positions)})  # doctest: +SKIP
    >>> logits = model(ids, position_ids=pos[None], cache_position=pos,
    ...                past_key_values=cache).logits                         # doctest: +SKIP
"""

from __future__ import annotations

import math
import mmap
import os
import re
from typing import NamedTuple

import torch

from kvgen.cache.base import Cache, CacheLayer, config_value, text_config
from kvgen.cache.precision import kv_dtype, store, stored_dim
from kvgen.masks import BLOCK_MASKS, paged_block_mask

_UNITS = {"": 1, "b": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30}


def parse_memory(size: int | float | str) -> int | float:
    """``"512MB"``/``"2GiB"``/``1 << 30`` -> bytes (int); a fraction in (0, 1] (``0.5``, ``"0.5"``) stays a float:
    that share of the free memory.

    Example:
        >>> parse_memory("512MB"), parse_memory(0.5)
        (536870912, 0.5)
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(?:([kmg])i?b?|(b))?\s*", str(size).lower())
    if match and not isinstance(size, bool) and float(match[1]) > 0:
        value, unit = float(match[1]), match[2] or match[3] or ""
        return value if not unit and value <= 1 and "." in match[1] else int(value * _UNITS[unit])
    raise ValueError(f"cannot read the memory size {size!r}: write bytes or e.g. '512MB', '2GiB', or a fraction in "
                     "(0, 1] of the free memory such as 0.5")


def free_memory(device: torch.device) -> int:
    """Bytes free for new tensors on ``device`` (CUDA: the driver's figure; CPU: MemAvailable)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero pool. On the CPU, fresh anonymous memory: the system hands out zero pages as they are first
    touched, so a pool of gigabytes costs nothing until used (``torch.zeros`` wrote a 2 GiB pool in
    about 3 s). Never-written slots must read as zeros: attention weighs excluded keys by 0, and
    0 times a stray NaN would not be 0."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    count = math.prod(shape)
    if count == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(mmap.mmap(-1, count * dtype.itemsize), dtype=dtype).view(shape)


class BlockRows(NamedTuple):
    """What a block-sparse pass tells each layer kind instead of per-row key positions: the sequence (T,) and
    position (T,) of each query row, and each sequence's block table (sequences, W), -1 past its end and for
    blocks that left its window (:func:`kvgen.masks.paged_block_mask`)."""

    row_seq: torch.Tensor
    row_pos: torch.Tensor
    tables: torch.Tensor


class PagedLayer(CacheLayer):
    """One attention layer's block pool; the per-pass state lives in the owning cache."""

    def __init__(self, owner: "PagedAttentionCache", kind: str, keys: torch.Tensor, values: torch.Tensor):
        self.owner, self.kind, self.pool_keys, self.pool_values = owner, kind, keys, values  # (1, Hkv, slots, D) each

    def update(self, key, value, cache_position):
        """Write ``key``/``value`` (1, Hkv, T, D) at this pass's slots, in the pool's precision; return the pool's
        slots in use (as stored: :mod:`kvgen.cache.precision`)."""
        slots, positions = self.owner.steps[self.kind]
        store(self.pool_keys, slots, key)
        store(self.pool_values, slots, value)
        if self.owner.block_sparse:  # the whole pool: the block mask says which blocks each row reads
            return self.pool_keys, self.pool_values
        used = positions.shape[1]
        return self.pool_keys[:, :, :used], self.pool_values[:, :, :used]

    def reserve(self, key, value, first):
        """The pool's slots in use, the new tokens' among them where the step placed them (``begin_step``)."""
        step = self.owner.steps.get(self.kind)
        if step is None or self.owner.block_sparse or key.device != self.pool_keys.device or \
                torch.compiler.is_compiling():
            return None  # (update() says what is missing)
        slots, positions = step
        return self.pool_keys, self.pool_values, 0, positions.shape[1], slots

    def key_positions(self, cache_position):
        return self.owner.steps[self.kind][1]  # (T, used): per query row, as masks.attention_mask takes it

    def block_mask(self, sliding_window):
        if not self.owner.block_sparse:
            return None
        rows: BlockRows = self.owner.steps[self.kind][1]
        return paged_block_mask(rows.row_seq, rows.row_pos, rows.tables, self.owner.block_size,
                                self.pool_keys.shape[2], sliding_window)

    def get_seq_length(self) -> int:
        return 0  # many sequences: positions come from the runner, never from the cache

    def get_max_cache_shape(self) -> int | None:
        return self.pool_keys.shape[2]

    @property
    def keys(self):
        return self.pool_keys

    @property
    def values(self):
        return self.pool_values

    def reset(self) -> None:
        self.pool_keys.zero_()
        self.pool_values.zero_()

    def nbytes(self) -> int:
        return self.pool_keys.nbytes + self.pool_values.nbytes

    def map_tensors(self, fn) -> None:
        self.pool_keys, self.pool_values = fn(self.pool_keys), fn(self.pool_values)


class PagedAttentionCache(Cache):
    """Block pools of every attention layer, preallocated from a budget.

    Layers come in kinds (``"full_attention"``, ``"sliding_attention"``, from the config's
    ``layer_types``); each kind has its own block tables, so that blocks which fall out of a
    sliding window can go back to their pool while full layers keep theirs. Every kind has
    ``num_blocks`` blocks.

    Args:
        config: the model's config (layers, kv heads, head size).
        num_blocks: pool size in blocks; or give ``max_memory`` (bytes, ``"512MB"``, or a
            fraction in (0, 1] of the free memory) and the pool takes what fits.
        block_size: tokens per block (16).
        dtype: how keys and values are stored: float32, float16, bfloat16, or int8 rows with a scale per 32
            values (:mod:`kvgen.cache.precision`); a name or a dtype. Attention reads each as stored.
        block_sparse: attention reads only the blocks of each row's sequence, through flex_attention and a
            block mask built from the block tables (the GPU's way; ``begin_step`` then takes :class:`BlockRows`);
            else (the CPU's way) a mask over every slot in use, from per-row key positions. The pool then has one
            spare block past ``num_blocks``: the slot that padded rows of a fixed-size step write to
            (``spare_slot``).

    Example:
        >>> cache = PagedAttentionCache(config, max_memory="256MB", dtype=torch.float32)  # doctest: +SKIP
        >>> cache.num_blocks, cache.block_size                                           # doctest: +SKIP
        (2730, 16)
    """

    def __init__(self, config, num_blocks: int | None = None, block_size: int = 16,
                 max_memory: int | float | str | None = None, device=None, dtype=torch.float32,
                 block_sparse: bool = False):
        config = text_config(config)
        kinds = config_value(config, "layer_types") or ["full_attention"] * config_value(config, "num_hidden_layers")
        if any(kind not in ("full_attention", "sliding_attention") for kind in kinds):
            raise ValueError(f"PagedAttentionCache holds attention layers only; this model has {sorted(set(kinds))}")
        heads = config_value(config, "num_attention_heads")
        kv_heads = config_value(config, "num_key_value_heads") or heads
        head_dim = config_value(config, "head_dim") or config_value(config, "hidden_size") // heads
        device, dtype = torch.device(device or "cpu"), kv_dtype(dtype)
        self.block_size, self.dtype = block_size, dtype
        width = stored_dim(dtype, head_dim)  # stored elements of a position's head
        self.bytes_per_block = len(kinds) * 2 * kv_heads * block_size * width * dtype.itemsize
        if num_blocks is None:
            if max_memory is None:
                raise ValueError("PagedAttentionCache needs num_blocks or max_memory (bytes, '512MB' or a fraction)")
            budget = parse_memory(max_memory)
            if isinstance(budget, float):
                budget = int(budget * free_memory(device))
            num_blocks = budget // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(
                f"a KV cache budget of {max_memory!r} holds no block: one block of {block_size} tokens takes "
                f"{self.bytes_per_block} bytes for this model ({len(kinds)} layers x {kv_heads} kv heads x "
                f"{block_size} tokens x {width * dtype.itemsize} bytes x keys and values); raise the budget")
        if block_sparse and not BLOCK_MASKS:
            raise ValueError(f"block-sparse attention needs torch 2.9 or later (this is {torch.__version__}): "
                             "upgrade torch, or make the cache with block_sparse=False")
        self.num_blocks, self.block_sparse = num_blocks, block_sparse
        self.kinds = tuple(dict.fromkeys(kinds))
        self.spare_slot = num_blocks * block_size  # (block_sparse pools only)
        slots = (num_blocks + block_sparse) * block_size
        super().__init__(layers=[
            PagedLayer(self, kind, _zeros((1, kv_heads, slots, width), dtype, device),
                       _zeros((1, kv_heads, slots, width), dtype, device)) for kind in kinds])
        self.steps: dict[str, tuple[torch.Tensor, torch.Tensor | BlockRows]] = {}

    def begin_step(self, steps: dict[str, tuple[torch.Tensor, torch.Tensor | BlockRows]]) -> None:
        """Set the next pass, per layer kind: ``(slot_mapping, row_key_positions)``: the slot (T,) of each new
        token, and (T, used) the position each of the first ``used`` slots holds for each query row (-1: not
        its sequence, or out of its window); a ``block_sparse`` cache takes :class:`BlockRows` instead."""
        missing = set(self.kinds) - set(steps)
        if missing:
            raise ValueError(f"begin_step() needs slots and key positions for every layer kind; missing {missing}")
        self.steps = steps

    def check_cache_position(self, cache_position: torch.Tensor) -> None:
        placed = {slots.shape[0] for slots, _ in self.steps.values()}
        if placed != {cache_position.shape[0]}:
            raise ValueError(f"the pass feeds {cache_position.shape[0]} tokens but begin_step() placed "
                             f"{sorted(placed)}; call begin_step() before each forward pass")

    def record_token_ids(self, input_ids, cache_position) -> None:
        """Token ids are tracked per sequence by the scheduler, not here."""

    def mask_group(self, layer_idx: int) -> tuple:
        return (PagedLayer, self.layer(layer_idx).kind)
