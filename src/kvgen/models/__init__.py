"""Model registry: ``model_type`` -> model class, and ``AutoModelForCausalLM``."""

from __future__ import annotations

from kvgen.config import PretrainedConfig
from kvgen.models.base import PreTrainedModel
from kvgen.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from kvgen.models.llama import (LlamaForCausalLM, MistralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM,
                                Qwen3ForCausalLM)

CAUSAL_LM_CLASSES: dict[str, type[PreTrainedModel]] = {
    model_type: cls
    for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM,
                Gemma2ForCausalLM, Gemma3ForCausalLM)
    for model_type in cls.model_types
}


class AutoModelForCausalLM(PreTrainedModel):
    """Loads the causal language model class that a checkpoint's ``model_type`` names.

    Example:
        >>> model = AutoModelForCausalLM.from_pretrained("path/to/folder", dtype=torch.float32)  # doctest: +SKIP
        >>> model = AutoModelForCausalLM.from_pretrained(folder, gguf_file="model.gguf")         # doctest: +SKIP
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("AutoModelForCausalLM is not instantiated; use AutoModelForCausalLM.from_pretrained(path)")

    @classmethod
    def _class_for(cls, config: PretrainedConfig) -> type[PreTrainedModel]:
        try:
            return CAUSAL_LM_CLASSES[config.model_type]
        except KeyError:
            raise ValueError(
                f"model_type {config.model_type!r} is not supported; kvgen loads: {', '.join(sorted(CAUSAL_LM_CLASSES))}"
            ) from None

    @classmethod
    def from_config(cls, config: PretrainedConfig, dtype=None) -> PreTrainedModel:
        """A randomly initialised model for ``config`` (for tests and experiments)."""
        model = cls._class_for(config)(config)
        return model.to(dtype) if dtype is not None else model
