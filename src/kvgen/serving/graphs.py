"""Decode steps as CUDA graphs, one per padded batch size, as vLLM and nano-vllm run them.

A decode step feeds one token per running sequence. Its inputs live in preallocated device buffers (token ids,
positions, each layer kind's slot mapping and block tables) that every step overwrites in place; the kernels of
the model's forward pass over them (flex_attention over the pool's blocks included: a block-sparse
:class:`~kvgen.cache.paged.PagedAttentionCache`) were captured once per batch size (1, 2, 4, 8, then multiples of
16 up to ``max_num_seqs``) and are replayed with no Python in between. The rows past a step's sequences feed
token 0 at position 0 into the pool's spare block and read only that slot. Without a GPU (``capture=False``) the
same buffers run eagerly: the eager twin that the CPU tests compare with the runner's own steps.

Example:
    >>> graphs = DecodeGraphs(model, cache, max_num_seqs=64, max_blocks=128)           # doctest: +SKIP
    >>> logits = graphs.run([1234], torch.tensor([17]), {"full_attention": torch.tensor([[3, 9]])},
    ...                     {"full_attention": torch.tensor([145])})                          # doctest: +SKIP
"""

from __future__ import annotations

import torch

from kvgen.cache.paged import BlockRows, PagedAttentionCache
from kvgen.models.decode_blocks import eager_blocks


def batch_sizes(max_num_seqs: int) -> list[int]:
    """The padded batch sizes captured: 1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs`` (rounded up).

    Example:
        >>> batch_sizes(40)
        [1, 2, 4, 8, 16, 32, 48]
    """
    small = [n for n in (1, 2, 4, 8) if n < max_num_seqs]
    if max_num_seqs <= 8:
        return small + [next(n for n in (1, 2, 4, 8) if n >= max_num_seqs)]
    return small + list(range(16, max_num_seqs + 15, 16))


class DecodeGraphs:
    """Decode steps over static buffers, replayed from CUDA graphs (``capture=True``, a CUDA model) or run eagerly.

    ``max_blocks``: the widest block table a step may carry (longer sequences take the runner's eager path).
    """

    def __init__(self, model, cache: PagedAttentionCache, max_num_seqs: int, max_blocks: int, capture: bool = True):
        if not cache.block_sparse:
            raise ValueError("decode graphs read the pool block by block: make the cache with block_sparse=True")
        self.model, self.cache, self.max_blocks = model, cache, max_blocks
        self.sizes = batch_sizes(max_num_seqs)
        n, device, size = self.sizes[-1], model.device, cache.block_size
        self.ids = torch.zeros(n, dtype=torch.long, device=device)  # (N,)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)  # (N,)
        self.row_seq = torch.arange(n, device=device)  # (N,) each row its own sequence
        self.slots = {kind: torch.full((n,), cache.spare_slot, device=device) for kind in cache.kinds}  # (N,) each
        self.idle = torch.full((max_blocks,), -1, dtype=torch.long, device=device)  # a padded row's table:
        self.idle[0] = cache.spare_slot // size  # the spare block alone
        self.tables = {kind: self.idle.repeat(n, 1) for kind in cache.kinds}  # (N, max_blocks) each
        self.out = torch.empty(n, model.config.vocab_size, dtype=model.dtype, device=device)  # (N, V)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture()

    def run(self, ids: list[int], positions: torch.Tensor, tables: dict[str, torch.Tensor],
            slots: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The logits (n, V) of one token per sequence: ``ids`` (n), their ``positions`` (n,), and per layer kind
        the sequences' block tables (n, W) and the tokens' slots (n,), as the runner lays them out; None where they
        do not fit (more rows than the largest size, or a wider table): then the caller runs the step itself."""
        n = len(ids)
        size = next((s for s in self.sizes if s >= n), None)
        if size is None or any(t.shape[1] > self.max_blocks for t in tables.values()):
            return None
        self.ids[:n].copy_(torch.tensor(ids))
        self.positions[:n].copy_(positions)
        self.ids[n:size], self.positions[n:size] = 0, 0  # padded rows: token 0 at position 0 ...
        for kind in self.cache.kinds:
            buffer, width = self.tables[kind], tables[kind].shape[1]
            buffer[:n, :width].copy_(tables[kind])
            buffer[:n, width:] = -1
            buffer[n:size].copy_(self.idle)  # ... reading the spare block alone,
            self.slots[kind][:n].copy_(slots[kind])
            self.slots[kind][n:size] = self.cache.spare_slot  # and writing its first slot
        if size in self.graphs:
            self.graphs[size].replay()
            return self.out[:n]
        return self._forward(size)[:n]

    @torch.no_grad()
    def _forward(self, size: int) -> torch.Tensor:
        """The step over the first ``size`` rows of the buffers; its logits written into ``out[:size]``."""
        self.cache.begin_step({kind: (self.slots[kind][:size], BlockRows(self.row_seq[:size], self.positions[:size],
                                                                        self.tables[kind][:size]))
                               for kind in self.cache.kinds})
        positions = self.positions[:size]
        with eager_blocks():
            logits = self.model(self.ids[:size][None], position_ids=positions[None], cache_position=positions,
                                past_key_values=self.cache, use_cache=True).logits[0]  # (size, V)
        self.out[:size].copy_(logits)
        return self.out[:size]

    def _capture(self) -> None:
        """One graph per size, the largest first, all in one memory pool; each size runs once eagerly before its
        capture (flex_attention compiles there)."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            pool = pool or graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
