"""Output containers with attribute, key and index access, like transformers' ``ModelOutput``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch


class ModelOutput:
    """Dataclass base: ``out.logits``, ``out["logits"]`` and ``out[0]`` (first non-None field)."""

    def to_tuple(self) -> tuple[Any, ...]:
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None)

    def __getitem__(self, key):
        if isinstance(key, str):
            return getattr(self, key)
        return self.to_tuple()[key]

    def __contains__(self, key: str) -> bool:
        return getattr(self, key, None) is not None

    def keys(self):
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]


@dataclass
class CausalLMOutputWithPast(ModelOutput):
    logits: torch.Tensor | None = None
    past_key_values: Any = None
    loss: torch.Tensor | None = None


@dataclass
class BaseModelOutput(ModelOutput):
    last_hidden_state: torch.Tensor | None = None


@dataclass
class Seq2SeqLMOutput(ModelOutput):
    logits: torch.Tensor | None = None
    past_key_values: Any = None
    encoder_last_hidden_state: torch.Tensor | None = None
    loss: torch.Tensor | None = None


@dataclass
class GenerateDecoderOnlyOutput(ModelOutput):
    sequences: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    past_key_values: Any = None
    speculation: Any = None  # SpeculationStats of speculative decoding (kvgen only)


@dataclass
class GenerateBeamDecoderOnlyOutput(ModelOutput):
    sequences: torch.Tensor | None = None
    sequences_scores: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    beam_indices: torch.Tensor | None = None
    past_key_values: Any = None
