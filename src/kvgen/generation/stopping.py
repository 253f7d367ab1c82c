"""Stopping criteria beyond EOS and ``max_length``, as transformers' (``StopStringCriteria``, ``MaxTimeCriteria``).

``generate(..., stop_strings=["\\n"], tokenizer=tokenizer)``: after each new token, a row whose text now holds a
stop string that ends within that token's text (it may begin in earlier tokens, the prompt's too, and the
token may run on past it) is finished, as ``stopping_criteria`` finish rows: the stop string stays in the
output, and the row is padded after it where the model has an end-of-sequence token (without one, as in
transformers, a finished row runs on until every row has finished). ``max_time``: every row finishes once
that many seconds have passed since ``generate()`` began (the prefill included).
"""

from __future__ import annotations

import time

import torch


class StopStrings:
    """Which rows of a sequence just completed one of ``stops`` (their newest token ends one).

    Each check decodes the last few tokens of each row: a stop string of n characters lies within the last
    n + 1 tokens (each token holds at least one character).

    Example:
        >>> stops = StopStrings(tokenizer, [".", "\\n"])       # doctest: +SKIP
        >>> stops(torch.tensor([[40, 1044, 30]]))              # doctest: +SKIP
        tensor([True])
    """

    def __init__(self, tokenizer, stops: str | list[str] | tuple[str, ...]):
        stops = [stops] if isinstance(stops, str) else list(stops)
        if not stops or any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop_strings must be a non-empty string or a list of them, got {stops!r}")
        if tokenizer is None:
            raise ValueError("stop_strings needs the tokenizer to read the text: generate(..., stop_strings=..., "
                             "tokenizer=tokenizer)")
        self.tokenizer, self.stops = tokenizer, stops
        self.window = max(map(len, stops)) + 1

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) bool: whether each row's newest token completes a stop string (a stopping criterion's call)."""
        done = []
        for row in input_ids[:, -self.window:].tolist():
            text = self.tokenizer.decode(row)
            before = len(self.tokenizer.decode(row[:-1]))  # the text before the newest token
            done.append(any(text.find(s, max(0, before - len(s) + 1)) >= 0 for s in self.stops))
        return torch.tensor(done, device=input_ids.device)


class MaxTime:
    """Every row is finished once ``seconds`` have passed since this object was made (transformers'
    ``MaxTimeCriteria``; ``generate()`` makes it before the prefill).

    Example:
        >>> stop = MaxTime(0.0)
        >>> stop(torch.zeros(2, 3, dtype=torch.long)).tolist()
        [True, True]
    """

    def __init__(self, seconds: float):
        if not seconds >= 0:
            raise ValueError(f"max_time must be a number of seconds >= 0, got {seconds}")
        self.seconds, self.start = seconds, time.time()

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor | None = None) -> torch.Tensor:
        done = time.time() - self.start > self.seconds
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)
