"""Logits processors and warpers, in transformers' order and arithmetic (so sampling is comparable)."""

from __future__ import annotations

from typing import Callable

import torch

Processor = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def repetition_penalty(penalty: float) -> Processor:
    def apply(input_ids, scores):
        score = torch.gather(scores, 1, input_ids)
        score = torch.where(score < 0, score * penalty, score / penalty)
        return scores.scatter(1, input_ids, score)

    return apply


def no_repeat_ngram(n: int) -> Processor:
    """Ban each token that would repeat an ``n``-gram the sequence already holds (transformers'
    ``NoRepeatNGramLogitsProcessor``; the prompt's n-grams count)."""
    def apply(input_ids, scores):
        length = input_ids.shape[1]
        if length + 1 < n:
            return scores
        banned = torch.zeros_like(scores, dtype=torch.bool)
        for row, ids in enumerate(input_ids.tolist()):
            prefix = ids[length + 1 - n:]  # the n - 1 tokens the next one would extend
            for i in range(length - n + 1):
                if ids[i:i + n - 1] == prefix:
                    banned[row, ids[i + n - 1]] = True
        return scores.masked_fill(banned, -float("inf"))

    return apply


def sequence_bias(biases: dict | list) -> Processor:
    """Add each sequence's bias to the score of its last token where the sequence so far ends with its other tokens
    (always, for a one-token sequence): transformers' ``SequenceBiasLogitsProcessor``. ``biases``: ``{(ids...):
    bias}`` or ``[[[ids...], bias], ...]``."""
    pairs = list(biases.items()) if isinstance(biases, dict) else biases
    if not isinstance(pairs, (list, tuple)) or not pairs or any(
            not isinstance(p, (list, tuple)) or len(p) != 2 or not isinstance(p[0], (list, tuple)) or not p[0]
            or any(not isinstance(t, int) or t < 0 for t in p[0]) or not isinstance(p[1], (int, float))
            for p in pairs):
        raise ValueError("sequence_bias must be a non-empty {(token ids...): bias} dict or [[token ids], bias] list, "
                         f"got {biases}")
    items = [(list(ids), float(bias)) for ids, bias in pairs]

    def apply(input_ids, scores):
        if any(t >= scores.shape[-1] for ids, _ in items for t in ids):
            raise ValueError(f"sequence_bias or bad_words_ids hold token ids past the vocabulary ({scores.shape[-1]} "
                             "tokens)")
        bias = torch.zeros_like(scores)
        for row, ids in enumerate(input_ids.tolist()):
            for sequence, value in items:
                if len(sequence) - 1 <= len(ids) and ids[len(ids) - len(sequence) + 1:] == sequence[:-1]:
                    bias[row, sequence[-1]] += value
        return scores + bias

    return apply


def no_bad_words(bad_words_ids: list[list[int]], eos_ids: list[int]) -> Processor:
    """Never complete one of the token sequences ``bad_words_ids`` (transformers' ``NoBadWordsLogitsProcessor``: a
    sequence bias of -inf; a one-token word that is an EOS stays allowed)."""
    if not isinstance(bad_words_ids, (list, tuple)) or not bad_words_ids or any(
            not isinstance(w, (list, tuple)) or not w or any(not isinstance(t, int) or t < 0 for t in w)
            for w in bad_words_ids):
        raise ValueError(f"bad_words_ids must be a non-empty list of non-empty lists of token ids, got {bad_words_ids}")
    words = {tuple(w): -float("inf") for w in bad_words_ids if not (len(w) == 1 and w[0] in eos_ids)}
    return sequence_bias(words) if words else (lambda input_ids, scores: scores)


def suppress_eos_until(eos_ids: list[int], min_total_length: int) -> Processor:
    """Forbid EOS while the sequence (prompt included) is shorter than ``min_total_length``."""
    eos = torch.tensor(eos_ids)

    def apply(input_ids, scores):
        if input_ids.shape[-1] < min_total_length:
            scores = scores.clone()
            scores[:, eos.to(scores.device)] = -float("inf")
        return scores

    return apply


def suppress(token_ids: list[int], at_length: int | None = None) -> Processor:
    """Forbid ``token_ids`` (always, or only when the sequence is ``at_length`` long: the first new token).

    Ids outside the vocabulary are ignored, as in transformers.
    """
    ids = torch.tensor(token_ids, dtype=torch.long)

    def apply(input_ids, scores):
        if at_length is not None and input_ids.shape[-1] != at_length:
            return scores
        inside = ids[(ids >= 0) & (ids < scores.shape[-1])]
        return scores.index_fill(1, inside.to(scores.device), -float("inf"))

    return apply


def temperature(value: float) -> Processor:
    return lambda input_ids, scores: scores / value


def top_k(k: int, min_tokens_to_keep: int = 1) -> Processor:
    def apply(input_ids, scores):
        kk = min(max(k, min_tokens_to_keep), scores.shape[-1])
        threshold = torch.topk(scores, kk)[0][..., -1, None]
        return scores.masked_fill(scores < threshold, -float("inf"))

    return apply


def top_p(p: float, min_tokens_to_keep: int = 1) -> Processor:
    def apply(input_ids, scores):
        sorted_logits, sorted_indices = torch.sort(scores, descending=False)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - p)
        remove[..., -min_tokens_to_keep:] = 0
        return scores.masked_fill(remove.scatter(1, sorted_indices, remove), -float("inf"))

    return apply


def min_p(p: float, min_tokens_to_keep: int = 1) -> Processor:
    """Keep the tokens at least ``p`` times as likely as the likeliest (transformers' ``MinPLogitsWarper``)."""
    def apply(input_ids, scores):
        probs = scores.softmax(dim=-1)
        remove = probs < p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, torch.topk(probs, min(min_tokens_to_keep, probs.shape[-1]), dim=-1).indices, False)
        return scores.masked_fill(remove, -float("inf"))

    return apply


def typical_p(mass: float, min_tokens_to_keep: int = 1) -> Processor:
    """Keep the tokens whose surprise is closest to the distribution's entropy, holding ``mass`` (transformers'
    ``TypicalLogitsWarper``)."""
    def apply(input_ids, scores):
        normalized = scores.log_softmax(dim=-1)
        entropy = -(normalized * normalized.exp()).nansum(-1, keepdim=True)
        shifted, order = ((-normalized) - entropy).abs().sort(descending=False)
        cumulative = scores.gather(-1, order).softmax(dim=-1).cumsum(dim=-1)
        last = (cumulative < mass).sum(dim=1).clamp_(max=shifted.shape[-1] - 1)
        remove = shifted > shifted.gather(1, last.view(-1, 1))
        remove[..., :min_tokens_to_keep] = False
        return scores.masked_fill(remove.scatter(1, order, remove), -float("inf"))

    return apply


def probability_cutoff(epsilon: float, eta: bool, min_tokens_to_keep: int = 1) -> Processor:
    """Drop the tokens less likely than ``epsilon`` (transformers' ``EpsilonLogitsWarper``), or with ``eta``, than
    ``min(epsilon, sqrt(epsilon) * exp(-entropy))`` (``EtaLogitsWarper``); the likeliest token stays."""
    def apply(input_ids, scores):
        probabilities = scores.softmax(dim=-1)
        cutoff = torch.tensor(epsilon, dtype=scores.dtype, device=scores.device)
        if eta:
            entropy = torch.distributions.Categorical(logits=scores).entropy()
            cutoff = torch.min(cutoff, cutoff.sqrt() * torch.exp(-entropy))[..., None]
        kept = torch.topk(scores, min(min_tokens_to_keep, scores.shape[-1]))[0][..., -1, None]
        return scores.masked_fill((probabilities < cutoff) & (scores < kept), -float("inf"))

    return apply


def prefix_allowed(fn, num_beams: int) -> Processor:
    """Only the tokens ``fn(batch_id, sequence)`` allows (transformers' ``PrefixConstrainedLogitsProcessor``; the
    rows of one prompt's beams share its batch id). Where no allowed token has a finite score in any of a prompt's
    beams, the allowed ones are scored 0, so the constraint holds."""
    def apply(input_ids, scores):
        mask = torch.full_like(scores, -float("inf"))
        for row in range(input_ids.shape[0]):
            allowed = fn(row // num_beams, input_ids[row])
            if len(allowed) == 0:
                raise ValueError(f"prefix_allowed_tokens_fn allowed no token for batch id {row // num_beams}: the "
                                 "constraint cannot be met")
            mask[row, allowed] = 0
        processed = scores + mask
        unmet = processed.amax(dim=-1).isneginf().view(-1, num_beams).all(dim=-1, keepdim=True)
        return torch.where(unmet.repeat_interleave(num_beams, dim=0), mask, processed)

    return apply


def forced_tokens(token_ids: int | list[int], at_length: int) -> Processor:
    """Only ``token_ids`` may come when the sequence is ``at_length`` long (transformers' ``ForcedBOSToken`` /
    ``ForcedEOSTokenLogitsProcessor``)."""
    ids = [token_ids] if isinstance(token_ids, int) else list(token_ids)

    def apply(input_ids, scores):
        if input_ids.shape[-1] != at_length:
            return scores
        forced = torch.full_like(scores, -float("inf"))
        forced[:, ids] = 0
        return forced

    return apply


def remove_invalid_values() -> Processor:
    """NaN scores become 0 and infinite ones the dtype's largest or smallest number (transformers'
    ``InfNanRemoveLogitsProcessor``)."""

    def apply(input_ids, scores):
        info = torch.finfo(scores.dtype)
        out = torch.where(scores != scores, 0.0, scores)
        out = torch.where(scores == float("inf"), info.max, out)
        return torch.where(scores == -float("inf"), info.min, out)

    return apply


def exponential_decay_length_penalty(start_index: int, decay_factor: float, eos_ids: list[int],
                                     prompt_length: int) -> Processor:
    """Past ``start_index`` new tokens, each end-of-sequence score grows by ``|score| * (decay_factor ** n - 1)``,
    n tokens past it (transformers' ``ExponentialDecayLengthPenalty``; infinite scores are left as they are)."""
    start = start_index + prompt_length

    def apply(input_ids, scores):
        length = input_ids.shape[-1]
        if length <= start:
            return scores
        eos = scores[:, eos_ids]  # (B, E)
        penalty = (torch.abs(eos) * (pow(decay_factor, length - start) - 1)).masked_fill(~torch.isfinite(eos), 0.0)
        penalties = torch.zeros_like(scores)
        penalties[:, eos_ids] = penalty
        return scores + penalties

    return apply


def apply_processors(processors: list[Processor], input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """``scores`` (B, V) after each processor in turn, given the sequences so far ``input_ids`` (B, L)."""
    for processor in processors:
        scores = processor(input_ids, scores)
    return scores


def build_processors(config, prompt_length: int, custom: list[Processor] = (), max_length: int | None = None,
                     prefix_allowed_tokens_fn=None) -> list[Processor]:
    """The processors ``config`` asks for, in the order transformers applies them; ``custom`` ones (generate's
    ``logits_processor``) after the others and before the sampling ones, where transformers merges them.
    ``max_length``: where ``forced_eos_token_id`` ends the sequence; ``prefix_allowed_tokens_fn``: generate's."""
    processors: list[Processor] = []
    # a setting that is None is off (as in transformers)
    if config.sequence_bias is not None:
        processors.append(sequence_bias(config.sequence_bias))
    if config.repetition_penalty not in (None, 1.0):
        processors.append(repetition_penalty(config.repetition_penalty))
    eos = config.eos_ids()
    if config.no_repeat_ngram_size:
        processors.append(no_repeat_ngram(config.no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        processors.append(no_bad_words(config.bad_words_ids, eos))
    if eos and config.min_length:
        processors.append(suppress_eos_until(eos, config.min_length))
    if eos and config.min_new_tokens:
        processors.append(suppress_eos_until(eos, prompt_length + config.min_new_tokens))
    if prefix_allowed_tokens_fn is not None:
        processors.append(prefix_allowed(prefix_allowed_tokens_fn, config.num_beams or 1))
    if config.forced_bos_token_id is not None:
        processors.append(forced_tokens(config.forced_bos_token_id, 1))
    if config.forced_eos_token_id is not None and max_length is not None:
        processors.append(forced_tokens(config.forced_eos_token_id, max_length - 1))
    if config.remove_invalid_values:
        processors.append(remove_invalid_values())
    if config.exponential_decay_length_penalty is not None:
        start_index, decay_factor = config.exponential_decay_length_penalty
        processors.append(exponential_decay_length_penalty(start_index, decay_factor, eos, prompt_length))
    if config.suppress_tokens:
        processors.append(suppress(config.suppress_tokens))
    if config.begin_suppress_tokens:
        processors.append(suppress(config.begin_suppress_tokens, at_length=prompt_length))
    processors.extend(custom)
    if config.do_sample:
        if config.temperature not in (None, 1.0):
            processors.append(temperature(config.temperature))
        if config.top_k:
            processors.append(top_k(config.top_k))
        if config.top_p is not None and config.top_p < 1.0:
            processors.append(top_p(config.top_p))
        if config.min_p is not None:  # (after the temperature, as in transformers and llama.cpp)
            processors.append(min_p(config.min_p))
        if config.typical_p is not None and config.typical_p < 1.0:
            processors.append(typical_p(config.typical_p))
        if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
            processors.append(probability_cutoff(config.epsilon_cutoff, eta=False))
        if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
            processors.append(probability_cutoff(config.eta_cutoff, eta=True))
    if config.renormalize_logits:  # (always the last, as in transformers)
        processors.append(lambda input_ids, scores: scores.log_softmax(dim=-1))
    return processors
