"""``GenerationConfig``: the knobs of ``generate()``, with transformers' defaults."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass
class GenerationConfig:
    """Settings for ``generate()``; keyword arguments of ``generate()`` override them.

    Example:
        >>> cfg = GenerationConfig(max_new_tokens=20, do_sample=True, top_p=0.9)
        >>> cfg.update(temperature=0.7, attention_mask=None)  # returns what is not a generation setting
        {'attention_mask': None}
    """

    max_length: int = 20
    max_new_tokens: int | None = None
    min_length: int = 0
    min_new_tokens: int | None = None
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    num_beams: int = 1
    num_beam_groups: int = 1
    diversity_penalty: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1
    use_cache: bool = True
    cache_implementation: str | None = None
    cache_config: Any = None
    return_dict_in_generate: bool = False
    output_scores: bool = False
    output_logits: bool = False
    return_legacy_cache: bool = False
    disable_compile: bool = False
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GenerationConfig":
        known = {f.name for f in fields(cls)} - {"extra"}
        config = cls(**{k: v for k, v in data.items() if k in known})
        config.extra = {k: v for k, v in data.items() if k not in known}
        return config

    @classmethod
    def from_model_config(cls, model_config) -> "GenerationConfig":
        return cls(**{k: model_config.get(k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")})

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "GenerationConfig":
        with open(os.path.join(folder, "generation_config.json"), encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        return data

    def update(self, **kwargs: Any) -> dict[str, Any]:
        """Set the generation settings among ``kwargs``; return the others."""
        known = {f.name for f in fields(self)} - {"extra"}
        for key in [k for k in kwargs if k in known]:
            setattr(self, key, kwargs.pop(key))
        return kwargs

    def copy(self) -> "GenerationConfig":
        return copy.deepcopy(self)

    def eos_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def validate(self) -> None:
        checks = [
            (self.max_new_tokens is None or self.max_new_tokens >= 0, "max_new_tokens must be >= 0"),
            (self.temperature > 0, "temperature must be > 0 (use do_sample=False for greedy decoding)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k is None or self.top_k >= 0, "top_k must be >= 0"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.num_return_sequences >= 1, "num_return_sequences must be >= 1"),
            (self.do_sample or self.num_beams > 1 or self.num_return_sequences == 1,
             "num_return_sequences > 1 needs do_sample=True (greedy decoding gives identical sequences)"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid generation setting: {message}")
