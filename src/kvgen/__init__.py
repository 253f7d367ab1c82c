"""kvgen: key-value-cached text generation with the Hugging Face cache API."""

from kvgen.cache import (Cache, CacheLayer, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, HQQQuantizedCache,
                         HybridCache, OffloadedCache, OffloadedStaticCache, QuantizedCache, QuantizedCacheConfig,
                         QuantoQuantizedCache, SinkCache, SinkLayer, SlidingWindowCache, SlidingWindowLayer,
                         StaticCache, StaticLayer, StaticSinkCache, StaticSinkLayer, cache_implementations,
                         enable_offloading, infer_device)
from kvgen.config import AutoConfig, PretrainedConfig
from kvgen.generation.config import GenerationConfig
from kvgen.generation.streamers import TextStreamer
from kvgen.models import AutoModelForCausalLM
from kvgen.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from kvgen.models.llama import (LlamaForCausalLM, MistralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM,
                                Qwen3ForCausalLM)
from kvgen.tokenizer import AutoTokenizer, BatchEncoding, PreTrainedTokenizerFast

__all__ = [
    "AutoConfig", "AutoModelForCausalLM", "AutoTokenizer", "BatchEncoding", "Cache", "CacheLayer", "DynamicCache",
    "DynamicLayer", "DynamicSlidingWindowLayer", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GemmaForCausalLM",
    "GenerationConfig", "HQQQuantizedCache", "HybridCache", "LlamaForCausalLM", "MistralForCausalLM",
    "OffloadedCache", "OffloadedStaticCache", "Phi3ForCausalLM", "PreTrainedTokenizerFast", "PretrainedConfig",
    "QuantizedCache", "QuantizedCacheConfig", "QuantoQuantizedCache", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "SinkCache", "SinkLayer", "SlidingWindowCache", "SlidingWindowLayer", "StaticCache", "StaticLayer",
    "StaticSinkCache", "StaticSinkLayer", "TextStreamer", "cache_implementations", "enable_offloading",
    "infer_device",
]
