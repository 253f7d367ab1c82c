"""One forward pass over a ragged batch, and the choice of each sequence's next token.

The scheduled tokens of all sequences are laid side by side as one row (batch 1, no
padding). For each query row the runner tells the paged cache which position every pool
slot holds for that row's sequence, so that :mod:`kvgen.masks` builds the mask from
positions as for any cache; a block-sparse pool (a GPU's) is told each row's sequence,
position and block table instead (:class:`~kvgen.cache.paged.BlockRows`), and decode steps
go through :mod:`kvgen.serving.graphs` where the engine made them. Logits are computed only
for the last row of each sequence whose known tokens are all in the cache after this pass;
those sequences get a new token (:mod:`kvgen.serving.sampler`).

Example:
    >>> runner = ModelRunner(model, cache)                  # doctest: +SKIP
    >>> runner.step([(seq_a, 1), (seq_b, 256)])             # doctest: +SKIP
    [(seq_a, 1234, -0.71, {})]
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvgen.cache.paged import BlockRows, PagedAttentionCache
from kvgen.models.decode_blocks import eager_blocks
from kvgen.grammar import Grammars, Masks
from kvgen.kernels.prompt_rows import prompt_rows
from kvgen.serving.blocks import table_rows
from kvgen.serving.graphs import DecodeGraphs
from kvgen.serving.sampler import prompt_logprobs, sample
from kvgen.serving.scheduler import Sequence
from kvgen.tensor_parallel import broadcast_object


IDLE = "idle"  # what rank 0 sends the other ranks of a split model while it has nothing to run


class Plan(NamedTuple):
    """One forward pass over a ragged batch: the token ids side by side, each sequence's ``(start, end, tables,
    prompt)`` (its positions fed, its block table of each attention kind, its prompt's length: the rows before it
    feed a prompt's tokens, :mod:`kvgen.kernels.prompt_rows`) and the rows whose logits are kept. Plain data: rank 0
    sends it to the other ranks of a split model."""

    ids: list[int]
    spans: list[tuple[int, int, dict[str, list[int]], int]]
    keep: list[int]


class ModelRunner:
    """Runs ``model`` on batches of :class:`Sequence` chunks over a :class:`PagedAttentionCache`."""

    def __init__(self, model, cache: PagedAttentionCache, graphs: DecodeGraphs | None = None):
        self.model, self.cache, self.graphs = model, cache, graphs
        self.device = model.device
        self.grammars: Grammars | None = None  # set by the engine with the first constrained request
        self.ranks = model.config.get("tp_size", 1)  # a model split over ranks (kvgen.tensor_parallel)

    @torch.no_grad()
    def step(self, batch: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int, float, dict[int, float]]]:
        """Feed ``n`` tokens of each ``(sequence, n)``; return ``(sequence, token, logprob, top_logprobs)`` for
        every sequence that gets a new token."""
        ids, spans, keep, sampled, scored = [], [], [], [], []
        for seq, n in batch:
            start, end = seq.num_computed, seq.num_computed + n
            if seq.scores_prompt:  # rows whose next token is a prompt token not scored yet
                if not seq.prompt_logprobs:
                    seq.prompt_logprobs, seq.prompt_top_logprobs = [None], [None]
                first, last = max(start, len(seq.prompt_logprobs) - 1), min(end, len(seq.prompt) - 1)
                scored += [(seq, len(keep) + p - first, seq.tokens[p + 1]) for p in range(first, last)]
                keep += range(len(ids) + first - start, len(ids) + last - start)
            ids += seq.tokens[start:end]
            spans.append((start, end, seq.tables, len(seq.prompt)))  # (read, or sent, before the tables change)
            if end == len(seq.tokens):
                sampled.append((seq, len(keep)))
                keep.append(len(ids) - 1)
        constrained = [seq for seq, _ in sampled if seq.matcher is not None]
        masks = Masks(self.grammars, [seq.matcher for seq in constrained]).start() if constrained else None
        plan = Plan(ids, spans, keep)
        self.tell_followers(plan)  # (a split model's other ranks run it too)
        logits = self.forward(plan)  # the masks are computed meanwhile, in llguidance's thread
        if scored:
            rows = logits[[j for _, j, _ in scored]].float()  # (scored, V)
            tops = [seq.params.prompt_logprobs for seq, _, _ in scored]
            for (seq, _, _), (logprob, top) in zip(scored, prompt_logprobs(rows, [t for *_, t in scored], tops)):
                seq.prompt_logprobs.append(logprob)  # (in the prompt's order)
                seq.prompt_top_logprobs.append(top)
        allowed = {}
        if masks:  # llguidance's bitmask of each constrained row
            bits = masks.wait([list(seq.params.eos_token_ids) for seq in constrained])  # (constrained, words)
            allowed = dict(zip(map(id, constrained), bits))
        seqs = [seq for seq, _ in sampled]
        rows = [j for _, j in sampled]
        raw = (logits if rows == list(range(len(logits))) else logits[rows]).float()  # (sampled, V)
        chosen = [(seq, *choice) for seq, choice in zip(seqs, sample(seqs, raw, allowed))]
        for seq, token, _, _ in chosen:
            if seq.matcher is not None:
                seq.matcher.consume_token(token)
        return chosen

    @torch.no_grad()
    def forward(self, plan: Plan) -> torch.Tensor:
        """The kept rows' logits (kept, V) of ``plan``'s tokens, the cache told where each goes and which positions
        each row sees."""
        size, device = self.cache.block_size, self.device
        row_seq = torch.tensor([i for i, (start, end, *_) in enumerate(plan.spans) for _ in range(end - start)])
        positions = torch.cat([torch.arange(start, end) for start, end, *_ in plan.spans])  # (T,)
        prompt = positions < torch.tensor([length for *_, length in plan.spans])[row_seq]  # (T,): a prompt token's row
        tables, blocks = {}, {}
        for kind in self.cache.kinds:
            tables[kind] = table_rows([by_kind[kind] for _, _, by_kind, _ in plan.spans])  # (S, W): -1 past each end
            blocks[kind] = (tables[kind][:, :, None] * size + torch.arange(size)).flatten(1)  # (S, W * size)
        slots = {kind: blocks[kind][row_seq, positions] for kind in self.cache.kinds}  # (T,): where each token goes
        if self.graphs is not None and len(plan.ids) == len(plan.spans) == len(plan.keep) and not prompt.any():
            logits = self.graphs.run(plan.ids, positions, tables, slots)
            if logits is not None:
                return logits
        steps, on_device = {}, (row_seq.to(device), positions.to(device))
        for kind in self.cache.kinds:
            if self.cache.block_sparse:  # attention reads each row's blocks (kvgen.masks.paged_block_mask)
                steps[kind] = (slots[kind].to(device), BlockRows(*on_device, tables[kind].to(device)))
                continue
            key_positions = torch.full((len(plan.spans), size * (1 + int(tables[kind].max()))), -1)  # (S, used)
            for i, (_, end, *_) in enumerate(plan.spans):
                live = tables[kind][i].repeat_interleave(size)[:end] >= 0  # blocks that slid out of the window
                key_positions[i, blocks[kind][i, :end][live]] = torch.arange(end)[live]
            steps[kind] = (slots[kind].to(device), key_positions[row_seq].to(device))  # (T,), (T, used)
        self.cache.begin_step(steps)
        positions = on_device[1]
        with eager_blocks(), prompt_rows(prompt):  # (compiled blocks would compile a graph per batch size)
            return self.model(torch.tensor([plan.ids], device=device), position_ids=positions[None],
                              cache_position=positions, past_key_values=self.cache, use_cache=True,
                              logits_to_keep=torch.tensor(plan.keep, dtype=torch.long, device=device)).logits[0]

    def follow(self) -> None:
        """On a rank other than 0 of a split model: run the steps rank 0 plans, until it stops."""
        while True:
            plan = broadcast_object()
            if plan is None:
                return
            if plan != IDLE:
                self.forward(plan)

    def tell_followers(self, message: Plan | str | None) -> None:
        """Rank 0 of a split model: send the other ranks the step to run, or that the engine is idle (``IDLE``:
        their collectives time out otherwise) or stopped (None)."""
        if self.ranks > 1:
            broadcast_object(message)
