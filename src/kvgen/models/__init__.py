"""Model registry: ``model_type`` -> model class, ``AutoModelForCausalLM`` and ``AutoModelForSpeechSeq2Seq``."""

from __future__ import annotations

from kvgen.config import PretrainedConfig
from kvgen.models.base import PreTrainedModel
from kvgen.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from kvgen.models.llama import (LlamaForCausalLM, MistralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM,
                                Qwen3ForCausalLM)
from kvgen.models.jamba import JambaForCausalLM
from kvgen.models.mamba import MambaForCausalLM
from kvgen.models.whisper import WhisperForConditionalGeneration

CAUSAL_LM_CLASSES: dict[str, type[PreTrainedModel]] = {
    model_type: cls
    for cls in (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Phi3ForCausalLM,
                Gemma2ForCausalLM, Gemma3ForCausalLM, MambaForCausalLM, JambaForCausalLM)
    for model_type in cls.model_types
}
SPEECH_SEQ2SEQ_CLASSES: dict[str, type[PreTrainedModel]] = {"whisper": WhisperForConditionalGeneration}


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


class AutoModelForSpeechSeq2Seq(AutoModelForCausalLM):
    """Loads the speech-to-text model class that a checkpoint's ``model_type`` names (Whisper).

    Example:
        >>> model = AutoModelForSpeechSeq2Seq.from_pretrained("path/to/whisper-tiny.en")  # doctest: +SKIP
        >>> ids = model.generate(input_features, max_new_tokens=64)                     # doctest: +SKIP
    """

    def __init__(self, *args, **kwargs):
        raise TypeError("AutoModelForSpeechSeq2Seq is not instantiated; use AutoModelForSpeechSeq2Seq.from_pretrained")

    @classmethod
    def _class_for(cls, config: PretrainedConfig) -> type[PreTrainedModel]:
        try:
            return SPEECH_SEQ2SEQ_CLASSES[config.model_type]
        except KeyError:
            raise ValueError(
                f"model_type {config.model_type!r} is not a speech-to-text model kvgen supports; it loads: "
                f"{', '.join(sorted(SPEECH_SEQ2SEQ_CLASSES))}"
            ) from None
