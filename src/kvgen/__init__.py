"""kvgen: key-value-cached text generation with the Hugging Face cache API."""

from kvgen.cache import (Cache, CacheLayer, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, StaticCache,
                         StaticLayer, cache_implementations)
from kvgen.config import AutoConfig, PretrainedConfig
from kvgen.generation.config import GenerationConfig
from kvgen.generation.streamers import TextStreamer
from kvgen.models import AutoModelForCausalLM
from kvgen.models.llama import (LlamaForCausalLM, MistralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM,
                                Qwen3ForCausalLM)
from kvgen.tokenizer import AutoTokenizer, BatchEncoding, PreTrainedTokenizerFast

__all__ = [
    "AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "BatchEncoding", "Cache", "CacheLayer", "DynamicCache",
    "DynamicLayer", "DynamicSlidingWindowLayer", "GenerationConfig", "LlamaForCausalLM", "MistralForCausalLM",
    "Phi3ForCausalLM", "PreTrainedTokenizerFast", "PretrainedConfig", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "StaticCache", "StaticLayer", "TextStreamer", "cache_implementations",
]
