"""Speculative decoding: draft tokens cheaply, check them all in one forward pass, keep the agreeing run.

The drafters of transformers' ``generate()``:

* :class:`PromptLookup` (``prompt_lookup_num_tokens``): the tokens that followed an earlier
  occurrence of the sequence's last n-gram;
* :class:`ModelDrafter` over ``assistant_model``: a smaller model of the same vocabulary, with its own cache;
* :class:`ModelDrafter` over :func:`early_exit_model` (``assistant_early_exit``): the model's
  first layers, on the model's own cache.

Each step feeds the last token and the ``k`` drafts at once. A decode step on CPU is bound
by reading the weights, so ``k + 1`` rows (at most 8 take the compiled path) cost about one.
How many to draft is the drafter's schedule (:class:`Drafter`): kvgen's ``"adaptive"`` by
default, which stops drafting where drafts do not pay.
Greedy decoding keeps drafts while they are the argmax, so it gives plain greedy decoding's
tokens. Sampling keeps them by speculative sampling (Leviathan et al. 2023, algorithm 1)
when the drafter has a distribution, else while they equal the tokens drawn from the
model's: either way the output follows the model's distribution.

Rejected drafts leave the cache by ``crop``. A layer that ``crop`` cannot take back exactly
(state-space states, a ring or sink window that evicts, quantized blocks) gives a
checkpoint before the step (:meth:`kvgen.cache.base.CacheLayer.checkpoint`); it is restored
and the accepted tokens are fed again.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from kvgen.cache.base import Cache
from kvgen.cache.registry import create_cache
from kvgen.generation.logits import apply_processors
from kvgen.generation.search import choose_next_tokens
from kvgen.models.decode_blocks import MAX_ROWS

#: defaults for an assistant model's drafting: transformers' (its GenerationConfig's global defaults), except the
#: schedule: kvgen's "adaptive" unless "constant", "heuristic" or "heuristic_transient" is asked for
ASSISTANT_DEFAULTS = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "adaptive",
                      "assistant_confidence_threshold": 0.4}
#: the cost of verifying k drafts along with the last token, in decode steps: 1 + ROW_COST * sqrt(k) (measured on
#: 2 CPU cores, SmolLM2 float32 compiled and Q8_0/Q4_1: 2 rows 1.1-1.2x, 4 rows 1.1-1.4x, 8 rows 1.2-1.6x one row)
ROW_COST = 0.2
#: the adaptive schedule: prior acceptance of a first draft and of a draft after an accepted one, how fast their
#: estimates follow the outcomes, and the longest pause (in steps) between probes while drafts do not pay
PRIOR_FIRST, PRIOR_LATER, RATE, MAX_PAUSE = 0.6, 0.8, 0.3, 32


@dataclass
class SpeculationStats:
    """What the drafts achieved in one ``generate()`` call."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of those, kept
    steps: int = 0  # decode steps (one forward pass of the model each, with or without drafts)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class Drafter:
    """How many tokens to draft next, and what the drafts' fate teaches.

    ``schedule``: ``"constant"`` drafts ``num_tokens`` every step; ``"heuristic"`` (kept for
    the drafter's next call) and ``"heuristic_transient"`` add 2 after a step that accepted
    every draft and take 1 away (to at least 1) otherwise, as transformers does. kvgen's
    ``"adaptive"`` drafts the number (at most ``num_tokens``, and at most 7 on CPU, where 8
    rows cost about one) with the most expected tokens per unit of cost, from running
    estimates of how often a first draft, and a draft after an accepted one, are kept; a
    draft token costs ``cost`` (0 for lookup, the drafter's share of the weights for a
    model) plus its verifying row. While drafting does not pay, it pauses for 1, 2, 4, ...
    up to 32 steps between probes, so text that never repeats decodes at about plain speed.
    """

    cost = 0.0  # one draft token, in decode steps of the model

    def __init__(self, num_tokens: int, schedule: str):
        self.num_tokens, self.schedule = num_tokens, schedule
        self.first, self.later = PRIOR_FIRST, PRIOR_LATER  # estimated acceptance
        self.pause, self.wait = 1, 0  # next pause length, steps left in this one

    def length(self, budget: int, max_rows: int | None) -> int:
        """Tokens to draft now, at most ``budget`` (and ``max_rows - 1`` for the adaptive schedule)."""
        limit = min(int(self.num_tokens), budget)
        if self.schedule != "adaptive":
            return limit
        if self.wait:
            self.wait -= 1
            return 0
        return self._best(limit if max_rows is None else min(limit, max_rows - 1))[0]

    def _best(self, limit: int) -> tuple[int, float]:
        """The draft length in 1..limit with the most expected tokens per cost, and that ratio (0: none)."""
        best = (0, 0.0)
        for k in range(1, limit + 1):
            expected = 1 + self.first * (1 - self.later ** k) / (1 - self.later)  # the model's token + drafts kept
            best = max(best, (k, expected / (1 + ROW_COST * k ** 0.5 + self.cost * k)), key=lambda kg: kg[1])
        return best

    def update(self, accepted: int, drafted: int) -> None:
        """Learn from a step that kept ``accepted`` of ``drafted`` drafts."""
        if not drafted:
            return
        if self.schedule in ("heuristic", "heuristic_transient"):
            self.num_tokens = self.num_tokens + 2 if accepted == drafted else max(1, self.num_tokens - 1)
        self.first += RATE * ((accepted > 0) - self.first)
        for kept in [1] * (accepted - 1) + [0] * (0 < accepted < drafted):
            self.later += RATE * (kept - self.later)
        if self._best(drafted)[1] <= 1:  # drafting does not pay at present: pause, longer each time
            self.wait, self.pause = self.pause, min(2 * self.pause, MAX_PAUSE)
        else:
            self.pause = 1

    def finish(self) -> None:
        """Called once generation ends."""


class PromptLookup(Drafter):
    """Drafts the ``num_tokens`` tokens that followed the first earlier occurrence of the last n-gram.

    As transformers' ``PromptLookupCandidateGenerator``: n-grams from ``max_ngram`` tokens down
    to 1; drafts stop before a token the logits processors forbid and after an EOS.

    Example:
        >>> lookup = PromptLookup(num_tokens=3, max_ngram=2)
        >>> lookup.draft(torch.tensor([[5, 6, 7, 8, 9, 5, 6]]), limit=3)[0].tolist()
        [7, 8, 9]
    """

    def __init__(self, num_tokens: int, max_ngram: int = 2, eos_ids=(), processors=(), vocab_size: int = 0,
                 schedule: str = "constant"):
        super().__init__(num_tokens, schedule)
        self.max_ngram = max_ngram
        self.eos_ids, self.processors, self.vocab_size = list(eos_ids), list(processors), vocab_size

    def draft(self, input_ids: torch.Tensor, limit: int, cache: Cache | None = None) -> tuple[torch.Tensor, None]:
        """Up to ``limit`` draft tokens (k,) after ``input_ids`` (1, L); no distribution (``cache`` unused)."""
        sequence = input_ids[0]
        length = sequence.shape[0]
        if limit <= 0:
            return sequence[:0], None
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            windows = sequence.unfold(0, n, 1)  # (L - n + 1, n)
            starts = (windows == sequence[-n:]).all(dim=1).nonzero().flatten() + n
            for start in starts.tolist():
                if start >= length:
                    continue
                drafts = self._allowed(input_ids, sequence[start:start + limit])
                if drafts.numel():
                    return drafts, None
        return sequence[:0], None

    def _allowed(self, input_ids: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """``drafts`` cut before the first token the processors forbid and after the first EOS."""
        if self.processors:
            ones = torch.ones(1, self.vocab_size, dtype=torch.float32, device=drafts.device)
            for i, token in enumerate(drafts.tolist()):
                scores = apply_processors(self.processors, torch.cat([input_ids, drafts[None, :i]], dim=1), ones)
                if scores[0, token] == -float("inf"):
                    drafts = drafts[:i]
                    break
        for i, token in enumerate(drafts.tolist()):
            if token in self.eos_ids:
                return drafts[:i + 1]
        return drafts


class ModelDrafter(Drafter):
    """Drafts with a (smaller, or early-exit) model of the same vocabulary, one token at a time.

    An assistant has its own cache of what it has seen: each draft feeds only the tokens it
    has not (the cache is cropped to the prefix it shares with the sequence). An early exit
    (``shared_layers``: its number of layers) reads and writes the model's own cache, whose
    first layers hold exactly what it needs: no prefill of its own, and its writes are taken
    back after drafting. Drafting stops after the tokens asked for, at an EOS, or when the
    top probability falls below ``confidence_threshold``.

    Example:
        >>> drafter = ModelDrafter(small_model, processors=[], do_sample=False)      # doctest: +SKIP
        >>> tokens, scores = drafter.draft(input_ids, 10, cache)  # cache: the model's  # doctest: +SKIP
    """

    def __init__(self, model, processors=(), do_sample: bool = False, eos_ids=(), num_tokens: int = 20,
                 schedule: str = "constant", confidence_threshold: float | None = 0.4, cost: float = 0.0,
                 shared_layers: int | None = None):
        super().__init__(num_tokens, schedule)
        self.model, self.processors, self.do_sample = model, list(processors), do_sample
        self.eos_ids, self.confidence_threshold, self.cost = list(eos_ids), confidence_threshold, cost
        self.shared_layers = shared_layers
        self.cache: Cache | None = None if shared_layers else create_cache(
            "dynamic", config=model.config, batch_size=1, max_cache_len=0, device=model.device, dtype=model.dtype)

    def draft(self, input_ids: torch.Tensor, limit: int, cache: Cache) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Up to ``limit`` draft tokens (k,) after ``input_ids`` (1, L), whose first L - 1 are in the model's
        ``cache``, and the processed scores they were chosen from (k, V)."""
        if limit <= 0:
            return input_ids[0, :0], None
        if self.shared_layers is None:
            return self._draft(input_ids, limit, self.cache)
        view = Cache(layers=cache.layers[: self.shared_layers])  # (the same layer objects)
        restores = checkpoint(view, limit)
        try:
            return self._draft(input_ids, limit, view)
        finally:
            roll_back(view, restores or [None] * len(view.layers), input_ids.shape[1] - 1)

    def _draft(self, input_ids: torch.Tensor, limit: int, cache: Cache):
        ids = input_ids.to(self.model.device)
        seen = cache.keep_common_prefix(ids)
        logits = self._forward(cache, ids[:, seen:], seen)
        tokens, scores = [], []
        for i in range(limit):
            step_scores = apply_processors(self.processors, ids, logits[:, -1].float())  # (1, V)
            token = choose_next_tokens(step_scores, self.do_sample)  # (1,)
            tokens.append(token)
            scores.append(step_scores)
            ids = torch.cat([ids, token[:, None]], dim=1)
            if int(token) in self.eos_ids or i + 1 == limit:
                break
            if self.confidence_threshold and float(step_scores.softmax(-1)[0, token]) < self.confidence_threshold:
                break
            logits = self._forward(cache, token[:, None], ids.shape[1] - 1)
        return torch.cat(tokens).to(input_ids.device), torch.cat(scores).to(input_ids.device)

    def _forward(self, cache: Cache, tokens: torch.Tensor, start: int) -> torch.Tensor:
        position = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        return self.model(tokens, past_key_values=cache, cache_position=position, position_ids=position[None],
                          use_cache=True, logits_to_keep=1).logits  # (1, 1, V)

    def finish(self) -> None:
        """The ``"heuristic"`` schedule carries the number of tokens over to the drafter's next call."""
        if self.schedule == "heuristic" and getattr(self.model, "generation_config", None) is not None:
            self.model.generation_config.num_assistant_tokens = self.num_tokens


def early_exit_model(model: nn.Module, num_layers: int) -> nn.Module:
    """A view of ``model`` that runs its first ``num_layers`` decoder layers, then its final norm and head.

    The weights are shared (nothing is copied); as in LayerSkip, the exit is only a good
    drafter for a model trained for it, but its drafts are always verified.

    Example:
        >>> drafter_model = early_exit_model(model, 8)            # doctest: +SKIP
        >>> drafter_model(input_ids).logits.shape == model(input_ids).logits.shape  # doctest: +SKIP
        True
    """
    total = model.config.num_hidden_layers
    if not 0 < num_layers < total:
        raise ValueError(f"assistant_early_exit must be between 1 and {total - 1} (the model has {total} layers), "
                         f"got {num_layers}")
    path = next((name.split(".") for name, module in model.named_modules()
                 if isinstance(module, nn.ModuleList) and name.split(".")[-1] == "layers" and len(module) == total),
                None)
    if path is None:
        raise ValueError(f"{type(model).__name__} has no list of {total} decoder layers to exit early from")
    view = parent = _shallow(model)
    for name in path[:-1]:
        child = _shallow(getattr(parent, name))
        parent._modules[name] = child
        parent = child
    parent._modules[path[-1]] = nn.ModuleList(list(getattr(parent, path[-1]))[:num_layers])
    config = copy.copy(model.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = list(config.layer_types[:num_layers])
    view.config = config
    view._compiled_forward = None
    return view


def _shallow(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose submodule table can change without touching the original's."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def accept(scores: torch.Tensor, drafts: torch.Tensor, draft_scores: torch.Tensor | None,
           do_sample: bool) -> torch.Tensor:
    """The new tokens after one verifying pass: the accepted drafts, then one token of the model's own.

    ``scores`` (k + 1, V) are the model's processed scores after the last token and after each
    draft; ``drafts`` (k,); ``draft_scores`` (k, V) the drafter's processed scores, if it has them.

    Example:
        >>> scores = torch.tensor([[0., 9.], [9., 0.], [0., 9.]])  # the model's argmax: 1, 0, 1
        >>> accept(scores, torch.tensor([1, 1]), None, do_sample=False).tolist()
        [1, 0]
    """
    k = drafts.shape[0]
    if not do_sample:
        picks = scores.argmax(dim=-1)  # (k + 1,)
        n = int((picks[:k] == drafts).long().cumprod(0).sum())
        return torch.cat([drafts[:n], picks[n:n + 1]])
    p = scores.softmax(dim=-1)  # (k + 1, V)
    if draft_scores is None:  # drafts without a distribution: keep them while they equal the model's draws
        picks = torch.multinomial(p, 1).squeeze(1)  # (k + 1,)
        n = int((picks[:k] == drafts).long().cumprod(0).sum())
        return torch.cat([drafts[:n], picks[n:n + 1]])
    q = draft_scores.softmax(dim=-1)  # (k, V)
    rows = torch.arange(k, device=drafts.device)
    ratio = p[rows, drafts] / q[rows, drafts]  # accept draft i with probability min(1, p_i / q_i)
    n = int((torch.rand_like(ratio) <= ratio).long().cumprod(0).sum())
    last = p[n]
    if n < k:  # rejected: draw from the residual max(0, p - q), normalised
        residual = (p[n] - q[n]).clamp(min=0)
        total = residual.sum()
        if total > 0:  # (p == q: a rejection has probability 0, any draw from p is right)
            last = residual / total
    return torch.cat([drafts[:n], torch.multinomial(last, 1)])


def _chunk_limit(cache: Cache) -> int:
    limits = [limit for limit in (layer.chunk_limit() for layer in cache.layers) if limit is not None]
    return min(limits, default=1 << 30)


def _feed(model, cache: Cache, tokens: torch.Tensor, attention_mask: torch.Tensor,
          position: torch.Tensor) -> torch.Tensor:
    """Feed ``tokens`` (1, n) after the cache's ``length - 1`` tokens (``attention_mask`` (1, length) ends with the
    first of them, at RoPE ``position``), in as few passes as the cache allows; their logits (n, V)."""
    n, start = tokens.shape[1], attention_mask.shape[1] - 1
    mask = torch.cat([attention_mask, attention_mask.new_ones(1, n - 1)], dim=1)  # (1, length + n - 1)
    positions = position + torch.arange(n, device=tokens.device)  # (n,)
    logits, done = [], 0
    while done < n:
        rows = min(n - done, _chunk_limit(cache))
        logits.append(model(tokens[:, done:done + rows], attention_mask=mask[:, :start + done + rows],
                            position_ids=positions[None, done:done + rows], past_key_values=cache, use_cache=True,
                            cache_position=torch.arange(start + done, start + done + rows, device=tokens.device),
                            logits_to_keep=rows).logits[0])  # (rows, V)
        done += rows
    return torch.cat(logits)


def checkpoint(cache: Cache, new_tokens: int) -> list | None:
    """Per layer, ``None`` or a restore function (see ``CacheLayer.checkpoint``); ``None`` when crop suffices."""
    restores = [layer.checkpoint(new_tokens) for layer in cache.layers]
    return restores if any(r is not None for r in restores) else None


def roll_back(cache: Cache, restores: list, length: int) -> None:
    """Bring every layer back to ``length`` tokens: restore checkpointed layers, crop the others."""
    for layer, restore in zip(cache.layers, restores):
        if restore is None:
            layer.crop(length)
        else:
            restore()
    if cache.token_ids is not None:
        cache.token_ids = cache.token_ids[:, :length]


def make_drafter(model, config, assistant_model, input_ids: torch.Tensor, processors):
    """The drafter that ``config`` and ``assistant_model`` ask for (``None``: plain decoding); raises on settings
    speculative decoding cannot follow."""
    chosen = [name for name, on in (("assistant_model", assistant_model is not None),
                                    ("prompt_lookup_num_tokens", config.prompt_lookup_num_tokens is not None),
                                    ("assistant_early_exit", config.assistant_early_exit is not None)) if on]
    if not chosen:
        return None
    if len(chosen) > 1:
        raise ValueError(f"speculative decoding drafts one way at a time; got {' and '.join(chosen)}")
    why = ("it needs a cache: leave use_cache=True" if not config.use_cache else
           "beam search keeps several hypotheses: use num_beams=1" if config.num_beams > 1 else
           "use num_return_sequences=1" if config.num_return_sequences > 1 else
           f"it runs one sequence at a time, the batch has {input_ids.shape[0]}: call generate() per prompt"
           if input_ids.shape[0] > 1 else None)
    if why:
        raise ValueError(f"speculative decoding ({chosen[0]}) cannot run here: {why}")
    vocab = model.config.get("vocab_size")
    if config.prompt_lookup_num_tokens is not None:
        return PromptLookup(config.prompt_lookup_num_tokens, config.max_matching_ngram_size or 2, config.eos_ids(),
                            processors, vocab, config.num_assistant_tokens_schedule or "adaptive")
    if assistant_model is not None:
        if assistant_model.config.get("vocab_size") != vocab:
            raise ValueError(f"assistant_model has a vocabulary of {assistant_model.config.get('vocab_size')} tokens "
                             f"but the model has {vocab}: the assistant must share the model's tokenizer")
        drafter_model, shared = assistant_model, None
    else:
        drafter_model, shared = early_exit_model(model, config.assistant_early_exit), config.assistant_early_exit
    own = getattr(drafter_model, "generation_config", None)
    settings = {name: next((v for v in (getattr(config, name), own and getattr(own, name, None)) if v is not None),
                           default) for name, default in ASSISTANT_DEFAULTS.items()}
    return ModelDrafter(drafter_model, processors, config.do_sample, config.eos_ids(),
                        settings["num_assistant_tokens"], settings["num_assistant_tokens_schedule"],
                        settings["assistant_confidence_threshold"], _weight_bytes(drafter_model) / _weight_bytes(model),
                        shared)


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of the weights a forward pass reads (tied tensors once): what a decode step costs."""
    tensors = {t.data_ptr(): t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers())}
    return sum(tensors.values())


def speculative_decode(model, drafter, input_ids, attention_mask, position_ids, cache: Cache, seen: int, config,
                       max_length: int, streamer, processors):
    """Decode with drafts until EOS or ``max_length``: ``(sequences, scores, logits, stats)``.

    ``generate()`` calls it for batch 1 after choosing ``drafter`` (:func:`make_drafter`).
    """
    if streamer is not None:
        streamer.put(input_ids.cpu())
    logits = model._prefill(input_ids, attention_mask, position_ids, cache, seen)  # (1, 1, V)
    step = model._decode_step(cache, config, 1)  # one token, no drafts (compiled for a static cache)
    max_rows = MAX_ROWS if input_ids.device.type == "cpu" else None  # (rows that cost about one on CPU)
    eos = set(config.eos_ids())
    stats, scores_out, logits_out = SpeculationStats(), [], []
    raw = logits[0, -1:].float()  # (1, V)
    scores = apply_processors(processors, input_ids, raw)
    new = choose_next_tokens(scores, config.do_sample)  # (1,): the first token, from the prompt's logits
    while True:
        m = new.shape[0]
        input_ids = torch.cat([input_ids, new[None].to(input_ids.device)], dim=1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(1, m)], dim=1)
        position_ids = torch.cat([position_ids, position_ids[:, -1:] + torch.arange(1, m + 1,
                                                                                    device=position_ids.device)], dim=1)
        scores_out += list(scores[:m, None])
        logits_out += list(raw[:m, None])
        if streamer is not None:
            streamer.put(new.cpu())
        length = input_ids.shape[1]  # the last token is not in the cache yet
        if eos & set(new.tolist()) or length >= max_length:
            break
        drafts, draft_scores = input_ids[0, :0], None
        wanted = drafter.length(max_length - length - 1, max_rows) if _chunk_limit(cache) > 1 else 0
        if wanted:  # (a cache that must take tokens one by one: plain decoding for this token)
            drafts, draft_scores = drafter.draft(input_ids, wanted, cache)  # (k,), (k, V) or None
        k = drafts.shape[0]
        restores = None
        if k == 0:
            raw = step(input_ids, attention_mask, position_ids)[0].float()  # (1, V)
        else:
            restores = checkpoint(cache, k + 1)
            raw = _feed(model, cache, torch.cat([input_ids[:, -1:], drafts[None]], dim=1), attention_mask,
                        position_ids[0, -1]).float()  # (k + 1, V)
        scores = raw
        if processors:
            candidates = torch.cat([input_ids, drafts[None]], dim=1)
            scores = torch.cat([apply_processors(processors, candidates[:, :length + i], raw[i:i + 1])
                                for i in range(k + 1)])
        new = accept(scores, drafts, draft_scores, config.do_sample)
        stop = next((i + 1 for i, token in enumerate(new.tolist()) if token in eos), new.shape[0])
        new = new[:stop]  # nothing after an EOS
        kept = new.shape[0] - 1  # drafts that stay in the cache (the last new token is fed next step)
        stats.steps += 1
        stats.drafted += k
        stats.accepted += kept
        drafter.update(kept, k)
        if kept < k:
            if restores is None:
                cache.crop(length + kept)
            else:
                roll_back(cache, restores, length - 1)
                _feed(model, cache, torch.cat([input_ids[:, -1:], new[None, :kept]], dim=1), attention_mask,
                      position_ids[0, -1])
    if streamer is not None:
        streamer.end()
    drafter.finish()
    cache.token_ids = input_ids[:, : cache.get_seq_length()]
    return (input_ids, tuple(scores_out) if config.output_scores else None,
            tuple(logits_out) if config.output_logits else None, stats)
