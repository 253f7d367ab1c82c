"""Choosing the next token from processed scores: greedy or sampling."""

from __future__ import annotations

import torch


def choose_next_tokens(scores: torch.Tensor, do_sample: bool) -> torch.Tensor:
    """(B, V) processed scores -> (B,) token ids: argmax, or a draw from softmax(scores)."""
    if do_sample:
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    return torch.argmax(scores, dim=-1)
