"""``generate()``: cache setup, prefill of the unseen tokens, then the decode loop.

Generation owns the positions: ``cache_position`` indexes the cache timeline (padding
counted), ``position_ids`` come from the attention mask (so left padding works), and
only the tokens that the cache has not seen yet are fed.
"""

from __future__ import annotations

import contextlib
import warnings

import torch

from kvgen.cache.base import Cache
from kvgen.cache.dynamic import as_cache
from kvgen.cache.fingerprint import check_cache_model
from kvgen.cache.registry import create_cache
from kvgen.generation.config import DEFAULT_MAX_NEW_TOKENS, GenerationConfig
from kvgen.generation.logits import apply_processors, build_processors
from kvgen.generation.search import BeamSearch, choose_next_tokens
from kvgen.generation.speculative import make_drafter, speculative_decode
from kvgen.generation.stopping import MaxTime, StopStrings
from kvgen.grammar import GrammarLogitsProcessor, response_grammar
from kvgen.kernels.prompt_rows import prompt_rows
from kvgen.models.decode_blocks import blocks_compiled, eager_blocks, runs_fused
from kvgen.outputs import GenerateBeamDecoderOnlyOutput, GenerateDecoderOnlyOutput


def _positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions that skip left padding: (B, L) -> (B, L)."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(attention_mask == 0, 1)


def _reusable_prefix(cache: Cache, input_ids: torch.Tensor, max_length: int) -> int:
    """How many leading prompt tokens the cache already holds; crops what it cannot reuse.

    A cache may hold tokens that differ from this prompt's (e.g. a prefix that tokenized
    differently on its own): only the common prefix is kept, so nothing stale is attended to.
    At least the last prompt token is always fed again, to get its logits.
    """
    prompt_length = input_ids.shape[1]
    seen = cache.keep_common_prefix(input_ids)
    capacity = cache.get_max_cache_shape()
    if capacity is not None and cache.is_compileable and max_length > capacity:
        raise ValueError(
            f"max_length {max_length} (prompt {prompt_length} + new tokens) exceeds the cache's "
            f"max_cache_len {capacity}; build the cache with max_cache_len >= {max_length}"
        )
    return seen


def _repeat_rows(n: int, cache: Cache | None, *rows: torch.Tensor):
    """Each prompt row repeated ``n`` times (beams, returned sequences) after one prefill.

    The cache's rows share the prompt's storage where its layers allow (:mod:`kvgen.cache.fork`).
    """
    if n == 1:
        return rows
    if cache is not None:
        cache.share_rows(n)
    return tuple(t.repeat_interleave(n, dim=0) for t in rows)


class GenerationMixin:
    """Adds ``generate()`` to a causal language model."""

    @torch.no_grad()
    def generate(self, inputs: torch.LongTensor | None = None, generation_config: GenerationConfig | None = None,
                 streamer=None, assistant_model=None, **kwargs):
        """Generate tokens after ``input_ids`` (greedy, sampling or beam search), with any cache.

        Keyword arguments are generation settings (see :class:`GenerationConfig`) and the
        model inputs ``input_ids``, ``attention_mask`` and ``past_key_values`` (a cache to
        fill or continue: only the tokens it has not seen are fed).
        ``assistant_model``, ``prompt_lookup_num_tokens`` or ``assistant_early_exit`` turn on
        speculative decoding (:mod:`kvgen.generation.speculative`). ``stop_strings`` with ``tokenizer``
        finish a row once its text holds one (:mod:`kvgen.generation.stopping`), as in transformers;
        so does a ``stopping_criteria`` list of callables ``(input_ids, scores) -> (B,) bool``, and a
        ``logits_processor`` list of callables ``(input_ids, scores) -> scores`` runs after kvgen's own
        processors and before the sampling ones (temperature, top-k, top-p, min-p), as transformers merges them;
        ``prefix_allowed_tokens_fn(batch_id, input_ids_row) -> token ids`` constrains each step, as in transformers.
        ``response_format`` (OpenAI's: ``{"type": "json_schema", "json_schema": {"name", "schema"}}``,
        ``{"type": "json_object"}`` or ``{"type": "text"}``) with ``tokenizer`` holds the reply to that JSON
        (:class:`~kvgen.grammar.JsonSchemaLogitsProcessor`).
        Returns the sequences (B, L + new), or with ``return_dict_in_generate=True`` a
        ``GenerateDecoderOnlyOutput`` (``GenerateBeamDecoderOnlyOutput`` with ``num_beams > 1``).
        """
        # precedence as in transformers: keyword arguments > a passed config > model.generation_config > defaults
        config = (generation_config or self.generation_config).copy().fill_unset(self.generation_config).fill_unset()
        model_inputs = config.update(**kwargs)
        input_ids = inputs if inputs is not None else model_inputs.pop("input_ids", None)
        attention_mask = model_inputs.pop("attention_mask", None)
        past_key_values = model_inputs.pop("past_key_values", None)
        tokenizer = model_inputs.pop("tokenizer", None)  # (for stop_strings, as in transformers)
        custom_processors = list(model_inputs.pop("logits_processor", None) or [])  # (ids, scores) -> scores
        custom_criteria = list(model_inputs.pop("stopping_criteria", None) or [])  # (ids, scores) -> (B,) bool
        prefix_allowed_tokens_fn = model_inputs.pop("prefix_allowed_tokens_fn", None)  # (batch_id, ids) -> token ids
        grammar = response_grammar(model_inputs.pop("response_format", None))  # OpenAI's, as `kvgen serve` takes it
        if model_inputs:
            raise TypeError(f"generate() got arguments it does not know: {sorted(model_inputs)}")
        if past_key_values is not None and "cache_implementation" in kwargs:
            raise ValueError("pass either past_key_values or cache_implementation, not both")
        config.validate()
        if grammar is not None:
            if tokenizer is None:
                raise ValueError("response_format needs the model's tokenizer: generate(..., tokenizer=tokenizer)")
            custom_processors.append(GrammarLogitsProcessor(grammar, tokenizer, config.eos_ids() or None))
        beams = config.num_beams > 1
        if beams and streamer is not None:
            raise ValueError("a streamer cannot follow beam search (num_beams > 1): the best beam is known only at the end")
        if config.pad_token_id is None and config.eos_ids():
            config.pad_token_id = config.eos_ids()[0]

        input_ids, attention_mask = self._prompt_inputs(input_ids, attention_mask, config)
        max_length = self._max_length(config, input_ids.shape[1])
        processors = build_processors(config, input_ids.shape[1], custom_processors, max_length,
                                      prefix_allowed_tokens_fn)
        drafter = make_drafter(self, config, assistant_model, input_ids, processors)  # (raises before any cache edit)
        stops = self._stopping(config, tokenizer, custom_criteria, beams or drafter is not None)
        cache, legacy_in = as_cache(past_key_values)
        if cache is not None:  # before anything edits it: a cache of another model raises untouched
            check_cache_model(cache, self)
        if not config.use_cache:
            cache = None
        elif cache is None:
            cache = create_cache(config.cache_implementation or "dynamic", config=self.config,
                                 batch_size=input_ids.shape[0], max_cache_len=max_length, device=self.device,
                                 dtype=self.dtype, cache_config=config.cache_config)
        seen = 0 if cache is None else _reusable_prefix(cache, input_ids, max_length)

        speculation = None
        with eager_blocks() if config.disable_compile else contextlib.nullcontext():
            if drafter is not None:
                sequences, scores, logits, speculation = speculative_decode(
                    self, drafter, input_ids, attention_mask, _positions_from_mask(attention_mask), cache, seen,
                    config, max_length, streamer, processors)
            elif beams:
                sequences, scores, logits, search = self._beam_decode(input_ids, attention_mask, cache, seen, config,
                                                                      max_length, processors)
            else:
                sequences, scores, logits = self._decode(input_ids, attention_mask, cache, seen, config, max_length,
                                                         streamer, processors, stops)
        if not config.return_dict_in_generate:
            return sequences
        if cache is not None and (config.return_legacy_cache or legacy_in):
            cache = cache.to_legacy_cache()
        if beams:
            return GenerateBeamDecoderOnlyOutput(
                sequences=sequences, sequences_scores=search.sequences_scores if config.output_scores else None,
                scores=scores, logits=logits, beam_indices=search.sequence_beam_indices, past_key_values=cache)
        return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, past_key_values=cache,
                                         speculation=speculation)

    def compute_transition_scores(self, sequences: torch.Tensor, scores: tuple[torch.Tensor, ...],
                                  beam_indices: torch.Tensor | None = None,
                                  normalize_logits: bool = False) -> torch.Tensor:
        """The score of each generated token at its step, (B, new tokens), from ``generate(...,
        return_dict_in_generate=True, output_scores=True)``'s ``sequences`` and ``scores`` (and
        ``beam_indices`` after beam search), as transformers computes it; ``normalize_logits``: log-softmax first.

        Example:
            >>> out = model.generate(**inputs, max_new_tokens=5, return_dict_in_generate=True,
            ...                      output_scores=True)                                    # doctest: +SKIP
            >>> probabilities = model.compute_transition_scores(out.sequences, out.scores).exp()  # doctest: +SKIP
        """
        vocab = scores[0].shape[-1]
        if beam_indices is None:
            beam_indices = torch.arange(scores[0].shape[0], device=sequences.device).view(-1, 1).expand(-1, len(scores))
        stacked = torch.stack(scores).reshape(len(scores), -1).transpose(0, 1)  # (rows * V, steps)
        if normalize_logits:
            stacked = stacked.reshape(-1, vocab, stacked.shape[-1]).log_softmax(dim=1).reshape(-1, stacked.shape[-1])
        unused = beam_indices < 0  # beam search: steps after a hypothesis ended
        steps = int((~unused).long().sum(-1).max())
        beam_indices, unused = beam_indices[:, :steps].clone(), unused[:, :steps]
        beam_indices[unused] = 0
        indices = sequences[:, sequences.shape[-1] - steps:] + beam_indices * vocab
        transition = stacked.gather(0, indices)
        transition[unused] = 0
        return transition

    def generate_batch(self, inputs: list[list[int]], generation_config: GenerationConfig | None = None,
                       continuous_batching_config=None, tokenizer=None, **settings):
        """Generate for many prompts at once with continuous batching over a paged KV cache.

        Returns ``{request_id: GenerationOutput}`` (ids ``req_0``, ``req_1``, ... in input order).
        ``settings`` are per-request settings of :meth:`ContinuousBatchingManager.add_request`
        (``max_new_tokens``, ``do_sample``, ``seed``, ...).

        Example:
            >>> outputs = model.generate_batch([[1, 2, 3], [4, 5]], max_new_tokens=8)   # doctest: +SKIP
            >>> outputs["req_0"].generated_tokens                                       # doctest: +SKIP
        """
        from kvgen.serving.engine import generate_batch

        return generate_batch(self, inputs, generation_config, continuous_batching_config, tokenizer, **settings)

    def init_continuous_batching(self, generation_config: GenerationConfig | None = None,
                                 continuous_batching_config=None, tokenizer=None):
        """A :class:`kvgen.serving.engine.ContinuousBatchingManager` for this model (call ``start()`` on it)."""
        from kvgen.serving.engine import ContinuousBatchingManager

        return ContinuousBatchingManager(self, generation_config, continuous_batching_config, tokenizer)

    @staticmethod
    def _stopping(config: GenerationConfig, tokenizer, custom: list, searching: bool) -> list:
        """Checks (input_ids, scores) -> (B,) bool of the rows to finish: ``max_time``, ``stop_strings``, ``custom``."""
        stops = ([] if config.max_time is None else [MaxTime(config.max_time)]) + \
            ([] if config.stop_strings is None else [StopStrings(tokenizer, config.stop_strings)]) + custom
        if stops and searching:
            raise ValueError("max_time, stop_strings and stopping_criteria work with greedy and sampled decoding, not "
                             "with beam search or speculative decoding")
        return stops

    def _prompt_inputs(self, input_ids, attention_mask, config: GenerationConfig):
        """The prompt on the model's device, with an attention mask (from padding when not given)."""
        device = self.device
        if input_ids is None:
            if config.bos_token_id is None:
                raise ValueError("pass input_ids (the model's config has no bos_token_id to start from)")
            input_ids = torch.full((1, 1), config.bos_token_id, dtype=torch.long, device=device)
        input_ids = input_ids.to(device)
        if input_ids.shape[-1] == 0:
            raise ValueError("input_ids holds no tokens: generate() continues at least one (an empty prompt? pass "
                             "the tokenizer's BOS token, or no input_ids to start from the model's bos_token_id)")
        if attention_mask is None:
            pad = config.pad_token_id
            if pad is not None and pad not in config.eos_ids() and bool((input_ids == pad).any()):
                attention_mask = (input_ids != pad).long()
            else:
                attention_mask = torch.ones_like(input_ids)
        attention_mask = attention_mask.to(device)
        if bool((attention_mask[:, -1] == 0).any()):
            warnings.warn("the batch is right-padded; set tokenizer.padding_side = 'left' for correct generation")
        return input_ids, attention_mask

    def _max_length(self, config: GenerationConfig, prompt_length: int) -> int:
        """Total length to stop at (prompt included)."""
        if config.max_new_tokens is not None:
            max_length = prompt_length + config.max_new_tokens
        elif config.max_length is not None:
            max_length = config.max_length
        else:  # neither set anywhere: transformers makes 20 new tokens, within the model's positions
            max_length = prompt_length + DEFAULT_MAX_NEW_TOKENS
            if self.config.get("max_position_embeddings"):
                max_length = min(max_length, self.config.get("max_position_embeddings"))
        if prompt_length >= max_length:
            raise ValueError(
                f"input_ids has {prompt_length} tokens but max_length is {max_length}, so there is no room for a new "
                "token; set max_new_tokens (the number of tokens to generate) instead"
            )
        return max_length

    def _decode(self, input_ids, attention_mask, cache, seen: int, config: GenerationConfig, max_length: int,
                streamer, processors, stops: list | None = None):
        """Prefill the unseen tokens, then choose and feed one token per step until EOS, a stop string or
        ``max_length``."""
        position_ids = _positions_from_mask(attention_mask)
        if streamer is not None:
            streamer.put(input_ids.cpu())
        logits = self._prefill(input_ids, attention_mask, position_ids, cache, seen)
        logits, input_ids, attention_mask, position_ids = _repeat_rows(
            config.num_return_sequences, cache, logits, input_ids, attention_mask, position_ids)
        batch = input_ids.shape[0]
        eos = torch.tensor(config.eos_ids(), device=input_ids.device) if config.eos_ids() else None
        unfinished = torch.ones(batch, dtype=torch.bool, device=input_ids.device)
        scores_out, logits_out = [], []
        step = self._decode_step(cache, config, batch)
        while True:
            raw = logits[:, -1, :].float()
            scores = apply_processors(processors, input_ids, raw)
            if config.output_scores:
                scores_out.append(scores)
            if config.output_logits:
                logits_out.append(raw)
            next_tokens = choose_next_tokens(scores, config.do_sample)
            if eos is not None:  # (as in transformers: without an EOS, rows that stopped run on until all have)
                next_tokens = torch.where(unfinished, next_tokens, config.pad_token_id)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            if streamer is not None:
                streamer.put(next_tokens.cpu())
            if eos is not None:
                unfinished &= ~torch.isin(next_tokens, eos)
            for stop in stops or ():
                unfinished &= ~torch.as_tensor(stop(input_ids, scores), device=unfinished.device).bool()
            if input_ids.shape[1] >= max_length or not bool(unfinished.any()):
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch, 1)], dim=-1)
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + 1], dim=-1)
            logits = step(input_ids, attention_mask, position_ids)
        if streamer is not None:
            streamer.end()
        if cache is not None:  # the compiled path does not record: set the ids of every position fed
            cache.token_ids = input_ids[:, : cache.get_seq_length()]
        return (input_ids, tuple(scores_out) if config.output_scores else None,
                tuple(logits_out) if config.output_logits else None)

    def _prefill(self, input_ids, attention_mask, position_ids, cache: Cache | None, seen: int) -> torch.Tensor:
        """Logits (B, 1, V) after the prompt, feeding the cache the ``input_ids`` it has not seen (from ``seen``): rows
        of a prompt's tokens (:mod:`kvgen.kernels.prompt_rows`)."""
        if cache is None:
            with prompt_rows(input_ids.numel()):
                return self(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, logits_to_keep=1).logits
        with prompt_rows(input_ids[:, seen:].numel()):
            return self(input_ids[:, seen:], attention_mask=attention_mask, position_ids=position_ids[:, seen:],
                        past_key_values=cache,
                        cache_position=torch.arange(seen, input_ids.shape[1], device=input_ids.device),
                        use_cache=True, logits_to_keep=1).logits

    def _beam_decode(self, input_ids, attention_mask, cache, seen: int, config: GenerationConfig, max_length: int,
                     processors):
        """Beam search: the prompt is prefilled once per item, then its cache is repeated for the beams.

        Every step ranks the beams' continuations (:class:`BeamSearch`) and reorders the cache rows
        to follow the surviving beams, for every cache type alike (``reorder_cache``).
        """
        batch, prompt_length = input_ids.shape
        n = config.num_beams
        search = BeamSearch(batch=batch, num_beams=n, prompt_length=prompt_length, max_length=max_length,
                            eos_ids=config.eos_ids(), pad_id=config.pad_token_id,
                            num_beam_groups=config.num_beam_groups, diversity_penalty=config.diversity_penalty,
                            length_penalty=config.length_penalty, early_stopping=config.early_stopping,
                            do_sample=config.do_sample)
        position_ids = _positions_from_mask(attention_mask)
        logits = self._prefill(input_ids, attention_mask, position_ids, cache, seen)
        logits, input_ids, attention_mask, position_ids = _repeat_rows(n, cache, logits, input_ids, attention_mask,
                                                                       position_ids)
        step = self._decode_step(cache, config, batch * n)
        scores_out, logits_out = [], []
        while True:
            raw = logits[:, -1, :].float()
            log_probs = apply_processors(processors, input_ids, torch.log_softmax(raw, dim=-1))
            rows, next_tokens = search.step(input_ids, log_probs)
            if config.output_scores:
                scores_out.append(search.processed_scores)
            if config.output_logits:
                logits_out.append(raw)
            input_ids = torch.cat([input_ids[rows], next_tokens[:, None]], dim=-1)
            if cache is not None:
                cache.reorder_cache(rows)
            if input_ids.shape[1] >= max_length or search.is_done:
                break
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(batch * n, 1)], dim=-1)
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + 1], dim=-1)
            logits = step(input_ids, attention_mask, position_ids)
        if cache is not None:  # the rows follow the running beams (not the returned sequences)
            cache.token_ids = input_ids[:, : cache.get_seq_length()]
        sequences = search.finalize(input_ids, config.num_return_sequences)
        return (sequences, tuple(scores_out) if config.output_scores else None,
                tuple(logits_out) if config.output_logits else None, search)

    def _decode_step(self, cache: Cache | None, config: GenerationConfig, batch: int):
        """A function (input_ids, attention_mask, position_ids) -> logits (B, 1, V) for the newest token."""
        if cache is None:
            def uncached(input_ids, attention_mask, position_ids):
                return self(input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False, logits_to_keep=1).logits
            return uncached

        # eager where shapes vary, under disable_compile (eager_blocks()), on stored-precision weights, whose C++
        # products compiling cannot speed up (run_blocks_eagerly): compiling their static step took ~10 s a process,
        # and where the fused stack op runs a float32 model's step on the CPU (runs_fused, a cache whose layers all
        # reserve): SmolLM2 in a static cache, Xeon, 2 threads: 39.9-40.4 tok/s against 27.1-27.8 compiled
        stacked = self.device.type == "cpu" and runs_fused(self) and cache.reserves()
        if not cache.is_compileable or not blocks_compiled() or not getattr(self, "compile_decode", True) or stacked:
            def eager(input_ids, attention_mask, position_ids):
                t = input_ids.shape[1] - 1
                return self(input_ids[:, -1:], attention_mask=attention_mask, position_ids=position_ids[:, -1:],
                            past_key_values=cache, use_cache=True,
                            cache_position=torch.tensor([t], device=input_ids.device), logits_to_keep=1).logits
            return eager

        # Static shapes: the mask always spans every slot, so one compiled graph serves all steps.
        compiled = self.compiled_forward()
        capacity = cache.get_max_cache_shape()
        graphs = self.device.type == "cuda"  # a CUDA graph's next replay overwrites its outputs: keep a copy

        def static(input_ids, attention_mask, position_ids):
            t = input_ids.shape[1] - 1
            full_mask = attention_mask.new_ones(batch, capacity)
            full_mask[:, : attention_mask.shape[1]] = attention_mask
            # fresh canonical strides: slices of the growing tensors change stride every step (even at
            # batch 1, where .contiguous() keeps them), which would recompile
            logits = compiled(input_ids[:, -1:].clone(memory_format=torch.contiguous_format), attention_mask=full_mask,
                              position_ids=position_ids[:, -1:].clone(memory_format=torch.contiguous_format),
                              past_key_values=cache, use_cache=True,
                              cache_position=torch.tensor([t], device=input_ids.device), logits_to_keep=1).logits
            return logits.clone() if graphs else logits
        return static

    def compiled_forward(self):
        """``torch.compile``'d forward for static-shape decode steps (built once per model and device type).

        On a GPU it compiles with ``mode="reduce-overhead"``: each step replays a CUDA graph, writing the
        cache's buffers in place (they keep one address, see ``fixed_address``).
        """
        mode = "reduce-overhead" if self.device.type == "cuda" else None
        if getattr(self, "_compiled_forward", None) is None or getattr(self, "_compiled_mode", None) != mode:
            self._compiled_forward = torch.compile(self.forward, mode=mode, dynamic=False, fullgraph=False)
            self._compiled_mode = mode
        return self._compiled_forward
