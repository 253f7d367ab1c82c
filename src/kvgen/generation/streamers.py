"""Streamers print tokens as ``generate()`` produces them."""

from __future__ import annotations

import sys
import time


class TextStreamer:
    """Prints text to stdout as soon as it forms whole words (or on newline / end).

    Example:
        >>> streamer = TextStreamer(tokenizer, skip_prompt=True)        # doctest: +SKIP
        >>> model.generate(**inputs, streamer=streamer, max_new_tokens=20)  # doctest: +SKIP
    """

    def __init__(self, tokenizer, skip_prompt: bool = False, file=None, **decode_kwargs):
        self.tokenizer, self.skip_prompt, self.decode_kwargs = tokenizer, skip_prompt, decode_kwargs
        self.file = file
        self.token_cache: list[int] = []
        self.print_len = 0
        self.next_tokens_are_prompt = True

    def put(self, value) -> None:
        if value.dim() > 1:
            if value.shape[0] > 1:
                raise ValueError("TextStreamer only supports batch size 1")
            value = value[0]
        if self.skip_prompt and self.next_tokens_are_prompt:
            self.next_tokens_are_prompt = False
            return
        self.next_tokens_are_prompt = False
        self.token_cache.extend(value.tolist())
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs)
        if text.endswith("\n"):
            printable, self.token_cache, self.print_len = text[self.print_len:], [], 0
        elif text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            printable = ""
        else:
            cut = text.rfind(" ") + 1
            printable = text[self.print_len:cut] if cut > self.print_len else ""
            self.print_len += len(printable)
        self.on_finalized_text(printable)

    def end(self) -> None:
        text = self.tokenizer.decode(self.token_cache, **self.decode_kwargs) if self.token_cache else ""
        printable = text[self.print_len:]
        self.token_cache, self.print_len, self.next_tokens_are_prompt = [], 0, True
        self.on_finalized_text(printable, stream_end=True)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        out = self.file or sys.stdout
        print(text, file=out, flush=True, end="" if not stream_end else "\n")


class TokenTimer:
    """A streamer that timestamps each ``put`` and passes it on to ``then`` (another streamer, or none).

    ``generate()`` puts the prompt first, then each step's new tokens, so the second stamp ends the prefill.

    Example:
        >>> timer = TokenTimer()
        >>> _ = model.generate(ids, max_new_tokens=8, streamer=timer)          # doctest: +SKIP
        >>> timer.prefill_seconds(), timer.decode_tokens_per_second()          # doctest: +SKIP
    """

    def __init__(self, then=None):
        self.then = then
        self.start = time.perf_counter()
        self.stamps: list[float] = []
        self.counts: list[int] = []  # tokens per put (speculative decoding puts several at once)

    def put(self, value):
        if self.then is not None:
            self.then.put(value)
        self.stamps.append(time.perf_counter())
        self.counts.append(value.numel())

    def end(self):
        if self.then is not None:
            self.then.end()

    def prefill_seconds(self) -> float:
        """From the timer's creation to the first new tokens."""
        return self.stamps[1] - self.start if len(self.stamps) > 1 else float("nan")

    def decode_tokens_per_second(self) -> float:
        """New tokens after the first ones, over the time from the first to the last."""
        return sum(self.counts[2:]) / (self.stamps[-1] - self.stamps[1]) if len(self.stamps) > 2 else float("nan")
