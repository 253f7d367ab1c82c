"""``GenerationConfig``: the knobs of ``generate()``, with transformers' defaults and precedence."""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any


#: transformers' global defaults, for settings left unset by the call, a passed config and the model's config.
#: ``max_length`` has none here: unset, ``generate()`` makes 20 new tokens (as transformers does).
DEFAULTS: dict[str, Any] = {
    "min_length": 0, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "repetition_penalty": 1.0,
    "num_beams": 1, "num_beam_groups": 1, "diversity_penalty": 0.0, "length_penalty": 1.0, "early_stopping": False,
    "num_return_sequences": 1, "use_cache": True, "return_dict_in_generate": False, "output_scores": False,
    "output_logits": False, "return_legacy_cache": False, "disable_compile": False,
}
DEFAULT_MAX_NEW_TOKENS = 20


@dataclass
class GenerationConfig:
    """Settings for ``generate()``; keyword arguments of ``generate()`` override them.

    As in transformers, a setting left ``None`` is taken from ``model.generation_config``
    (which ``generation_config.json`` sets), then from ``DEFAULTS``.

    Example:
        >>> cfg = GenerationConfig(max_new_tokens=20, do_sample=True, top_p=0.9)
        >>> cfg.update(temperature=0.7, attention_mask=None)  # returns what is not a generation setting
        {'attention_mask': None}
    """

    # ``None`` means unset: ``generate()`` takes it from ``model.generation_config``, then from ``DEFAULTS``.
    max_length: int | None = None
    max_new_tokens: int | None = None
    min_length: int | None = None
    min_new_tokens: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    repetition_penalty: float | None = None
    no_repeat_ngram_size: int | None = None  # no n-gram of this size twice
    bad_words_ids: list[list[int]] | None = None  # token sequences never completed
    sequence_bias: dict | list | None = None  # {(token ids...): bias} added where a sequence would complete
    forced_bos_token_id: int | None = None  # the first token, after a one-token prompt
    forced_eos_token_id: int | list[int] | None = None  # the last token, at max_length
    renormalize_logits: bool | None = None  # scores log-softmaxed after every processor
    remove_invalid_values: bool | None = None  # nan scores become 0, infinite ones the dtype's largest / smallest
    exponential_decay_length_penalty: tuple[int, float] | None = None  # (start, factor): EOS favoured after start
    num_beams: int | None = None
    num_beam_groups: int | None = None
    diversity_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    num_return_sequences: int | None = None
    use_cache: bool | None = None
    cache_implementation: str | None = None
    cache_config: Any = None
    return_dict_in_generate: bool | None = None
    output_scores: bool | None = None
    output_logits: bool | None = None
    return_legacy_cache: bool | None = None
    disable_compile: bool | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    suppress_tokens: list[int] | None = None  # never generated (Whisper's generation config sets these)
    begin_suppress_tokens: list[int] | None = None  # not generated as the first new token
    stop_strings: str | list[str] | None = None  # a row stops once its text holds one (needs tokenizer=)
    max_time: float | None = None  # seconds after which every row stops
    # speculative decoding (kvgen.generation.speculative): one drafter at a time
    prompt_lookup_num_tokens: int | None = None  # draft this many tokens by n-gram lookup in the sequence
    max_matching_ngram_size: int | None = None  # longest n-gram looked up (default 2)
    assistant_early_exit: int | None = None  # draft with the model's first layers
    num_assistant_tokens: int | None = None  # tokens an assistant model drafts per step (default 20)
    num_assistant_tokens_schedule: str | None = None  # "adaptive" (default), "constant", "heuristic"...
    assistant_confidence_threshold: float | None = None  # the assistant stops drafting below this probability
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

    def fill_unset(self, source: "GenerationConfig | None" = None) -> "GenerationConfig":
        """Set the settings that are still ``None`` from ``source``, or from ``DEFAULTS`` without one; return self."""
        for f in fields(self):
            if f.name != "extra" and getattr(self, f.name) is None:
                value = DEFAULTS.get(f.name) if source is None else getattr(source, f.name)
                setattr(self, f.name, copy.deepcopy(value))
        return self

    def eos_ids(self) -> list[int]:
        eos = self.eos_token_id
        return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

    def validate(self) -> None:
        c = self.copy().fill_unset()  # settings still None are off
        sampling = bool(c.do_sample)  # like transformers, greedy decoding ignores the sampling settings
        checks = [
            (c.max_new_tokens is None or c.max_new_tokens > 0, f"max_new_tokens must be > 0, got {c.max_new_tokens}"),
            (not sampling or c.temperature is None or c.temperature > 0,
             f"temperature must be > 0 with do_sample=True, got {c.temperature} "
             "(use do_sample=False for greedy decoding)"),
            (not sampling or c.top_p is None or 0 < c.top_p <= 1, f"top_p must be in (0, 1], got {c.top_p}"),
            (not sampling or c.min_p is None or 0 <= c.min_p <= 1, f"min_p must be in [0, 1], got {c.min_p}"),
            (c.top_k is None or c.top_k >= 0, f"top_k must be >= 0, got {c.top_k}"),
            (c.repetition_penalty is None or c.repetition_penalty > 0,
             f"repetition_penalty must be > 0, got {c.repetition_penalty}"),
            (c.no_repeat_ngram_size is None or c.no_repeat_ngram_size >= 0,
             f"no_repeat_ngram_size must be >= 0, got {c.no_repeat_ngram_size}"),
            (c.exponential_decay_length_penalty is None or _decay_pair(c.exponential_decay_length_penalty),
             "exponential_decay_length_penalty must be (start_index, decay_factor): new tokens >= 0 and a factor "
             f"> 0, got {c.exponential_decay_length_penalty!r}"),
            (c.exponential_decay_length_penalty is None or c.eos_ids(),
             "exponential_decay_length_penalty favours the end-of-sequence token: set eos_token_id"),
            (c.num_return_sequences >= 1, "num_return_sequences must be >= 1"),
            (sampling or c.num_beams > 1 or c.num_return_sequences == 1,
             "num_return_sequences > 1 needs do_sample=True or num_beams > 1 (greedy decoding gives identical "
             "sequences)"),
            (c.num_beams >= 1 and c.num_beam_groups >= 1, "num_beams and num_beam_groups must be >= 1"),
            (c.num_beams == 1 or c.num_return_sequences <= c.num_beams,
             f"num_return_sequences ({c.num_return_sequences}) must be <= num_beams ({c.num_beams})"),
            (c.num_beams % c.num_beam_groups == 0,
             f"num_beams ({c.num_beams}) must be a multiple of num_beam_groups ({c.num_beam_groups})"),
            (c.num_beam_groups == 1 or c.diversity_penalty > 0,
             "group beam search (num_beam_groups > 1) needs diversity_penalty > 0, or the groups are identical"),
            (c.num_beam_groups > 1 or not c.diversity_penalty,
             "diversity_penalty works between beam groups: set num_beam_groups > 1 (and num_beams a multiple of it)"),
            (c.early_stopping in (True, False, "never"),
             f"early_stopping must be True, False or 'never', got {c.early_stopping!r}"),
            (c.prompt_lookup_num_tokens is None or c.prompt_lookup_num_tokens > 0,
             f"prompt_lookup_num_tokens must be > 0, got {c.prompt_lookup_num_tokens}"),
            (c.max_matching_ngram_size is None or c.max_matching_ngram_size > 0,
             f"max_matching_ngram_size must be > 0, got {c.max_matching_ngram_size}"),
            (c.assistant_early_exit is None or c.assistant_early_exit > 0,
             f"assistant_early_exit must be a number of layers > 0, got {c.assistant_early_exit}"),
            (c.num_assistant_tokens is None or c.num_assistant_tokens > 0,
             f"num_assistant_tokens must be > 0, got {c.num_assistant_tokens}"),
            (c.num_assistant_tokens_schedule in (None, "adaptive", "constant", "heuristic", "heuristic_transient"),
             "num_assistant_tokens_schedule must be 'adaptive', 'constant', 'heuristic' or 'heuristic_transient', got "
             f"{c.num_assistant_tokens_schedule!r}"),
            (c.assistant_confidence_threshold is None or 0 <= c.assistant_confidence_threshold < 1,
             f"assistant_confidence_threshold must be in [0, 1), got {c.assistant_confidence_threshold}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"invalid generation setting: {message}")


def _decay_pair(value) -> bool:
    """Whether ``value`` is a ``(start_index, decay_factor)`` pair: an int >= 0 and a number > 0."""
    return (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[0], int) and value[0] >= 0
            and isinstance(value[1], (int, float)) and value[1] > 0)
