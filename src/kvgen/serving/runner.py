"""One forward pass over a ragged batch, and the choice of each sequence's next token.

The scheduled tokens of all sequences are laid side by side as one row (batch 1, no
padding). For each query row the runner tells the paged cache which position every pool
slot holds for that row's sequence, so that :mod:`kvgen.masks` builds the mask from
positions as for any cache. Logits are computed only for the last row of each sequence
whose known tokens are all in the cache after this pass; those sequences get a new token.

Example:
    >>> runner = ModelRunner(model, cache)                  # doctest: +SKIP
    >>> runner.step([(seq_a, 1), (seq_b, 256)])             # doctest: +SKIP
    [(seq_a, 1234, -0.71, {})]
"""

from __future__ import annotations

import torch

from kvgen.cache.paged import PagedAttentionCache
from kvgen.generation.logits import temperature, top_k, top_p
from kvgen.models.decode_blocks import eager_blocks
from kvgen.serving.scheduler import SamplingParams, Sequence


class ModelRunner:
    """Runs ``model`` on batches of :class:`Sequence` chunks over a :class:`PagedAttentionCache`."""

    def __init__(self, model, cache: PagedAttentionCache):
        self.model, self.cache = model, cache
        self.device = model.device

    @torch.no_grad()
    def step(self, batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, float, dict[int, float]]]:
        """Feed ``n`` tokens of each ``(sequence, n)``; return ``(sequence, token, logprob, top_logprobs)`` for
        every sequence that gets a new token."""
        size, device = self.cache.block_size, self.device
        ids, positions, row_seq, keep, sampled = [], [], [], [], []
        for i, (seq, n) in enumerate(batch):
            start, end = seq.num_computed, seq.num_computed + n
            ids += seq.tokens[start:end]
            positions.append(torch.arange(start, end))
            row_seq += [i] * n
            if end == len(seq.tokens):
                keep.append(len(ids) - 1)
                sampled.append(seq)
        row_seq_t = torch.tensor(row_seq)
        steps = {}
        for kind in self.cache.kinds:
            used = size * (1 + max(b for seq, _ in batch for b in seq.tables[kind]))
            key_positions = torch.full((len(batch), used), -1, dtype=torch.long)  # (sequences, used slots)
            slots = []
            for i, (seq, n) in enumerate(batch):
                end = seq.num_computed + n
                table = torch.tensor(seq.tables[kind], dtype=torch.long)
                seq_slots = (table[:, None] * size + torch.arange(size)).flatten()[:end]  # slot of each position
                live = table.repeat_interleave(size)[:end] >= 0  # blocks that slid out of the window are gone
                key_positions[i, seq_slots[live]] = torch.arange(end)[live]
                slots.append(seq_slots[seq.num_computed:end])
            steps[kind] = (torch.cat(slots).to(device), key_positions[row_seq_t].to(device))  # (T,), (T, used)
        self.cache.begin_step(steps)
        positions_t = torch.cat(positions).to(device)
        with eager_blocks():  # compiled blocks would compile a graph per batch size: seconds each
            logits = self.model(torch.tensor([ids], device=device), position_ids=positions_t[None],
                                cache_position=positions_t, past_key_values=self.cache, use_cache=True,
                                logits_to_keep=torch.tensor(keep, dtype=torch.long, device=device)).logits[0]  # (kept, V)
        return [(seq, *choose(seq, logits[j].float())) for j, seq in enumerate(sampled)]


def choose(seq: Sequence, raw: torch.Tensor) -> tuple[int, float, dict[int, float]]:
    """Next token of ``seq`` from its raw logits (V,), with its log-probability under the model and the
    ``top_logprobs`` most likely alternatives."""
    params: SamplingParams = seq.params
    scores = raw[None]  # (1, V)
    if params.do_sample:
        for processor in _warpers(params):
            scores = processor(None, scores)
        if seq.generator is None:
            seq.generator = torch.Generator(device=raw.device)
            if params.seed is None:
                seq.generator.seed()
            else:
                seq.generator.manual_seed(params.seed)
        token = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=seq.generator))
    else:
        token = int(torch.argmax(scores, dim=-1))
    logprobs = torch.log_softmax(raw, dim=-1)
    top = {}
    if params.top_logprobs:
        values, indices = logprobs.topk(params.top_logprobs)
        top = dict(zip(indices.tolist(), values.tolist()))
    return token, float(logprobs[token]), top


def _warpers(params: SamplingParams):
    """The sampling warpers of ``params``, in transformers' order."""
    if params.temperature != 1.0:
        yield temperature(params.temperature)
    if params.top_k:
        yield top_k(params.top_k)
    if params.top_p < 1.0:
        yield top_p(params.top_p)
