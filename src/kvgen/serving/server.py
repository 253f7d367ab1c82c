"""``kvgen serve``: an OpenAI-compatible HTTP server on the continuous-batching engine.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or server-sent events
with ``stream: true``), ``GET /v1/models``, ``GET /health`` and ``GET /metrics`` (Prometheus text).
``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` act as OpenAI's (on the generated tokens;
the logprobs stay the model's). Completions also take ``echo`` (the prompt before the answer; with ``logprobs``,
its tokens' too; ``max_tokens: 0`` scores the prompt alone), ``best_of`` (the ``n`` of the highest
log-probability per token) and ``suffix`` (fill-in-the-middle, where the tokenizer has FIM tokens). Both routes
take ``response_format`` (``json_object``, ``json_schema``: every reply valid JSON for the schema; llguidance's
masks, :mod:`kvgen.serving.grammar`); chat takes ``tools`` and ``tool_choice`` (:mod:`kvgen.serving.tools`). Beyond OpenAI's fields a body may set ``ignore_eos`` (as vLLM and llama.cpp's
server do).
The server validates, turns each HTTP request into engine requests and streams back; all of the
policy lives in the scheduler. Errors are OpenAI's body ``{"error": {"message", "type", "param",
"code"}}``: 400 bad values, 401 wrong key, 404 unknown model or route, 422 wrong types, 429 full
queue (with ``Retry-After``), 503 while draining.

Threads: the engine loop runs in its own thread; one dispatcher thread moves every engine output to
the asyncio queue of the HTTP request waiting for it, so the event loop never blocks on the engine.

Example:
    >>> app = create_app(model, tokenizer, "smollm2", api_key="secret")   # doctest: +SKIP
    >>> serve(app, port=8000)                                             # doctest: +SKIP
    $ curl localhost:8000/v1/completions -H 'Authorization: Bearer secret' -H 'Content-Type: application/json' \\
        -d '{"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 16}'
"""

from __future__ import annotations

import asyncio
import hmac
import json
import threading
import time
import uuid
from collections import deque
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException

from kvgen.serving.engine import ContinuousBatchingConfig, ContinuousBatchingManager, GenerationOutput, QueueFull
from kvgen.serving.grammar import GrammarError, response_grammar
from kvgen.serving.tools import ToolError, ToolPlan, template_messages
from kvgen.tokenizer import fill_in_the_middle_tokens

_ERROR_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class APIError(Exception):
    """An error answered as OpenAI does: a status and ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.headers = status, param, code, headers

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": _ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# -- request bodies: wrong types get 422, values out of range 400 --------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # like OpenAI: fields it does not know are ignored
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int = Field(1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (a string of digits) -> -100 to 100
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    ignore_eos: bool = False  # vLLM's and llama.cpp's extension: go on past the end-of-sequence token


class CompletionRequest(_Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt scored and nothing generated
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer to one


class ChatRequest(_Body):
    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True


_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short"}


def _parse(schema: type[_Body], raw: bytes, max_n: int) -> _Body:
    try:
        body = schema.model_validate_json(raw)
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {first['msg']}") from None
        param = ".".join(map(str, first["loc"])) or None
        raise APIError(400 if first["type"] in _RANGE_ERRORS else 422, f"{param or 'body'}: {first['msg']}",
                       param=param) from None
    for token, bias in (body.logit_bias or {}).items():
        _check(token.isdigit(), "logit_bias", f"logit_bias keys are token ids, not {token!r}")
        _check(-100 <= bias <= 100, "logit_bias", f"logit_bias values must be between -100 and 100, not {bias}")
    _check(body.n <= max_n, "n", f"n must be at most {max_n}")
    if isinstance(body, CompletionRequest):
        _check(body.max_tokens != 0 or body.echo, "max_tokens", "max_tokens must be at least 1 (0 only with "
               "echo: true, which scores the prompt)")
        best_of = body.best_of or body.n
        _check(best_of >= body.n, "best_of", f"best_of ({best_of}) must be at least n ({body.n})")
        _check(best_of <= max_n, "best_of", f"best_of must be at most {max_n}")
        _check(best_of == body.n or not body.stream, "best_of", "best_of cannot be streamed: leave stream unset")
    _check(all(body.stop) if isinstance(body.stop, list) else body.stop != "", "stop", "stop strings must not be empty")
    return body


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise APIError(400, message, param=param)


# -- metrics -------------------------------------------------------------------------------------------


class _Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]):
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts, self.sum, self.count = [0] * len(buckets), 0.0, 0

    def observe(self, value: float, times: int = 1) -> None:
        for i, bound in enumerate(self.buckets):
            self.counts[i] += times if value <= bound else 0
        self.sum, self.count = self.sum + value * times, self.count + times

    def render(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram",
                *(f'{self.name}_bucket{{le="{b}"}} {n}' for b, n in zip(self.buckets, self.counts)),
                f'{self.name}_bucket{{le="+Inf"}} {self.count}', f"{self.name}_sum {self.sum:.6f}",
                f"{self.name}_count {self.count}"]


class _Metrics:
    """What the dispatcher measures; ``/metrics`` prints it beside the engine's stats."""

    def __init__(self):
        self.ttft = _Histogram("kvgen_time_to_first_token_seconds", "Time from arrival to the first token.",
                               (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.itl = _Histogram("kvgen_inter_token_latency_seconds", "Time between two tokens of a sequence.",
                              (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        self.finished: dict[str, int] = {}
        self.prompt_tokens = 0
        self.samples: deque[tuple[float, int]] = deque(maxlen=21)  # (time, generated tokens), every 0.5 s

    def sample(self, generated_tokens: int) -> None:
        now = time.monotonic()
        if not self.samples or now - self.samples[-1][0] >= 0.5:
            self.samples.append((now, generated_tokens))

    def render(self, stats: dict) -> str:
        (t0, g0), (t1, g1) = (self.samples[0], self.samples[-1]) if self.samples else ((0, 0), (0, 0))
        rows = [("requests_running", "gauge", "Sequences being prefilled or decoded.", stats["running"]),
                ("requests_waiting", "gauge", "Requests waiting for a slot.", stats["waiting"]),
                ("kv_blocks_total", "gauge", "Blocks of the paged KV cache.", stats["blocks_total"]),
                ("kv_blocks_used", "gauge", "KV blocks held by sequences.",
                 stats["blocks_total"] - stats["blocks_free"]),
                ("kv_blocks_free", "gauge", "KV blocks free (cached prefixes included).", stats["blocks_free"]),
                ("prefix_cache_hit_rate", "gauge", "Share of prompt tokens found in the prefix cache.",
                 stats["prefix_cache_hit_rate"]),
                ("generation_tokens_per_second", "gauge", "Generated tokens per second over the last 10 s.",
                 (g1 - g0) / (t1 - t0) if t1 > t0 else 0.0),
                ("generation_tokens_total", "counter", "Tokens generated.", stats["generated_tokens"]),
                ("prompt_tokens_total", "counter", "Prompt tokens received.", self.prompt_tokens),
                ("preemptions_total", "counter", "Sequences preempted for lack of blocks.", stats["preemptions"])]
        if "kv_store_hits" in stats:
            rows += [("kv_store_available", "gauge", "1 while the shared prefix store (Redis) is in use.",
                      stats["kv_store_available"]),
                     ("kv_store_hits_total", "counter", "Prefix blocks loaded from the shared store.",
                      stats["kv_store_hits"]),
                     ("kv_store_misses_total", "counter", "Prefix blocks asked of the shared store and absent.",
                      stats["kv_store_misses"]),
                     ("kv_store_rejected_total", "counter", "Shared-store entries ignored (damaged, other model).",
                      stats["kv_store_rejected"]),
                     ("kv_store_errors_total", "counter", "Failed calls to the shared store.",
                      stats["kv_store_errors"]),
                     ("kv_store_writes_total", "counter", "Prefix blocks written to the shared store.",
                      stats["kv_store_writes"]),
                     ("kv_store_pending", "gauge", "Prefix blocks waiting to be written.", stats["kv_store_pending"])]
        lines = [line for name, kind, help_text, value in rows for line in
                 (f"# HELP kvgen_{name} {help_text}", f"# TYPE kvgen_{name} {kind}", f"kvgen_{name} {value}")]
        finished = "kvgen_requests_finished_total"
        lines += [f"# HELP {finished} Sequences finished, by reason.", f"# TYPE {finished} counter",
                  *(f'{finished}{{finish_reason="{r}"}} {n}' for r, n in sorted(self.finished.items()))]
        return "\n".join(lines + self.ttft.render() + self.itl.render()) + "\n"


# -- engine outputs to asyncio -------------------------------------------------------------------------


class _Job:
    """One HTTP request: one engine request per prompt, ``n`` sequences each, and their outputs."""

    def __init__(self, prompts: list[list[int]], n: int):
        self.key, self.prompts, self.n = uuid.uuid4().hex[:16], prompts, n
        self.queue: asyncio.Queue = asyncio.Queue()
        self.parents: list[str] = []  # engine ids of the prompts added so far
        self.finished = 0

    def engine_ids(self, p: int) -> list[str]:
        rid = f"{self.key}-{p}"
        return [rid] + [f"{rid}__child#{i}" for i in range(self.n - 1)]


class _Dispatcher:
    """Polls the engine for the outputs of every registered sequence (never blocking), hands them to the
    event loop in batches, and times first tokens and inter-token gaps on the way."""

    def __init__(self, manager: ContinuousBatchingManager, metrics: _Metrics):
        self.manager, self.metrics = manager, metrics
        self.routes: dict[str, tuple[_Job, int]] = {}  # engine id -> (job, choice index)
        self.clocks: dict[str, tuple[int, float]] = {}  # engine id -> (tokens seen, time of the last)
        self.lock, self.wake = threading.Lock(), threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread: threading.Thread | None = None
        self.stopping = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.stopping = loop, False
        self.thread = threading.Thread(target=self._run, name="kvgen-serve-dispatcher", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stopping = True
        self.wake.set()
        if self.thread is not None:
            self.thread.join()

    def register(self, job: _Job, ids: list[str], first_index: int) -> None:
        with self.lock:
            self.routes.update({rid: (job, first_index + j) for j, rid in enumerate(ids)})
        self.wake.set()

    def unregister(self, ids: list[str]) -> None:
        with self.lock:
            for rid in ids:
                self.routes.pop(rid, None)

    def _run(self) -> None:
        while not self.stopping:
            self.metrics.sample(self.manager.generated_tokens)
            with self.lock:
                routes = list(self.routes.items())
            if not routes:
                self.wake.wait(0.5)
                self.wake.clear()
                continue
            batch = []
            for rid, (job, index) in routes:
                while True:
                    try:
                        output = self.manager.get_result(rid, timeout=0)
                    except KeyError:  # registered, not added yet
                        break
                    except RuntimeError as error:  # the engine loop failed
                        output = error
                    if output is None:
                        break
                    batch.append((job, index, output))
                    if isinstance(output, RuntimeError) or output.is_finished():
                        self._finished(rid, job, output)
                        break
                    self._clock(rid, output)
            if batch:
                self.loop.call_soon_threadsafe(_deliver, batch)
            else:
                time.sleep(0.002)

    def _clock(self, rid: str, output: GenerationOutput) -> None:
        now, n = time.perf_counter(), len(output.generated_tokens)
        seen, last = self.clocks.get(rid, (0, 0.0))
        if n and not seen and output.first_token_time is not None:
            self.metrics.ttft.observe(output.first_token_time - output.created_time)
            seen, last = 1, output.first_token_time
        if seen and n > seen:
            self.metrics.itl.observe((now - last) / (n - seen), times=n - seen)
        self.clocks[rid] = (max(seen, n), now if n > seen else last)

    def _finished(self, rid: str, job: _Job, output) -> None:
        done = isinstance(output, GenerationOutput)
        if done:
            self._clock(rid, output)
            reason = output.finish_reason or "error"
            self.metrics.finished[reason] = self.metrics.finished.get(reason, 0) + 1
        self.clocks.pop(rid, None)
        # the engine adds the children at the parent's first token: a parent ended before it never forks
        forked = not done or output.generated_tokens or "__child#" in rid
        self.unregister([rid] if forked else job.engine_ids(int(rid.rsplit("-", 1)[1])))


def _deliver(batch) -> None:
    for job, index, output in batch:
        job.queue.put_nowait((index, output))


# -- text of a choice ----------------------------------------------------------------------------------


class _Text:
    """One choice's text: decoded as tokens arrive, cut before the first stop string (which the engine
    keeps), and held back while its end may still become a stop string or a multi-byte character."""

    def __init__(self, tokenizer, stops: list[str], hidden: bool = False):
        self.tokenizer, self.stops, self.hidden = tokenizer, stops, hidden  # hidden: a prompt scored, no text
        self.hold = max(map(len, stops), default=1) - 1
        self.chars = self.tokens = 0  # text and tokens handed out so far
        self.stopped = False

    def advance(self, output: GenerationOutput) -> tuple[str, int, int]:
        """The text not handed out yet, and the tokens ``[start, end)`` that go with it."""
        start = self.tokens
        if self.stopped or self.hidden:
            return "", start, start
        ids, decode = output.generated_tokens, lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)
        text = decode(ids)
        cut = min((i for i in (text.find(stop) for stop in self.stops) if i >= 0), default=-1)
        end = len(ids)
        if cut >= 0:
            text, self.stopped = text[:cut], True
            end = max(start, next(k for k in range(len(ids) + 1) if len(decode(ids[:k])) >= cut))
        elif not output.is_finished():
            text = text.rstrip("\ufffd")
            text = text[:max(self.chars, len(text) - self.hold)]
        new, self.chars, self.tokens = text[self.chars:], max(self.chars, len(text)), end
        return new, start, end

    def finish_reason(self, output: GenerationOutput) -> str | None:
        if self.hidden:
            return "length" if output.is_finished() else None
        return "stop" if self.stopped else output.finish_reason


def _logprobs(tokenizer, tokens: list[int], values: list, tops: list, chat: bool, offset: int) -> dict:
    """OpenAI's ``logprobs`` of ``tokens`` (their log-probabilities, their top alternatives: token -> value; None
    for a prompt's first token): chat's ``content`` list or the completions' columns, text offsets from ``offset``."""
    words = [tokenizer.decode([t]) for t in tokens]
    tops = [None if top is None else [(tokenizer.decode([t]), lp) for t, lp in top.items()] for top in tops]
    if chat:
        entry = lambda w, lp: {"token": w, "logprob": lp, "bytes": list(w.encode())}  # noqa: E731
        return {"content": [{**entry(w, lp), "top_logprobs": [entry(*alt) for alt in top]}
                            for w, lp, top in zip(words, values, tops)]}
    return {"tokens": words, "token_logprobs": list(values), "top_logprobs": [top and dict(top) for top in tops],
            "text_offset": [offset + sum(map(len, words[:i])) for i in range(len(words))]}


def _best(finals: dict[int, GenerationOutput], per_prompt: int, n: int) -> list[int]:
    """Of each prompt's ``per_prompt`` sequences (``best_of``), the ``n`` of the highest log-probability per token
    (as OpenAI picks), best first; all of them, in order, where ``per_prompt == n``."""
    if per_prompt == n:
        return sorted(finals)
    mean = lambda i: sum(finals[i].logprobs) / max(1, len(finals[i].logprobs))  # noqa: E731
    return [i for p in range(0, len(finals), per_prompt)
            for i in sorted(range(p, p + per_prompt), key=mean, reverse=True)[:n]]


def _read_calls(tools: ToolPlan, reply: str) -> tuple[str | None, list[dict]]:
    """A whole reply's (content, tool calls); a forced call cut short (max_tokens) stays content."""
    try:
        return tools.read(reply)
    except (ValueError, KeyError, TypeError):
        return reply, []


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# -- the service ---------------------------------------------------------------------------------------


class Service:
    """The engine, the dispatcher and the request logic behind the routes of :func:`create_app`.

    Example:
        >>> service = Service(model, tokenizer, "smollm2", ContinuousBatchingConfig(max_num_seqs=16))  # doctest: +SKIP
        >>> service.manager.stats()["blocks_free"]                                                     # doctest: +SKIP
        4096
    """

    def __init__(self, model, tokenizer, model_name: str, engine_config: ContinuousBatchingConfig | None = None,
                 api_key: str | None = None, max_n: int = 8, retry_after: int = 1):
        self.tokenizer, self.model_name, self.api_key = tokenizer, model_name, api_key
        self.max_n, self.retry_after = max_n, retry_after
        self.manager = ContinuousBatchingManager(model, config=engine_config, tokenizer=tokenizer)
        self.metrics = _Metrics()
        self.dispatcher = _Dispatcher(self.manager, self.metrics)
        self.draining = False
        self.created = int(time.time())

    def limit(self) -> int:
        """Tokens one sequence may span: the context, and what the whole cache holds."""
        cache_tokens = self.manager.cache.num_blocks * self.manager.config.block_size
        return min(self.manager.context_length or cache_tokens, cache_tokens)

    def check_ready(self) -> None:
        if self.draining:
            raise APIError(503, "the server is shutting down; retry on another replica")
        if self.manager.error is not None or not self.manager.is_running():
            raise APIError(503, f"the engine is not running ({self.manager.error!r})")

    def submit(self, prompts: list[list[int]], body: _Body, stops: list[str], max_tokens: int | None,
               top_logprobs: int, n: int, prompt_logprobs: int | None = None, grammar: str | None = None) -> _Job:
        """Add one engine request per prompt (``n`` sequences each); all or none are added."""
        self.check_ready()
        t = body.temperature  # 0: greedy; unset (with top_p unset): the model's generation config
        sampling = dict(do_sample=None if t is None and body.top_p is None else t != 0, temperature=t or None,
                        top_p=body.top_p, seed=body.seed, stop_strings=stops or None, num_return_sequences=n,
                        top_logprobs=top_logprobs, eos_token_id=[] if body.ignore_eos else None,
                        prompt_logprobs=prompt_logprobs)
        bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
        vocab = self.manager.model.config.get("vocab_size")
        _check(vocab is None or all(token < vocab for token in bias), "logit_bias", f"logit_bias names a token outside the "
               f"vocabulary of {vocab}")
        sampling.update(frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                        logit_bias=bias, grammar=grammar)
        job = _Job(prompts, n)
        for p, prompt in enumerate(prompts):
            ids = job.engine_ids(p)
            self.dispatcher.register(job, ids, p * body.n)
            try:
                self.manager.add_request(prompt, request_id=ids[0], streaming=body.stream,
                                         max_new_tokens=max_tokens or max(1, self.limit() - len(prompt)), **sampling)
            except (ValueError, QueueFull) as error:
                self.dispatcher.unregister(ids)
                self.cancel(job)
                if isinstance(error, QueueFull):
                    raise APIError(429, f"the server is busy: {error}", code="queue_full",
                                   headers={"Retry-After": str(self.retry_after)}) from None
                if isinstance(error, GrammarError):
                    raise APIError(400, str(error), param="response_format") from None
                raise APIError(400, str(error).replace("max_new_tokens", "max_tokens"),
                               param="messages" if isinstance(body, ChatRequest) else "prompt") from None
            job.parents.append(ids[0])
        self.metrics.prompt_tokens += sum(map(len, prompts))
        return job

    def cancel(self, job: _Job) -> None:
        for rid in job.parents:  # the dispatcher still takes their final outputs, which frees the engine's handles
            self.manager.cancel_request(rid)

    async def outputs(self, job: _Job, request: Request | None):
        """``(choice index, output)`` until every sequence finishes; cancels the rest on any exit (a client
        gone: ``request`` polled for non-streaming requests, a cancelled task for streaming ones)."""
        try:
            while job.finished < len(job.prompts) * job.n:
                if request is None:
                    index, output = await job.queue.get()
                else:
                    try:
                        index, output = await asyncio.wait_for(job.queue.get(), timeout=0.5)
                    except TimeoutError:
                        if await request.is_disconnected():
                            return
                        continue
                if isinstance(output, RuntimeError) or output.error:
                    raise APIError(500, f"generation failed: {output.__cause__ or output.error!r}")
                job.finished += output.is_finished()
                yield index, output
        finally:
            if job.finished < len(job.prompts) * job.n:
                self.cancel(job)

    @staticmethod
    def usage(job: _Job, finals: dict[int, GenerationOutput]) -> dict:
        completion, prompt = sum(len(o.generated_tokens) for o in finals.values()), sum(map(len, job.prompts))
        cached = sum(o.cached_prompt_tokens for i, o in finals.items() if i % job.n == 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def respond(self, request: Request, body: _Body, prompts: list[list[int]], max_tokens: int | None,
                      logprobs: int | None, echo: list[str] | None = None, tools: ToolPlan | None = None):
        """Submit, then answer with one JSON body or a stream of server-sent events. ``echo``: each prompt's text,
        put before its choices' text (and its tokens before their logprobs); with ``max_tokens`` 0 the prompt is
        scored and nothing generated. ``best_of`` sequences a prompt, of which the ``n`` likeliest are answered.
        ``tools``: a chat's tool calls, forced by their grammar or read from each reply."""
        chat, stops = isinstance(body, ChatRequest), [body.stop] if isinstance(body.stop, str) else body.stop or []
        score_only, per_prompt = max_tokens == 0, getattr(body, "best_of", None) or body.n
        try:
            grammar = response_grammar(body.response_format)
        except GrammarError as error:
            raise APIError(400, str(error), param="response_format") from None
        if tools is not None and tools.grammar is not None:
            _check(grammar is None, "response_format", "a forced tool call and a response_format cannot go "
                   "together: leave one unset")
            grammar = tools.grammar
        job = self.submit(prompts, body, stops, 1 if score_only else max_tokens, logprobs or 0, per_prompt,
                          prompt_logprobs=logprobs if echo is not None and logprobs is not None else None,
                          grammar=grammar)
        texts = [_Text(self.tokenizer, stops, hidden=score_only) for _ in range(len(prompts) * per_prompt)]
        echoed: set[int] = set()  # sequences whose prompt went out already
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{job.key}", "created": int(time.time()),
                "model": self.model_name}

        def choice(index: int, sequence: int, output: GenerationOutput, text: str, start: int, end: int,
                   finish: str | None):
            """Choice ``index`` of the answer, from the job's ``sequence``: ``text`` and tokens [start, end)."""
            echoing, prompt = echo is not None and sequence not in echoed, sequence // per_prompt
            echoed.add(sequence)
            lp = None
            if logprobs is not None:
                at = (len(echo[prompt]) if echo is not None else 0) + texts[sequence].chars - len(text)
                lp = _logprobs(self.tokenizer, output.generated_tokens[start:end], output.logprobs[start:end],
                               output.top_logprobs[start:end], chat, at)
                if echoing:
                    before = _logprobs(self.tokenizer, output.prompt_ids, output.prompt_logprobs,
                                       output.prompt_top_logprobs, chat, 0)
                    lp = {key: before[key] + lp[key] for key in lp}
            text = (echo[prompt] if echoing else "") + text
            if not chat:
                content = {"text": text}
            elif body.stream:
                content = {"delta": {"content": text} if text else {}}
            else:
                content = {"message": {"role": "assistant", "content": text}}
            return {"index": index, **content, "logprobs": lp, "finish_reason": finish}

        def usage(finals: dict[int, GenerationOutput]) -> dict:
            counts = self.usage(job, finals)
            if score_only:
                counts.update(completion_tokens=0, total_tokens=counts["prompt_tokens"])
            return counts

        if not body.stream:
            finals = {index: output async for index, output in self.outputs(job, request)}
            choices = [choice(i, s, finals[s], *texts[s].advance(finals[s]), texts[s].finish_reason(finals[s]))
                       for i, s in enumerate(_best(finals, per_prompt, body.n))]
            for c in choices if tools is not None else ():
                content, calls = _read_calls(tools, c["message"]["content"])
                if calls:
                    c["message"].update(content=content, tool_calls=calls)
                    c["finish_reason"] = "tool_calls"
            return JSONResponse({**head, "object": "chat.completion" if chat else "text_completion",
                                 "choices": choices, "usage": usage(finals)})
        chunk = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

        async def events():
            finals = {}
            try:
                for i in range(len(texts) if chat else 0):
                    yield _sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]})
                replies, sent = [""] * len(texts), [0] * len(texts)  # with tools: each reply, and its content sent
                async for index, output in self.outputs(job, None):  # streamed: best_of is n
                    text, start, end = texts[index].advance(output)
                    finish = texts[index].finish_reason(output) if output.is_finished() else None
                    if finish:
                        finals[index] = output
                    if tools is not None:  # content up to what may be a call; the calls once the reply is whole
                        replies[index] += text
                        upto = len(replies[index]) if finish else tools.held(replies[index])
                        text, calls = replies[index][sent[index]:upto], []
                        if finish:
                            content, calls = _read_calls(tools, replies[index])
                            text = "" if calls else text
                        sent[index] = max(sent[index], upto)
                        if calls:
                            finish = "tool_calls"
                            yield _sse({**chunk, "choices": [{"index": index, "delta": {"tool_calls": [
                                {"index": k, **call} for k, call in enumerate(calls)]}, "logprobs": None,
                                "finish_reason": None}]})
                    if text or finish or (logprobs is not None and end > start) or \
                            (echo is not None and index not in echoed):
                        yield _sse({**chunk, "choices": [choice(index, index, output, text, start, end, finish)]})
                if (body.stream_options or {}).get("include_usage"):
                    yield _sse({**chunk, "choices": [], "usage": usage(finals)})
            except APIError as error:
                yield _sse(error.body())
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# -- the app -------------------------------------------------------------------------------------------


def create_app(model, tokenizer, model_name: str, **settings) -> FastAPI:
    """The FastAPI app serving ``model`` as ``model_name``; ``settings`` go to :class:`Service`
    (``engine_config``, ``api_key``, ``max_n``, ``retry_after``).

    Example:
        >>> config = ContinuousBatchingConfig(max_num_seqs=16, max_queue=64)                     # doctest: +SKIP
        >>> app = create_app(model, tokenizer, "smollm2", engine_config=config, api_key="secret")  # doctest: +SKIP
    """
    service = Service(model, tokenizer, model_name, **settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.manager.start()
        service.dispatcher.start(asyncio.get_running_loop())
        yield
        service.dispatcher.stop()
        service.manager.stop()

    app = FastAPI(title="kvgen", lifespan=lifespan)
    app.state.service = service

    async def error_body(request: Request, error: Exception) -> JSONResponse:  # every error in OpenAI's format
        if isinstance(error, HTTPException):
            code = "not_found" if error.status_code == 404 else None
            error = APIError(error.status_code, str(error.detail), code=code)
        elif not isinstance(error, APIError):
            error = APIError(500, f"internal error: {error!r}")
        return error.response()

    for kind in (APIError, HTTPException, Exception):
        app.add_exception_handler(kind, error_body)

    def authorize(request: Request) -> None:
        if service.api_key is None:
            return
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "no API key: send the header 'Authorization: Bearer KEY'", code="invalid_api_key")
        if not hmac.compare_digest(key.strip().encode(), service.api_key.encode()):
            raise APIError(401, "incorrect API key", code="invalid_api_key")

    async def parse(request: Request, schema: type[_Body]) -> _Body:
        authorize(request)
        body = _parse(schema, await request.body(), service.max_n)
        if body.model != service.model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{service.model_name!r}", param="model", code="model_not_found")
        return body

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        _check(bool(prompt), "prompt", "the prompt is empty")
        if body.suffix is not None:
            fim = fill_in_the_middle_tokens(service.tokenizer)
            _check(fim is not None, "suffix", "this model's tokenizer has no fill-in-the-middle tokens "
                   "(<|fim_prefix|>, <fim_prefix> or <PRE> and theirs): leave suffix unset")
            _check(all(isinstance(p, str) for p in prompt), "suffix", "suffix needs text prompts, not token ids")
            encode = lambda text: service.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
            prompts = [[fim[0], *encode(p), fim[1], *encode(body.suffix), fim[2]] for p in prompt]
        else:
            prompts = [service.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompt]
        echo = [p if isinstance(p, str) else service.tokenizer.decode(p) for p in prompt] if body.echo else None
        return await service.respond(request, body, prompts, 16 if body.max_tokens is None else body.max_tokens,
                                     body.logprobs, echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        _check(body.top_logprobs is None or body.logprobs, "top_logprobs", "top_logprobs needs logprobs: true")
        try:
            tools = ToolPlan.of(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ToolError as error:
            raise APIError(400, str(error), param=error.param) from None
        messages = []
        for m in body.messages:
            parts = m.content if isinstance(m.content, list) else [{"type": "text", "text": m.content or ""}]
            _check(all(part.get("type") == "text" for part in parts), "messages", "only text content is supported")
            messages.append({"role": m.role, "content": "".join(str(part.get("text", "")) for part in parts),
                             "name": m.name, "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id})
        try:
            ids = service.tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=True,
                                                        tools=tools.shown if tools is not None else None)
        except Exception as error:  # the template refuses the conversation (raise_exception, missing fields)
            raise APIError(400, f"the chat template cannot render these messages: {error}", param="messages") from None
        return await service.respond(request, body, [ids], body.max_completion_tokens or body.max_tokens,
                                     (body.top_logprobs or 0) if body.logprobs else None, tools=tools)

    @app.get("/v1/models")
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": service.created,
                                            "owned_by": "kvgen", "max_model_len": service.limit()}]}

    @app.get("/health")
    async def health():
        service.check_ready()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        text = service.metrics.render(service.manager.stats())
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    return app


class _DrainingServer(uvicorn.Server):
    """uvicorn, marking the service as draining on SIGTERM/SIGINT (new requests on open connections get 503)
    while uvicorn stops accepting connections and lets the running requests finish."""

    def __init__(self, config: uvicorn.Config, service: Service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        self.service.draining = True
        super().handle_exit(sig, frame)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, drain_timeout: float | None = 60.0,
          log_level: str = "info") -> None:
    """Run ``app`` until SIGTERM or Ctrl-C, then drain: running requests finish (cancelled after
    ``drain_timeout`` seconds), then the engine stops."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=drain_timeout)
    _DrainingServer(config, app.state.service).run()
