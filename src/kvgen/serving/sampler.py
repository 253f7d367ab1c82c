"""Each sequence's next token from a step's logits, chosen on the logits' device and fetched in one transfer.

A row goes through what ``generate()`` applies to it: the penalties and bias, its grammar's mask, then greedy
choice or temperature, top-k, top-p and min-p and a draw from the request's own generator. Rows that nothing
changes take one batched argmax. Tokens, their logits, the normalizers and the top alternatives then come to the
host together, as one float64 tensor (float32 logits and token ids are exact in it): one host synchronisation
per step, where a GPU would otherwise wait on a few per row.

Example:
    >>> sample([seq_a, seq_b], logits, allowed={})          # doctest: +SKIP
    [(1234, -0.71, {}), (87, -2.3, {87: -2.3, 11: -2.5})]
"""

from __future__ import annotations

import torch

from kvgen.generation.logits import min_p, temperature, top_k, top_p
from kvgen.grammar import mask_refused_
from kvgen.serving.scheduler import SamplingParams, Sequence


def sample(seqs: list[Sequence], raw: torch.Tensor,
           allowed: dict[int, torch.Tensor]) -> list[tuple[int, float, dict[int, float]]]:
    """``(token, logprob, top_logprobs)`` of each sequence from its raw logits (n, V) float32, among the tokens its
    grammar allows (``allowed``: ``id(seq)`` -> a bitmask of :class:`~kvgen.grammar.Masks`, applied to ``raw`` in
    place). The log-probability is under the model's raw logits (as vLLM reports it), and so are the
    ``top_logprobs`` likeliest alternatives."""
    if not seqs:
        return []
    tops = [seq.params.top_logprobs for seq in seqs]
    totals, top = normalized(raw, tops)  # before the grammars' masks
    tokens = raw.argmax(dim=-1)  # (n,): greedy, where nothing changes the logits
    for i, seq in enumerate(seqs):
        bits, params = allowed.get(id(seq)), seq.params
        if bits is None and not params.do_sample and not changes_logits(params):
            continue
        row = raw[i]  # (V,)
        if bits is not None:  # the chosen token is allowed, so its logit stays as the model gave it
            mask_refused_(row, bits)
        scores = row
        if changes_logits(params):
            if seq.penalties is None:
                seq.penalties = Penalties(params, seq.prompt, row)
            scores = seq.penalties(row, seq.generated)
        tokens[i] = draw(seq, scores) if params.do_sample else scores.argmax()
    return fetch(raw, tokens, totals, top, tops)


def normalized(raw: torch.Tensor, tops: list[int]):
    """The normalizers (n,) of raw logits (n, V) (torch's ``logsumexp`` in float32, ~1e-6 off float64's over
    49k-262k tokens) and their ``topk`` of ``max(tops)`` (None for 0)."""
    return torch.logsumexp(raw, dim=-1), raw.topk(max(tops), dim=-1) if max(tops) else None


def fetch(raw: torch.Tensor, tokens: torch.Tensor, totals: torch.Tensor, top, tops: list[int]):
    """``(token, logprob, top_logprobs)`` of each row of ``raw`` (n, V), ``tokens`` (n,) on its device, ``totals`` its
    normalizers (n,) and ``top`` its ``topk`` of ``max(tops)`` (or None), brought to the host in one transfer.
    Each log-probability is a logit minus its normalizer, taken in float64 on the host."""
    columns = [tokens[:, None], raw.gather(1, tokens[:, None]), totals[:, None]]  # (n, 1) each
    if top is not None:
        columns += [top.indices, top.values]  # (n, k) each
    rows = torch.cat([c.double() for c in columns], dim=1).tolist()  # the one host synchronisation
    k = top.values.shape[1] if top is not None else 0
    out = []
    for (token, logit, total, *alternatives), wanted in zip(rows, tops):
        ids, values = alternatives[:k][:wanted], alternatives[k:][:wanted]
        out.append((int(token), logit - total, {int(i): v - total for i, v in zip(ids, values)}))
    return out


def prompt_logprobs(raw: torch.Tensor, tokens: list[int], tops: list[int]) -> list[tuple[float, dict[int, float]]]:
    """The log-probability of each prompt token under the logits (n, V) of the row before it, with the ``tops[i]``
    likeliest alternatives, in one transfer."""
    if not tokens:
        return []
    scored = fetch(raw, torch.tensor(tokens, device=raw.device), *normalized(raw, tops), tops)
    return [(logprob, alternatives) for _, logprob, alternatives in scored]


def changes_logits(params: SamplingParams) -> bool:
    """Whether penalties or a bias change the logits before the choice."""
    return bool(params.frequency_penalty or params.presence_penalty or params.logit_bias or
                params.repetition_penalty != 1.0)


def draw(seq: Sequence, scores: torch.Tensor) -> torch.Tensor:
    """A token (0-d, on the scores' device) drawn from ``scores`` (V,) after the request's warpers, with its
    own generator (seeded by ``params.seed``, else at random), as ``generate()`` draws it."""
    scores = scores[None]  # (1, V)
    for processor in _warpers(seq.params):
        scores = processor(None, scores)
    if seq.generator is None:
        seq.generator = torch.Generator(device=scores.device)
        if seq.params.seed is None:
            seq.generator.seed()
        else:
            seq.generator.manual_seed(seq.params.seed)
    return torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=seq.generator).view(())


class Penalties:
    """A request's penalties and bias, kept on the logits' device: first vLLM's (and transformers')
    ``repetition_penalty`` of every token in the prompt or the reply (positive logits divided by it, negative ones
    multiplied), then OpenAI's ``- frequency_penalty * count - presence_penalty * (count > 0) + logit_bias``,
    ``count`` each token's occurrences in the reply (not the prompt). The prompt and the bias go to the device once;
    each step adds the reply's new tokens to the counts there, so a penalised row sends nothing to the device.

    Example:
        >>> penalties = Penalties(SamplingParams(presence_penalty=1.0, logit_bias={0: -5.0}), [1], torch.zeros(4))
        >>> penalties(torch.zeros(4), [2, 2]).tolist()
        [-5.0, 0.0, -1.0, 0.0]
    """

    def __init__(self, params: SamplingParams, prompt: list[int], like: torch.Tensor):
        self.params, self.counted = params, 0
        self.counts = torch.zeros_like(like, dtype=torch.float32)  # (V,) the reply's tokens
        self.seen = torch.zeros_like(like, dtype=torch.bool)  # (V,) the prompt's and the reply's tokens
        self.seen[torch.tensor(prompt, dtype=torch.long, device=like.device)] = True
        bias = params.logit_bias
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long, device=like.device)
        self.bias = torch.tensor(list(bias.values()), dtype=torch.float32, device=like.device)

    def __call__(self, raw: torch.Tensor, generated: list[int]) -> torch.Tensor:
        """The logits (V,) float32 penalised after the reply so far, ``generated``."""
        for token in generated[self.counted:]:
            self.counts[token] += 1
            self.seen[token] = True
        self.counted = len(generated)
        params, scores = self.params, raw.clone()
        if params.repetition_penalty != 1.0:
            penalty = params.repetition_penalty
            scores = torch.where(self.seen, torch.where(scores > 0, scores / penalty, scores * penalty), scores)
        if params.frequency_penalty or params.presence_penalty:
            scores -= params.frequency_penalty * self.counts + params.presence_penalty * (self.counts > 0)
        if len(self.bias_ids):
            scores[self.bias_ids] += self.bias
        return scores


def _warpers(params: SamplingParams):
    """The sampling warpers of ``params``, in transformers' order."""
    if params.temperature != 1.0:
        yield temperature(params.temperature)
    if params.top_k:
        yield top_k(params.top_k)
    if params.top_p < 1.0:
        yield top_p(params.top_p)
    if params.min_p > 0.0:
        yield min_p(params.min_p)
