"""A choice's text and logprobs as OpenAI writes them: text decoded as tokens arrive and cut at stop strings,
logprobs in the chat and completions layouts, ``best_of``'s pick, tool calls read from a whole reply.

Example:
    >>> best_choices({0: GenerationOutput("a", logprobs=[-1.0]), 1: GenerationOutput("b", logprobs=[-0.5])}, 2, 1)
    [1]
"""

from __future__ import annotations

from kvgen.serving.engine import GenerationOutput
from kvgen.serving.tools import ToolPlan

class ChoiceText:
    """One choice's text: decoded as tokens arrive, cut before the first stop string (which the engine
    keeps), and held back while its end may still become a stop string or a multi-byte character."""

    def __init__(self, tokenizer, stops: list[str], hidden: bool = False):
        self.tokenizer, self.stops, self.hidden = tokenizer, stops, hidden  # hidden: a prompt scored, no text
        self.hold = max(map(len, stops), default=1) - 1
        self.chars = self.tokens = 0  # text and tokens handed out so far
        self.stopped = False

    def advance(self, output: GenerationOutput) -> tuple[str, int, int]:
        """The text not handed out yet, and the tokens ``[start, end)`` that go with it."""
        start = self.tokens
        if self.stopped or self.hidden:
            return "", start, start
        ids, decode = output.generated_tokens, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        text = decode(ids)
        cut = min((i for i in (text.find(stop) for stop in self.stops) if i >= 0), default=-1)
        end = len(ids)
        if cut >= 0:
            text, self.stopped = text[:cut], True
            end = max(start, next(k for k in range(len(ids) + 1) if len(decode(ids[:k])) >= cut))
        elif not output.is_finished():
            text = text.rstrip("\ufffd")
            text = text[:max(self.chars, len(text) - self.hold)]
        new, self.chars, self.tokens = text[self.chars:], max(self.chars, len(text)), end
        return new, start, end

    def finish_reason(self, output: GenerationOutput) -> str | None:
        if self.hidden:
            return "length" if output.is_finished() else None
        return "stop" if self.stopped else output.finish_reason


def openai_logprobs(tokenizer, tokens: list[int], values: list, tops: list, chat: bool, offset: int) -> dict:
    """OpenAI's ``logprobs`` of ``tokens`` (their log-probabilities, their top alternatives: token -> value; None
    for a prompt's first token): chat's ``content`` list or the completions' columns, text offsets from ``offset``."""
    words = [tokenizer.decode([t]) for t in tokens]
    tops = [None if top is None else [(tokenizer.decode([t]), lp) for t, lp in top.items()] for top in tops]
    if chat:
        entry = lambda w, lp: {"token": w, "logprob": lp, "bytes": list(w.encode())}  # noqa: E731
        return {"content": [{**entry(w, lp), "top_logprobs": [entry(*alt) for alt in top]}
                            for w, lp, top in zip(words, values, tops)]}
    return {"tokens": words, "token_logprobs": list(values), "top_logprobs": [top and dict(top) for top in tops],
            "text_offset": [offset + sum(map(len, words[:i])) for i in range(len(words))]}


def best_choices(finals: dict[int, GenerationOutput], per_prompt: int, n: int) -> list[int]:
    """Of each prompt's ``per_prompt`` sequences (``best_of``), the ``n`` of the highest log-probability per token
    (as OpenAI picks), best first; all of them, in order, where ``per_prompt == n``."""
    if per_prompt == n:
        return sorted(finals)
    mean = lambda i: sum(finals[i].logprobs) / max(1, len(finals[i].logprobs))  # noqa: E731
    return [i for p in range(0, len(finals), per_prompt)
            for i in sorted(range(p, p + per_prompt), key=mean, reverse=True)[:n]]


def read_calls(tools: ToolPlan, reply: str) -> tuple[str | None, list[dict]]:
    """A whole reply's (content, tool calls); a forced call cut short (max_tokens) stays content."""
    try:
        return tools.read(reply)
    except (ValueError, KeyError, TypeError):
        return reply, []
