"""The continuous-batching loop: requests join and leave between forward passes.

:class:`ContinuousBatchingManager` runs the loop in a background thread (transformers 5's
API: ``start()``, ``add_request()``, ``get_result()``, ``request_id_iter()``,
``cancel_request()``, ``stop()``); ``model.generate_batch()`` and
``model.init_continuous_batching()`` are built on it. Each step schedules a ragged batch
(:mod:`kvgen.serving.scheduler`), runs it (:mod:`kvgen.serving.runner`) and hands every
request's new token to its output queue.

Example:
    >>> manager = model.init_continuous_batching(max_memory="256MB")        # doctest: +SKIP
    >>> manager.start()                                                     # doctest: +SKIP
    >>> rid = manager.add_request(tokenizer("Hello").input_ids, max_new_tokens=8)  # doctest: +SKIP
    >>> manager.get_result(rid, timeout=60).generated_tokens                # doctest: +SKIP
    [11, 314, ...]
    >>> manager.stop()                                                      # doctest: +SKIP
"""

from __future__ import annotations

import ctypes
import itertools
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field

from kvgen.cache.paged import PagedAttentionCache
from kvgen.generation.config import GenerationConfig
from kvgen.masks import BLOCK_MASKS
from kvgen.models.linear import pack_weights
from kvgen.serving.blocks import BlockPool
from kvgen.grammar import Grammars
from kvgen.serving.graphs import DecodeGraphs
from kvgen.serving.runner import IDLE, ModelRunner
from kvgen.serving.scheduler import RequestStatus, SamplingParams, Scheduler, Sequence
from kvgen.serving.store import open_store
from kvgen.tensor_parallel import broadcast_object


def release_openmp_threads() -> None:
    """Free the OpenMP worker threads of the calling thread (``omp_pause_resource_all``, in the OpenMP
    runtime torch loaded), before the model runs in another thread.

    GNU OpenMP spins only briefly while it manages more threads than there are CPUs: then every
    parallel region of the loop's thread waits on a sleeping worker. With the caller's idle workers
    still counted (they stay once it has run any torch op), a 64 x 576 ``rms_norm`` took 0.21 ms
    in the loop's thread instead of 0.02 (AMD EPYC, 2 threads). The caller gets new workers the
    next time it computes. Without a GNU OpenMP runtime in the process this does nothing.
    """
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "/libgomp" in line), None)
        if path is not None:
            ctypes.CDLL(path).omp_pause_resource_all(1)  # omp_pause_soft
    except (OSError, AttributeError):
        pass


@dataclass
class GenerationOutput:
    """A request's state as delivered to the caller (transformers' fields, plus ``finish_reason``)."""

    request_id: str
    prompt_ids: list[int] = field(default_factory=list)
    generated_tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] = field(default_factory=list)  # asked with prompt_logprobs: [None, ...]
    prompt_top_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    error: str | None = None
    status: RequestStatus = RequestStatus.PENDING
    finish_reason: str | None = None
    cached_prompt_tokens: int = 0
    created_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None

    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED


@dataclass
class ContinuousBatchingConfig:
    """Sizes of the paged cache and of each step.

    ``max_memory``: the KV cache budget (bytes, ``"512MB"``, or a fraction of free memory),
    unless ``num_blocks`` is given. ``max_batch_tokens``: tokens per forward pass (prompts are
    prefilled in chunks of what is left; 512, llama.cpp's micro-batch: ``generate_batch`` on 16 KJV requests of a
    GGUF ran 1.15x faster than at 256, each prompt row's share of the dequantized weights halved; ``kvgen serve``
    keeps 256 for its clients' inter-token latency). ``max_num_seqs``: running sequences at most. ``kv_store``:
    ``redis://host:port/db`` of a prefix-block store shared with other replicas (:mod:`kvgen.serving.store`),
    tried again ``kv_store_retry`` seconds after a failure. ``kv_dtype``: how the pool stores keys and values
    (``"float32"``, ``"float16"``, ``"bfloat16"``, ``"int8"``: :mod:`kvgen.cache.precision`); None: the model's
    dtype. The engine's tokens equal ``generate()``'s with a cache of the same precision
    (``StaticCache(..., dtype=kv_dtype)``).
    ``pack_weights``: while the engine runs, float32 CPU linear layers keep a copy of their weight in
    oneDNN's layout (:func:`kvgen.models.linear.pack_weights`): steps of 14 rows ran their products
    2.9x faster, 64 rows 1.8x (SmolLM2-135M, AMD EPYC Zen 4), for a second copy of those weights.
    ``block_sparse``: attention reads only each sequence's blocks, through flex_attention
    (:func:`kvgen.masks.paged_block_mask`); else a mask over every slot in use, which the CPU's attention kernel
    skips tile by tile. None: block-sparse on a GPU (with torch 2.9 or later).
    ``decode_graphs``: decode steps (one token per sequence) replay CUDA graphs captured per padded batch size at
    start (:mod:`kvgen.serving.graphs`; a block-sparse pool); on a CPU, the same static buffers run eagerly.
    None: on a GPU, for a block-sparse pool and a model on one device.
    """

    block_size: int = 16
    num_blocks: int | None = None
    max_memory: int | float | str = "1GiB"
    max_batch_tokens: int = 512
    max_num_seqs: int = 32
    prefix_caching: bool = True
    max_queue: int | None = None  # waiting requests at most (None: no bound); add_request raises QueueFull past it
    kv_store: str | None = None
    kv_store_retry: float = 30.0  # seconds between tries to reach Redis again after it failed
    pack_weights: bool = True
    kv_dtype: str | None = None  # (or a torch.dtype)
    block_sparse: bool | None = None
    decode_graphs: bool | None = None


class QueueFull(RuntimeError):
    """The waiting queue holds ``max_queue`` requests already; retry later."""


class _Handle:
    """What the loop keeps per request: its sequences and its output queue."""

    def __init__(self, request_id: str, streaming: bool):
        self.request_id, self.streaming = request_id, streaming
        self.outputs: queue.Queue[GenerationOutput] = queue.Queue()
        self.created = time.perf_counter()
        self.first_token: float | None = None


class ContinuousBatchingManager:
    """Serves many generation requests at once over one paged KV cache.

    Example:
        >>> with model.continuous_batching_context_manager() as manager:         # doctest: +SKIP
        ...     rid = manager.add_request([1, 2, 3], max_new_tokens=4)
        ...     manager.get_result(rid, timeout=10).generated_tokens
    """

    def __init__(self, model, generation_config: GenerationConfig | None = None,
                 config: ContinuousBatchingConfig | None = None, tokenizer=None):
        self.model, self.tokenizer = model, tokenizer
        self.config = config or ContinuousBatchingConfig()
        self.generation_config = (generation_config or model.generation_config).copy().fill_unset(
            model.generation_config).fill_unset()
        sparse = self.config.block_sparse
        if sparse is None:  # a GPU's way, where torch builds the masks
            sparse = model.device.type == "cuda" and BLOCK_MASKS
        self.cache = PagedAttentionCache(model.config, num_blocks=self.config.num_blocks,
                                         block_size=self.config.block_size, max_memory=self.config.max_memory,
                                         device=model.device, dtype=self.config.kv_dtype or model.dtype,
                                         block_sparse=sparse)
        windows = {"full_attention": None, "sliding_attention": model.config.get("sliding_window")}
        self.pools = {kind: (BlockPool(self.cache.num_blocks, self.config.block_size), windows[kind])
                      for kind in self.cache.kinds}
        if self.config.kv_store and not self.config.prefix_caching:
            raise ValueError("kv_store shares prefix blocks: it needs prefix_caching=True")
        # a model split over ranks (kvgen.tensor_parallel): rank 0 schedules and samples, the others run its steps
        self.rank, self.ranks = model.config.get("tp_rank", 0), model.config.get("tp_size", 1)
        if self.ranks > 1 and self.config.kv_store:
            raise ValueError("kv_store shares one process's blocks; a model split over ranks holds a part of each")
        self.store = None if not self.config.kv_store else open_store(self.config.kv_store, model, self.cache,
                                                                      self.config.kv_store_retry)
        self.scheduler = Scheduler(self.pools, self.config.max_num_seqs, self.config.max_batch_tokens,
                                   self.config.prefix_caching, self.store)
        self.context_length = model.config.get("max_position_embeddings")
        self.runner = ModelRunner(model, self.cache, self._decode_graphs())
        self._incoming: queue.Queue = queue.Queue()
        self._handles: dict[str, _Handle] = {}
        self._counter = itertools.count()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.error: BaseException | None = None
        self.steps = self.generated_tokens = 0

    def _decode_graphs(self) -> DecodeGraphs | None:
        """The decode steps' graphs (:mod:`kvgen.serving.graphs`) where the config asks for them."""
        cuda = self.model.device.type == "cuda"
        wanted = self.config.decode_graphs
        if not (cuda and self.cache.block_sparse and self.ranks == 1 if wanted is None else wanted):
            return None
        if not self.cache.block_sparse or self.ranks > 1:
            raise ValueError("decode_graphs needs block_sparse=True and a model on one device")
        widest = -(-(self.context_length or self.cache.num_blocks * self.cache.block_size) // self.cache.block_size)
        return DecodeGraphs(self.model, self.cache, self.config.max_num_seqs, min(widest, self.cache.num_blocks),
                            capture=cuda)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopping = False
        if self.config.pack_weights:
            pack_weights(self.model)
        release_openmp_threads()  # after any torch work of this thread (packing runs OpenMP regions)
        self._thread = threading.Thread(target=self._loop if self.rank == 0 else self._follow,
                                        name="kvgen-continuous-batching", daemon=True)
        self._thread.start()

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, block: bool = True, timeout: float | None = None) -> None:
        """Stop the loop (requests still running are cancelled). On a rank other than 0 of a split model: wait
        until rank 0's loop stops."""
        self._stopping = True
        self._wake.set()
        if block and self._thread is not None:
            self._thread.join(timeout)
        if self.config.pack_weights and not self.is_running():
            pack_weights(self.model, pack=False)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    # -- requests ----------------------------------------------------------------------------------
    def add_request(self, input_ids: list[int], request_id: str | None = None, max_new_tokens: int | None = None,
                    streaming: bool = False, eos_token_id: int | list[int] | None = None, *,
                    do_sample: bool | None = None, temperature: float | None = None, top_k: int | None = None,
                    top_p: float | None = None, seed: int | None = None, stop_strings: str | list[str] | None = None,
                    num_return_sequences: int | None = None, top_logprobs: int = 0, frequency_penalty: float = 0.0,
                    presence_penalty: float = 0.0, logit_bias: dict[int, float] | None = None,
                    prompt_logprobs: int | None = None, grammar: str | None = None,
                    repetition_penalty: float | None = None, min_p: float | None = None) -> str:
        """Queue a request; returns its id. Settings left ``None`` come from the manager's generation config.

        ``frequency_penalty``, ``presence_penalty`` (-2 to 2) and ``logit_bias`` (token id -> -100 to 100) act as
        OpenAI's, ``repetition_penalty`` as vLLM's (:class:`kvgen.serving.sampler.Penalties`), on greedy and sampled
        choices alike; ``min_p`` as vLLM's. ``prompt_logprobs=k``
        (0-20) scores the prompt too: each prompt token's log-probability given the tokens before it (None for the
        first) and its ``k`` likeliest alternatives, in the outputs' ``prompt_logprobs`` and ``prompt_top_logprobs``
        (its blocks are computed, not taken from the prefix cache). ``grammar`` (llguidance's, e.g. from
        :func:`kvgen.grammar.response_grammar`) constrains every reply to it; it needs the tokenizer.

        With ``num_return_sequences=n > 1`` the request yields ``n`` results: ``request_id`` and
        ``f"{request_id}__child#{i}"``, which share the prompt's cached blocks.
        Raises ``ValueError`` for a request that can never run (empty, longer than the context or
        than the whole cache) and :class:`QueueFull` when the waiting queue is at ``max_queue``.
        """
        if self.rank != 0:
            raise RuntimeError(f"rank {self.rank} runs the steps that rank 0 plans: add requests on rank 0")
        g = self.generation_config
        params = SamplingParams(
            max_new_tokens=max_new_tokens if max_new_tokens is not None else (g.max_new_tokens or 20),
            do_sample=g.do_sample if do_sample is None else do_sample,
            temperature=g.temperature if temperature is None else temperature,
            top_k=g.top_k if top_k is None else top_k, top_p=g.top_p if top_p is None else top_p, seed=seed,
            eos_token_ids=tuple(_as_list(eos_token_id if eos_token_id is not None else g.eos_token_id)),
            stop_strings=tuple(_as_list(stop_strings)),
            num_return_sequences=num_return_sequences or g.num_return_sequences or 1, top_logprobs=top_logprobs,
            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            logit_bias={int(t): float(b) for t, b in (logit_bias or {}).items()}, prompt_logprobs=prompt_logprobs,
            grammar=grammar, repetition_penalty=(g.repetition_penalty or 1.0) if repetition_penalty is None
            else repetition_penalty, min_p=(g.min_p or 0.0) if min_p is None else min_p)
        prompt = self._check_request(input_ids, params)
        matcher = self._matcher(grammar)
        with self._lock:
            request_id = request_id if request_id is not None else f"req_{next(self._counter)}"
            if request_id in self._handles:
                raise ValueError(f"request id {request_id!r} is in use; pass another or None")
            limit = self.config.max_queue
            if limit is not None and self._waiting_count() >= limit:
                raise QueueFull(f"{limit} requests are waiting already; retry later")
            ids = [request_id] + [f"{request_id}__child#{i}" for i in range(params.num_return_sequences - 1)]
            for rid in ids:
                self._handles[rid] = _Handle(rid, streaming)
        self._incoming.put(("add", Sequence(request_id, prompt, params, matcher=matcher)))
        self._wake.set()
        return request_id

    def _matcher(self, grammar: str | None):
        """A fresh matcher of ``grammar`` (None without one); the tokenizer's vocabulary read on first use."""
        if grammar is None:
            return None
        if self.tokenizer is None:
            raise ValueError("a grammar needs the tokenizer: init_continuous_batching(tokenizer=...)")
        if self.runner.grammars is None:
            eos = _as_list(self.generation_config.eos_token_id) or _as_list(self.tokenizer.eos_token_id)
            self.runner.grammars = Grammars(self.tokenizer, self.model.config.vocab_size, eos)
        return self.runner.grammars.matcher(grammar)

    def add_requests(self, inputs: list[list[int]], max_new_tokens: int | None = None, streaming: bool = False,
                     **settings) -> list[str]:
        return [self.add_request(ids, max_new_tokens=max_new_tokens, streaming=streaming, **settings)
                for ids in inputs]

    def cancel_request(self, request_id: str) -> None:
        """Stop a request; its blocks go back to the pool before the next step."""
        self._incoming.put(("cancel", request_id))
        self._wake.set()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> GenerationOutput | None:
        """The next output of ``request_id`` (with ``request_id=None``: of any request), or None on timeout.

        A non-streaming request delivers one output, when it finishes; a streaming one, one per token.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                handles = list(self._handles.values()) if request_id is None else [self._handles.get(request_id)]
            if request_id is not None and handles[0] is None:
                raise KeyError(f"no request {request_id!r} (unknown, or its final result was taken already)")
            wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
            for handle in handles:
                try:  # one request: block on its queue; any request: look at each in turn
                    output = handle.outputs.get(timeout=wait) if request_id is not None else handle.outputs.get_nowait()
                except queue.Empty:
                    continue
                if output.is_finished():
                    with self._lock:
                        self._handles.pop(handle.request_id, None)
                return output
            if self.error is not None:
                raise RuntimeError("the continuous-batching loop failed") from self.error
            if deadline is not None and time.monotonic() >= deadline:
                return None
            if not self.is_running():
                raise RuntimeError("the continuous-batching loop is not running: call start()")
            if request_id is None:
                time.sleep(0.002)

    def request_id_iter(self, request_id: str):
        """Yield the outputs of ``request_id`` until it finishes (streaming requests: one per token)."""
        while True:
            output = self.get_result(request_id, timeout=0.1)
            if output is not None:
                yield output
                if output.is_finished():
                    return

    # -- metrics -----------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counters for monitoring: queues, blocks, prefix-cache hit rate, steps, tokens (and the shared store's)."""
        stats = {"running": len(self.scheduler.running), "waiting": self._waiting_count(),
                 "blocks_total": sum(pool.num_blocks for pool, _ in self.pools.values()),
                 "blocks_free": sum(pool.num_free for pool, _ in self.pools.values()),
                 "prefix_cache_hit_rate": self.scheduler.hit_rate, "prefix_cache_hit_tokens": self.scheduler.hit_tokens,
                 "prefix_cache_query_tokens": self.scheduler.query_tokens, "preemptions": self.scheduler.preemptions,
                 "steps": self.steps, "generated_tokens": self.generated_tokens}
        return {**stats, **self.store.stats()} if self.store is not None else stats

    def _waiting_count(self) -> int:
        return len(self.scheduler.waiting) + self._incoming.qsize()

    # -- the loop ----------------------------------------------------------------------------------
    def _check_request(self, input_ids, params: SamplingParams) -> list[int]:
        if hasattr(input_ids, "tolist"):
            input_ids = input_ids.tolist()
        if any(isinstance(t, (list, tuple)) for t in input_ids):
            raise ValueError("add_request takes one prompt (a list of token ids); use add_requests for several")
        prompt = [int(t) for t in input_ids]
        if not prompt:
            raise ValueError("the prompt is empty: pass at least one token id")
        if params.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {params.max_new_tokens}")
        vocab = self.model.config.get("vocab_size")
        if vocab and not all(0 <= t < vocab for t in prompt):
            raise ValueError(f"the prompt holds token ids outside the vocabulary [0, {vocab})")
        total = len(prompt) + params.max_new_tokens
        if self.context_length and len(prompt) > self.context_length:
            raise ValueError(f"the prompt has {len(prompt)} tokens, more than the model's context of "
                             f"{self.context_length}; shorten it")
        if self.context_length and total > self.context_length:
            raise ValueError(f"the prompt ({len(prompt)} tokens) plus max_new_tokens ({params.max_new_tokens}) exceeds "
                             f"the model's context of {self.context_length}; lower max_new_tokens to at most "
                             f"{self.context_length - len(prompt)}")
        if self.scheduler.blocks_for(total) > self.cache.num_blocks:
            raise ValueError(f"the prompt plus max_new_tokens ({total} tokens) needs {self.scheduler.blocks_for(total)} "
                             f"blocks but the whole KV cache holds {self.cache.num_blocks}; raise max_memory or "
                             "lower max_new_tokens")
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need the tokenizer: init_continuous_batching(tokenizer=...)")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(params, name) <= 2:
                raise ValueError(f"{name} must be between -2 and 2, got {getattr(params, name)}")
        for token, bias in params.logit_bias.items():
            if vocab and not 0 <= token < vocab:
                raise ValueError(f"logit_bias names token {token}, outside the vocabulary [0, {vocab})")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be between -100 and 100, got {bias} for token {token}")
        if not params.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {params.repetition_penalty}")
        if not 0 <= params.min_p <= 1 or params.top_k < 0:
            raise ValueError(f"min_p must be within [0, 1] and top_k >= 0, got {params.min_p} and {params.top_k}")
        if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= 20:
            raise ValueError(f"prompt_logprobs must be None or 0 to 20, got {params.prompt_logprobs}")
        if params.do_sample and params.temperature <= 0:
            raise ValueError(f"temperature must be > 0 when sampling, got {params.temperature}")
        return prompt

    def _follow(self) -> None:
        try:
            self.runner.follow()
        except BaseException as error:
            self.error = error
            traceback.print_exc()

    def _loop(self) -> None:
        told = time.monotonic()
        try:
            while not self._stopping:
                self._take_incoming()
                if not self.scheduler.has_work():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    if self.ranks > 1 and time.monotonic() - told > 5:  # the other ranks wait with a timeout
                        self.runner.tell_followers(IDLE)
                        told = time.monotonic()
                    continue
                told = time.monotonic()  # (each step's plan reaches the other ranks)
                batch = self.scheduler.schedule()
                if not batch and self.scheduler.waits_for_store():  # nothing else to do meanwhile
                    self._wake.wait(0.002)
                    self._wake.clear()
                    continue
                if not batch:  # every block is held by waiting prefixes: cannot happen with checked requests
                    raise RuntimeError("the scheduler found nothing to run while requests are waiting")
                results = self.runner.step(batch)
                self.steps += 1
                for seq, n in batch:
                    self.scheduler.computed(seq, n)
                if self.store is not None:
                    self.store.flush()
                for seq, token, logprob, top in results:
                    self._append(seq, token, logprob, top)
            for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._end(seq, RequestStatus.FAILED, error="the manager stopped")
            if self.store is not None:
                self.store.drain(timeout=5.0)
        except BaseException as error:  # deliver the failure to every caller, then stop
            self.error = error
            traceback.print_exc()
            for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                self._end(seq, RequestStatus.FAILED, error=repr(error))
        finally:
            try:
                self.runner.tell_followers(None)  # stopped
            except Exception:  # (a rank died: the others' collectives fail too)
                pass

    def _take_incoming(self) -> None:
        while True:
            try:
                kind, item = self._incoming.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                self.scheduler.add(item)
            else:
                for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
                    if seq.request_id == item or seq.request_id.startswith(f"{item}__child#"):
                        self._end(seq, RequestStatus.FINISHED, finish_reason="cancelled")
                with self._lock:  # siblings not forked yet (cancelled before the first token): end them too
                    unborn = [h for rid, h in self._handles.items() if rid.startswith(f"{item}__child#")
                              and h.outputs.empty() and h.first_token is None]
                for handle in unborn:
                    handle.outputs.put(GenerationOutput(handle.request_id, status=RequestStatus.FINISHED,
                                                        finish_reason="cancelled"))

    def _append(self, seq: Sequence, token: int, logprob: float, top: dict[int, float]) -> None:
        first = not seq.generated
        seq.tokens.append(token)
        seq.logprobs.append(logprob)
        seq.top_logprobs.append(top)
        self.generated_tokens += 1
        seq.status = RequestStatus.DECODING
        handle = self._handles.get(seq.request_id)
        if handle is not None and handle.first_token is None:
            handle.first_token = time.perf_counter()
        if first and seq.params.num_return_sequences > 1 and "__child#" not in seq.request_id:
            self._fork(seq)
        reason = self._finish_reason(seq, token)
        if reason is not None:
            self._end(seq, RequestStatus.FINISHED, finish_reason=reason)
        elif handle is not None and handle.streaming:
            handle.outputs.put(self._output(seq))

    def _fork(self, seq: Sequence) -> None:
        """Queue the siblings of ``seq`` first: they find its prompt's full blocks in the prefix cache."""
        for i in range(seq.params.num_return_sequences - 1):
            params = SamplingParams(**{**vars(seq.params), "seed": None if seq.params.seed is None
                                       else seq.params.seed + i + 1})
            child = Sequence(f"{seq.request_id}__child#{i}", seq.prompt, params, matcher=self._matcher(params.grammar),
                             prompt_logprobs=list(seq.prompt_logprobs), prompt_top_logprobs=list(seq.prompt_top_logprobs))
            self.scheduler.add(child, front=True)  # its prompt scored already: it may take the parent's blocks

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        if token in seq.params.eos_token_ids:
            return "stop"
        if seq.params.stop_strings:
            tail = self.tokenizer.decode(seq.generated[-32:])
            if any(stop in tail for stop in seq.params.stop_strings):
                return "stop"
        if len(seq.generated) >= seq.params.max_new_tokens:
            return "length"
        return None

    def _end(self, seq: Sequence, status: RequestStatus, finish_reason: str | None = None,
             error: str | None = None) -> None:
        self.scheduler.finish(seq, status)
        seq.finish_reason = finish_reason
        handle = self._handles.get(seq.request_id)
        if handle is not None:
            output = self._output(seq)
            output.error = error
            handle.outputs.put(output)

    def _output(self, seq: Sequence) -> GenerationOutput:
        handle = self._handles.get(seq.request_id)
        return GenerationOutput(
            request_id=seq.request_id, prompt_ids=list(seq.prompt), generated_tokens=list(seq.generated),
            logprobs=list(seq.logprobs), top_logprobs=list(seq.top_logprobs), prompt_logprobs=list(seq.prompt_logprobs),
            prompt_top_logprobs=list(seq.prompt_top_logprobs), status=seq.status,
            finish_reason=seq.finish_reason, cached_prompt_tokens=seq.cached_prompt_tokens,
            created_time=handle.created if handle else time.perf_counter(),
            first_token_time=handle.first_token if handle else None)


def _as_list(value) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, (int, str)) else list(value)


def generate_batch(model, inputs: list[list[int]], generation_config: GenerationConfig | None = None,
                   continuous_batching_config: ContinuousBatchingConfig | None = None, tokenizer=None,
                   **settings) -> dict[str, GenerationOutput]:
    """Generate for every prompt of ``inputs`` with continuous batching; outputs by request id (``req_<i>``)."""
    if not inputs:
        return {}
    manager = ContinuousBatchingManager(model, generation_config, continuous_batching_config, tokenizer)
    results = None
    with manager:  # (on the other ranks of a split model: until rank 0 is done)
        if manager.rank == 0:
            ids = manager.add_requests(inputs, **settings)
            n = manager.generation_config.num_return_sequences if settings.get("num_return_sequences") is None \
                else settings["num_return_sequences"]
            expected = [rid for request in ids for rid in [request] + [f"{request}__child#{i}"
                                                                       for i in range((n or 1) - 1)]]
            results = {rid: manager.get_result(rid) for rid in expected}
    if manager.error is not None and manager.rank != 0:
        raise RuntimeError(f"rank {manager.rank}'s steps failed") from manager.error
    return results if manager.ranks == 1 else broadcast_object(results)  # every rank returns rank 0's
