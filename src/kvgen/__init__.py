"""kvgen: key-value-cached text generation with the Hugging Face cache API."""

from kvgen.audio import WhisperFeatureExtractor, WhisperProcessor
from kvgen.cache import (Cache, CacheLayer, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer, EncoderDecoderCache,
                         HQQQuantizedCache, HybridCache, HybridMambaAttentionDynamicCache, MambaCache,
                         OffloadedCache, OffloadedStaticCache, QuantizedCache,
                         QuantizedCacheConfig, QuantoQuantizedCache, SinkCache, SinkLayer, SlidingWindowCache,
                         SlidingWindowLayer, StaticCache, StaticLayer, StaticSinkCache, StaticSinkLayer,
                         cache_implementations, enable_offloading, infer_device, load_cache)
from kvgen.config import AutoConfig, PretrainedConfig
from kvgen.generation.config import GenerationConfig
from kvgen.generation.streamers import TextStreamer
from kvgen.grammar import GrammarError, GrammarLogitsProcessor, JsonSchemaLogitsProcessor
from kvgen.loading.errors import ModelFileError
from kvgen.models import AutoModelForCausalLM, AutoModelForSpeechSeq2Seq
from kvgen.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, GemmaForCausalLM
from kvgen.models.jamba import JambaConfig, JambaForCausalLM
from kvgen.models.llama import (LlamaForCausalLM, MistralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM,
                                Qwen3ForCausalLM)
from kvgen.models.mamba import MambaConfig, MambaForCausalLM
from kvgen.models.whisper import WhisperForConditionalGeneration
from kvgen.quantization import TorchAoConfig
from kvgen.tokenizer import AutoTokenizer, BatchEncoding, PreTrainedTokenizerFast

__all__ = [
    "AutoConfig", "AutoModelForCausalLM", "AutoModelForSpeechSeq2Seq", "AutoTokenizer", "BatchEncoding", "Cache",
    "CacheLayer", "DynamicCache", "DynamicLayer", "DynamicSlidingWindowLayer", "EncoderDecoderCache",
    "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GemmaForCausalLM",
    "GenerationConfig", "GrammarError", "GrammarLogitsProcessor", "HQQQuantizedCache", "HybridCache", "HybridMambaAttentionDynamicCache", "JambaConfig",
    "JambaForCausalLM", "JsonSchemaLogitsProcessor", "LlamaForCausalLM", "MambaCache", "MambaConfig", "MambaForCausalLM", "MistralForCausalLM", "ModelFileError",
    "OffloadedCache", "OffloadedStaticCache", "Phi3ForCausalLM", "PreTrainedTokenizerFast", "PretrainedConfig",
    "QuantizedCache", "QuantizedCacheConfig", "QuantoQuantizedCache", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
    "SinkCache", "SinkLayer", "SlidingWindowCache", "SlidingWindowLayer", "StaticCache", "StaticLayer",
    "StaticSinkCache", "StaticSinkLayer", "TextStreamer", "TorchAoConfig", "WhisperFeatureExtractor", "WhisperForConditionalGeneration",
    "WhisperProcessor", "cache_implementations", "enable_offloading", "infer_device", "load_cache",
]
