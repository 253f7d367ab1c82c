"""Whisper speech recognition: an audio encoder, and a text decoder that cross-attends to it.

The encoder runs once per clip. The decoder keeps its self-attention in any kvgen cache and
its cross-attention keys/values in the other half of an :class:`EncoderDecoderCache`: they
are computed on the first decoder step and read back afterwards. Module and tensor names
are transformers', so Hugging Face Whisper folders load as they are.

``generate`` runs the encoder, builds the decoder prompt and hands decoding to the generic
loop of :mod:`kvgen.generation.generate` through :class:`WhisperDecoderLM` (the decoder as a
causal LM over the stored encoder output).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from kvgen.cache import DynamicCache, StaticCache, create_cache
from kvgen.cache.encoder_decoder import EncoderDecoderCache, as_encoder_decoder_cache
from kvgen.config import PretrainedConfig
from kvgen.generation.config import DEFAULT_MAX_NEW_TOKENS, GenerationConfig
from kvgen.generation.generate import GenerationMixin
from kvgen.models.base import LayerMasks, PreTrainedModel, finish_cache, prepare_decoder_inputs
from kvgen.models.linear import Linear
from kvgen.models.llama import ACTIVATIONS
from kvgen.models.sdpa import scaled_dot_product_attention
from kvgen.outputs import BaseModelOutput, Seq2SeqLMOutput


class WhisperAttention(nn.Module):
    """Multi-head attention; ``k_proj`` has no bias. Self-attention (with a cache) or cross-attention."""

    def __init__(self, d_model: int, num_heads: int, layer_idx: int | None = None):
        super().__init__()
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by the number of heads ({num_heads})")
        self.num_heads, self.head_dim, self.layer_idx = num_heads, d_model // num_heads, layer_idx
        self.scaling = self.head_dim ** -0.5
        self.q_proj = Linear(d_model, d_model)
        self.k_proj = Linear(d_model, d_model, bias=False)
        self.v_proj = Linear(d_model, d_model)
        self.out_proj = Linear(d_model, d_model)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)

    def key_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._heads(self.k_proj(x)), self._heads(self.v_proj(x))

    def attend(self, x, k, v, mask=None, is_causal=False) -> torch.Tensor:
        q = self._heads(self.q_proj(x) * self.scaling)  # scaled before the product, as transformers does
        out = scaled_dot_product_attention(q, k, v, mask, is_causal, 1.0)
        return self.out_proj(out.transpose(1, 2).flatten(2))  # (B, T, d_model)

    def self_attention(self, x, masks: LayerMasks, cache, cache_position) -> torch.Tensor:
        k, v = self.key_values(x)
        mask, is_causal = masks(self.layer_idx, None)  # before the update: it asks the cache
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, {"cache_position": cache_position})
        return self.attend(x, k, v, mask, is_causal)

    def cross_attention(self, x, encoder_states, cache) -> torch.Tensor:
        if cache is not None and cache.cross_attention_filled(self.layer_idx):
            k, v = cache.cross_attention_states(self.layer_idx)
        else:
            k, v = self.key_values(encoder_states)  # (B, H, S, D)
            if cache is not None:
                k, v = cache.update_cross_attention(k, v, self.layer_idx)
        return self.attend(x, k, v)


class WhisperEncoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        d = config.d_model
        self.self_attn = WhisperAttention(d, config.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = Linear(d, config.encoder_ffn_dim), Linear(config.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = ACTIVATIONS[config.activation_function]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.self_attn_layer_norm(x)
        x = x + self.self_attn.attend(h, *self.self_attn.key_values(h))
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        if x.dtype == torch.float16:  # as transformers: keep float16 activations finite
            limit = torch.finfo(x.dtype).max - 1000
            x = x.clamp(-limit, limit)
        return x


class WhisperDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        d, heads = config.d_model, config.decoder_attention_heads
        self.self_attn = WhisperAttention(d, heads, layer_idx)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = WhisperAttention(d, heads, layer_idx)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = Linear(d, config.decoder_ffn_dim), Linear(config.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = ACTIVATIONS[config.activation_function]

    def forward(self, x, encoder_states, masks, cache, cache_position) -> torch.Tensor:
        x = x + self.self_attn.self_attention(self.self_attn_layer_norm(x), masks, cache, cache_position)
        x = x + self.encoder_attn.cross_attention(self.encoder_attn_layer_norm(x), encoder_states, cache)
        return x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """Log-mel features (B, num_mel_bins, 2 * max_source_positions) -> hidden states (B, max_source_positions, d)."""

    def __init__(self, config):
        super().__init__()
        d = config.d_model
        self.num_mel_bins, self.max_source_positions = config.num_mel_bins, config.max_source_positions
        self.conv1 = nn.Conv1d(config.num_mel_bins, d, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(d, d, kernel_size=3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(config.max_source_positions, d)
        self.layers = nn.ModuleList(WhisperEncoderLayer(config) for _ in range(config.encoder_layers))
        self.layer_norm = nn.LayerNorm(d)

    def forward(self, input_features: torch.Tensor) -> BaseModelOutput:
        frames = self.max_source_positions * self.conv1.stride[0] * self.conv2.stride[0]
        if input_features.dim() != 3 or input_features.shape[1:] != (self.num_mel_bins, frames):
            raise ValueError(
                f"input_features must have shape (batch, {self.num_mel_bins} mel bins, {frames} frames); got "
                f"{tuple(input_features.shape)}. Compute them with WhisperFeatureExtractor (it pads or cuts audio "
                "to 30 s) and split longer audio into 30 s windows."
            )
        x = F.gelu(self.conv1(input_features.to(self.conv1.weight.dtype)))
        x = F.gelu(self.conv2(x)).transpose(1, 2)  # (B, S, d)
        x = x + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        return BaseModelOutput(last_hidden_state=self.layer_norm(x))


class WhisperDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_positions = nn.Embedding(config.max_target_positions, config.d_model)
        self.layers = nn.ModuleList(WhisperDecoderLayer(config, i) for i in range(config.decoder_layers))
        self.layer_norm = nn.LayerNorm(config.d_model)


class WhisperModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.encoder = WhisperEncoder(config)
        self.decoder = WhisperDecoder(config)


class WhisperForConditionalGeneration(PreTrainedModel):
    """Whisper speech-to-text model with the Hugging Face API.

    Example:
        >>> from kvgen import AutoModelForSpeechSeq2Seq, DynamicCache, EncoderDecoderCache, StaticCache
        >>> model = AutoModelForSpeechSeq2Seq.from_pretrained("path/to/whisper-tiny.en")  # doctest: +SKIP
        >>> ids = model.generate(features, max_new_tokens=64)  # features: (B, 80, 3000)  # doctest: +SKIP
        >>> processor.batch_decode(ids, skip_special_tokens=True)                       # doctest: +SKIP
        >>> cache = EncoderDecoderCache(StaticCache(config=model.config, max_cache_len=448),  # doctest: +SKIP
        ...                             DynamicCache())
        >>> ids = model.generate(features, past_key_values=cache)                       # doctest: +SKIP
    """

    model_types = ("whisper",)
    main_input_name = "input_features"

    def __init__(self, config):
        super().__init__(config)
        self.model = WhisperModel(config)
        self.proj_out = Linear(config.d_model, config.vocab_size, bias=False)
        self.tie_weights()
        #: the decoder's sizes, for its self-attention caches
        self.decoder_config = PretrainedConfig(
            model_type="whisper_decoder", num_hidden_layers=config.decoder_layers, hidden_size=config.d_model,
            num_attention_heads=config.decoder_attention_heads, max_position_embeddings=config.max_target_positions,
            vocab_size=config.vocab_size, use_cache=config.get("use_cache", True))
        # what transformers' generation config takes from a Whisper config (generation_config.json replaces it)
        self.generation_config.extra.update({
            name: config.get(name) for name in ("decoder_start_token_id", "forced_decoder_ids")
            if config.get(name) is not None})
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            if config.get(name) is not None:
                setattr(self.generation_config, name, config.get(name))
        self.decoder_lm = WhisperDecoderLM(self)

    def tie_weights(self):
        if self.config.tie_word_embeddings:
            self.proj_out.weight = self.model.decoder.embed_tokens.weight

    @classmethod
    def convert_checkpoint(cls, state_dict, config):
        if config.tie_word_embeddings:
            state_dict.pop("proj_out.weight", None)
        return state_dict

    def get_encoder(self) -> WhisperEncoder:
        return self.model.encoder

    def _encoder_states(self, input_features, encoder_outputs) -> torch.Tensor | None:
        """(B, S, d) encoder output: ``encoder_outputs`` (tensor, tuple or output object), else the encoder's."""
        if encoder_outputs is not None:
            states = encoder_outputs if isinstance(encoder_outputs, torch.Tensor) else encoder_outputs[0]
            if states.dim() != 3 or states.shape[-1] != self.config.d_model:
                raise ValueError(f"encoder_outputs must be (batch, frames, {self.config.d_model}); got "
                                 f"{tuple(states.shape)}")
            return states
        return None if input_features is None else self.model.encoder(input_features).last_hidden_state

    def forward(self, input_features: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                decoder_input_ids: torch.LongTensor | None = None,
                decoder_attention_mask: torch.Tensor | None = None, encoder_outputs=None, past_key_values=None,
                decoder_inputs_embeds: torch.Tensor | None = None,
                decoder_position_ids: torch.LongTensor | None = None, cache_position: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int = 0, return_dict: bool = True) -> Seq2SeqLMOutput:
        """Decode ``decoder_input_ids`` against the encoder output of ``input_features`` (or ``encoder_outputs``).

        ``past_key_values``: an ``EncoderDecoderCache`` (created when none is passed and
        ``use_cache``), a plain cache (used for the self-attention) or a legacy tuple of
        4-tuples. Once its cross-attention is filled, ``input_features`` may be left out.
        A filled cache keeps its cross-attention: ``reset()`` it for another clip.
        ``attention_mask`` (a mask over the features) is accepted and unused, as in transformers;
        ``decoder_attention_mask`` is (batch, past + new) with 0 on padding.
        """
        if (decoder_input_ids is None) == (decoder_inputs_embeds is None):
            raise ValueError("pass exactly one of decoder_input_ids or decoder_inputs_embeds")
        encoder_states = self._encoder_states(input_features, encoder_outputs)
        decoder = self.model.decoder
        x = decoder.embed_tokens(decoder_input_ids) if decoder_inputs_embeds is None else decoder_inputs_embeds
        b, t = x.shape[:2]
        use_cache = self.config.get("use_cache", True) if use_cache is None else use_cache
        cache, legacy = as_encoder_decoder_cache(past_key_values) if use_cache else (None, False)
        if use_cache and cache is None:
            cache = EncoderDecoderCache(DynamicCache(config=self.decoder_config), DynamicCache())
        cache, _, cache_position, position_ids = prepare_decoder_inputs(
            self.decoder_config, decoder_input_ids, b, t, x.device, cache, use_cache, cache_position,
            decoder_position_ids, decoder_attention_mask)
        if encoder_states is None and (cache is None or not all(
                cache.cross_attention_filled(i) for i in range(len(decoder.layers)))):
            raise ValueError("pass input_features (or encoder_outputs): the decoder has no encoder output to attend to")
        if encoder_states is not None and encoder_states.shape[0] != b:
            raise ValueError(f"the encoder output has batch {encoder_states.shape[0]} but the decoder input {b}")
        if not torch.compiler.is_compiling() and int(position_ids.max()) >= self.config.max_target_positions:
            raise ValueError(f"decoder position {int(position_ids.max())} is past max_target_positions "
                             f"({self.config.max_target_positions}): Whisper decodes at most that many tokens")
        x = x + decoder.embed_positions(position_ids)  # (B, T, d)
        masks = LayerMasks(cache, cache_position, decoder_attention_mask)
        for layer in decoder.layers:
            x = layer(x, encoder_states, masks, cache, cache_position)
        logits = self.proj_out(decoder.layer_norm(x[:, -logits_to_keep:] if logits_to_keep else x))
        out = Seq2SeqLMOutput(logits=logits, past_key_values=finish_cache(cache, legacy),
                              encoder_last_hidden_state=encoder_states)
        return out if return_dict else out.to_tuple()

    # -- generation --------------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_features: torch.Tensor | None = None, generation_config: GenerationConfig | None = None,
                 streamer=None, *, inputs: torch.Tensor | None = None, encoder_outputs=None,
                 decoder_input_ids: torch.LongTensor | None = None, decoder_attention_mask: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, past_key_values=None, language: str | None = None,
                 task: str | None = None, return_timestamps: bool | None = None,
                 suppress_tokens: list[int] | None = None, begin_suppress_tokens: list[int] | None = None, **kwargs):
        """Transcribe clips of at most 30 s: greedy, sampling or beam search, with any self-attention cache.

        Keyword arguments are generation settings (``max_new_tokens``, ``do_sample``,
        ``eos_token_id``, ``cache_implementation``, ``return_dict_in_generate`` ...);
        ``suppress_tokens``/``begin_suppress_tokens`` replace the generation config's. The prompt
        is ``decoder_input_ids`` or the model's: ``decoder_start_token_id``, the forced ids
        (``language``/``task`` for multilingual models) and ``<|notimestamps|>``. A passed
        ``past_key_values`` is reset and filled (the decoder's states depend on the audio).
        As in transformers, the plain result holds the generated ids without the prompt and
        the final EOS; ``return_dict_in_generate=True`` gives the whole sequences.
        """
        if inputs is not None:
            if input_features is not None:
                raise ValueError("pass input_features or inputs (the same thing), not both")
            input_features = inputs
        del attention_mask  # a mask over the features: Whisper attends to every frame (as transformers)
        config = (generation_config or self.generation_config).copy().fill_unset(self.generation_config)
        config.extra = {**self.generation_config.extra, **config.extra}  # (Whisper's settings: prompt, suppression)
        unknown = config.update(**kwargs)
        if unknown:
            raise TypeError(f"generate() got arguments it does not know: {sorted(unknown)}")
        config.fill_unset()
        if return_timestamps or (return_timestamps is None and config.extra.get("return_timestamps")):
            raise NotImplementedError("return_timestamps=True (timestamp tokens, long-form audio) is not supported")
        encoder_states = self._encoder_states(input_features, encoder_outputs)
        if encoder_states is None:
            raise ValueError("pass input_features (batch, num_mel_bins, frames) or encoder_outputs")
        batch = encoder_states.shape[0]
        if decoder_input_ids is None:
            decoder_input_ids = self._decoder_prompt(config, language, task).to(encoder_states.device)
            decoder_input_ids = decoder_input_ids.expand(batch, -1)
        prompt_length = decoder_input_ids.shape[1]
        config.max_new_tokens = self._max_length(config, prompt_length) - prompt_length
        config.max_length = None
        if past_key_values is not None and "cache_implementation" in kwargs:
            raise ValueError("pass either past_key_values or cache_implementation, not both")
        cache, legacy = self._generation_cache(config, past_key_values, batch, prompt_length + config.max_new_tokens,
                                               encoder_states.shape[1])
        config.return_legacy_cache = config.return_legacy_cache or legacy
        if suppress_tokens is not None:
            config.suppress_tokens = suppress_tokens
        if begin_suppress_tokens is not None:
            config.begin_suppress_tokens = begin_suppress_tokens
        with self.decoder_lm.decoding(encoder_states):
            out = self.decoder_lm.generate(decoder_input_ids, generation_config=config, streamer=streamer,
                                           attention_mask=decoder_attention_mask, past_key_values=cache)
        if config.return_dict_in_generate:
            return out
        return self._transcription_ids(out, prompt_length, config)

    def _decoder_prompt(self, config: GenerationConfig, language: str | None, task: str | None) -> torch.Tensor:
        """(1, n) ids: the start token, the language and task (or the forced ids), ``<|notimestamps|>``."""
        extra = config.extra
        start = extra.get("decoder_start_token_id", self.config.get("decoder_start_token_id"))
        if start is None:
            raise ValueError("the generation config has no decoder_start_token_id; pass decoder_input_ids")
        tokens = [start]
        lang_to_id, task_to_id = extra.get("lang_to_id") or {}, extra.get("task_to_id") or {}
        if language is not None or task is not None:
            if language is None or not lang_to_id or not extra.get("is_multilingual", True):
                raise ValueError("language= (and task=) need a multilingual model, and task= needs language= "
                                 "(language detection is not implemented)")
            name = language if language in lang_to_id else f"<|{language.lower()}|>"
            if name not in lang_to_id:
                raise ValueError(f"unknown language {language!r}; known: {', '.join(sorted(lang_to_id))}")
            tokens += [lang_to_id[name], task_to_id[task or "transcribe"]]
        else:
            forced = extra.get("forced_decoder_ids") or self.config.get("forced_decoder_ids") or []
            for i, (index, token) in enumerate(forced, start=1):
                if index != i:
                    raise ValueError(f"forced_decoder_ids {forced} must give positions 1, 2, ... in order")
                tokens.append(token)
            if lang_to_id and (len(tokens) < 2 or tokens[1] is None):
                raise NotImplementedError("language detection is not implemented: pass language='en' (for "
                                          "example) or decoder_input_ids")
        no_timestamps = extra.get("no_timestamps_token_id")
        if no_timestamps is not None and tokens[-1] != no_timestamps:
            tokens.append(no_timestamps)
        return torch.tensor([[t for t in tokens if t is not None]], dtype=torch.long)

    def _max_length(self, config: GenerationConfig, prompt_length: int) -> int:
        """Total decoder length to stop at, by transformers' Whisper rules (within ``max_target_positions``)."""
        limit = self.config.max_target_positions
        if config.max_new_tokens is not None:
            if prompt_length + config.max_new_tokens > limit:
                raise ValueError(
                    f"the decoder prompt ({prompt_length} tokens) plus max_new_tokens ({config.max_new_tokens}) "
                    f"exceeds max_target_positions ({limit}); reduce max_new_tokens to {limit - prompt_length}")
            return prompt_length + config.max_new_tokens
        max_length = config.max_length if config.max_length is not None else DEFAULT_MAX_NEW_TOKENS
        return min(max_length + min(limit // 2 - 1, prompt_length), limit)  # max_length counts no prompt

    def _generation_cache(self, config: GenerationConfig, past_key_values, batch: int, max_length: int,
                          encoder_length: int) -> tuple[EncoderDecoderCache | None, bool]:
        """The cache ``generate`` fills: the one passed (reset), or a new one of ``cache_implementation``.

        A new preallocated self-attention half gets a preallocated cross-attention half (static
        shapes throughout a decode step); any other gets a dynamic one.
        """
        if not config.use_cache:
            return None, False
        if past_key_values is not None:
            cache, legacy = as_encoder_decoder_cache(past_key_values)
            cache.reset()
            return cache, legacy
        # (batch: the prompt is prefilled once per clip; beams and returned sequences repeat its rows)
        own = create_cache(config.cache_implementation or "dynamic", config=self.decoder_config, batch_size=batch,
                           max_cache_len=max_length, device=self.device, dtype=self.dtype,
                           cache_config=config.cache_config)
        cross = (StaticCache(config=self.decoder_config, max_batch_size=batch, max_cache_len=encoder_length,
                             device=self.device, dtype=self.dtype)
                 if own.is_compileable else DynamicCache(config=self.decoder_config))
        return EncoderDecoderCache(own, cross), False

    @staticmethod
    def _transcription_ids(sequences: torch.Tensor, prompt_length: int, config: GenerationConfig) -> torch.Tensor:
        """The generated ids up to (not including) each row's first EOS, right-padded (transformers' short-form)."""
        generated = sequences[:, prompt_length:]
        lengths = torch.full((generated.shape[0],), generated.shape[1], device=generated.device)
        if config.eos_ids():
            ends = torch.isin(generated, torch.tensor(config.eos_ids(), device=generated.device))  # (B, new)
            lengths = torch.where(ends.any(1), ends.int().argmax(1), lengths)
        width = int(lengths.max()) if lengths.numel() else 0
        pad = config.pad_token_id if config.pad_token_id is not None else (config.eos_ids() or [0])[0]
        out = generated[:, :width].clone()
        out[torch.arange(width, device=out.device)[None] >= lengths[:, None]] = pad
        return out


class WhisperDecoderLM(GenerationMixin):
    """The Whisper decoder as a causal LM over a fixed encoder output: what the generic loop drives.

    ``WhisperForConditionalGeneration.generate`` sets the encoder output for one call; each
    forward pass decodes against it.
    """

    def __init__(self, model: WhisperForConditionalGeneration):
        self.model, self.config = model, model.decoder_config
        self.encoder_hidden_states: torch.Tensor | None = None  # (B, S, d)

    generation_config = property(lambda self: self.model.generation_config)
    device = property(lambda self: self.model.device)
    dtype = property(lambda self: self.model.dtype)

    @contextlib.contextmanager
    def decoding(self, encoder_states: torch.Tensor):
        """Inside this context, decode against ``encoder_states`` (B, S, d)."""
        self.encoder_hidden_states = encoder_states
        try:
            yield self
        finally:
            self.encoder_hidden_states = None

    def __call__(self, *args, **kwargs):
        return self.forward(*args, **kwargs)

    def forward(self, input_ids: torch.LongTensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values=None,
                cache_position: torch.LongTensor | None = None, use_cache: bool | None = None,
                logits_to_keep: int = 0) -> Seq2SeqLMOutput:
        states = self.encoder_hidden_states  # (set by WhisperForConditionalGeneration.generate)
        if past_key_values is not None and all(past_key_values.cross_attention_filled(i)
                                               for i in range(self.config.num_hidden_layers)):
            states = None  # the cross-attention reads its cache
        elif states.shape[0] != input_ids.shape[0]:  # beams / returned sequences: the rows of a clip are adjacent
            states = states.repeat_interleave(input_ids.shape[0] // states.shape[0], dim=0)
        return self.model(encoder_outputs=states, decoder_input_ids=input_ids, decoder_attention_mask=attention_mask,
                          decoder_position_ids=position_ids, past_key_values=past_key_values,
                          cache_position=cache_position, use_cache=use_cache, logits_to_keep=logits_to_keep)
