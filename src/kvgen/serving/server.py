"""``kvgen serve``: an OpenAI-compatible HTTP server on the continuous-batching engine.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON, or server-sent events
with ``stream: true``), ``POST /tokenize`` and ``/detokenize`` (vLLM's), ``GET /v1/models``, ``GET /health`` and
``GET /metrics`` (Prometheus text).
``frequency_penalty``, ``presence_penalty`` and ``logit_bias`` act as OpenAI's (on the generated tokens;
the logprobs stay the model's). Completions also take ``echo`` (the prompt before the answer; with ``logprobs``,
its tokens' too; ``max_tokens: 0`` scores the prompt alone), ``best_of`` (the ``n`` of the highest
log-probability per token) and ``suffix`` (fill-in-the-middle, where the tokenizer has FIM tokens). Both routes
take ``response_format`` (``json_object``, ``json_schema``: every reply valid JSON for the schema; llguidance's
masks, :mod:`kvgen.grammar`); chat takes ``tools`` and ``tool_choice`` (:mod:`kvgen.serving.tools`). Beyond OpenAI's fields a body may set ``ignore_eos`` (as vLLM and llama.cpp's
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
import time
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from kvgen.serving.choices import ChoiceText, best_choices, openai_logprobs, read_calls
from kvgen.serving.engine import ContinuousBatchingConfig, ContinuousBatchingManager, GenerationOutput, QueueFull
from kvgen.grammar import GrammarError, response_grammar
from kvgen.serving.metrics import Metrics
from kvgen.serving.schemas import (APIError, Body, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                   check, components, errors, parse_body, post_operation)
from kvgen.serving.streaming import Dispatcher, Job, sse
from kvgen.serving.tools import ToolError, ToolPlan, template_messages
from kvgen.tokenizer import fill_in_the_middle_tokens

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
        self.metrics = Metrics()
        self.dispatcher = Dispatcher(self.manager, self.metrics)
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

    def submit(self, prompts: list[list[int]], body: Body, stops: list[str], max_tokens: int | None,
               top_logprobs: int, n: int, prompt_logprobs: int | None = None, grammar: str | None = None) -> Job:
        """Add one engine request per prompt (``n`` sequences each); all or none are added."""
        self.check_ready()
        t = body.temperature  # 0: greedy; unset (with top_p unset): the model's generation config
        sampling = dict(do_sample=None if t is None and body.top_p is None else t != 0, temperature=t or None,
                        top_k=None if body.top_k is None else max(0, body.top_k), min_p=body.min_p,
                        repetition_penalty=body.repetition_penalty,
                        top_p=body.top_p, seed=body.seed, stop_strings=stops or None, num_return_sequences=n,
                        top_logprobs=top_logprobs, eos_token_id=[] if body.ignore_eos else None,
                        prompt_logprobs=prompt_logprobs)
        bias = {int(token): value for token, value in (body.logit_bias or {}).items()}
        vocab = self.manager.model.config.get("vocab_size")
        check(vocab is None or all(token < vocab for token in bias), "logit_bias", f"logit_bias names a token outside the "
               f"vocabulary of {vocab}")
        sampling.update(frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
                        logit_bias=bias, grammar=grammar)
        job = Job(prompts, n)
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

    def cancel(self, job: Job) -> None:
        for rid in job.parents:  # the dispatcher still takes their final outputs, which frees the engine's handles
            self.manager.cancel_request(rid)

    async def outputs(self, job: Job, request: Request | None):
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
    def usage(job: Job, finals: dict[int, GenerationOutput]) -> dict:
        completion, prompt = sum(len(o.generated_tokens) for o in finals.values()), sum(map(len, job.prompts))
        cached = sum(o.cached_prompt_tokens for i, o in finals.items() if i % job.n == 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    async def respond(self, request: Request, body: Body, prompts: list[list[int]], max_tokens: int | None,
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
            check(grammar is None, "response_format", "a forced tool call and a response_format cannot go "
                   "together: leave one unset")
            grammar = tools.grammar
        job = self.submit(prompts, body, stops, 1 if score_only else max_tokens, logprobs or 0, per_prompt,
                          prompt_logprobs=logprobs if echo is not None and logprobs is not None else None,
                          grammar=grammar)
        texts = [ChoiceText(self.tokenizer, stops, hidden=score_only) for _ in range(len(prompts) * per_prompt)]
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
                lp = openai_logprobs(self.tokenizer, output.generated_tokens[start:end], output.logprobs[start:end],
                               output.top_logprobs[start:end], chat, at)
                if echoing:
                    before = openai_logprobs(self.tokenizer, output.prompt_ids, output.prompt_logprobs,
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
                       for i, s in enumerate(best_choices(finals, per_prompt, body.n))]
            for c in choices if tools is not None else ():
                content, calls = read_calls(tools, c["message"]["content"])
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
                    yield sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
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
                            content, calls = read_calls(tools, replies[index])
                            text = "" if calls else text
                        sent[index] = max(sent[index], upto)
                        if calls:
                            finish = "tool_calls"
                            yield sse({**chunk, "choices": [{"index": index, "delta": {"tool_calls": [
                                {"index": k, **call} for k, call in enumerate(calls)]}, "logprobs": None,
                                "finish_reason": None}]})
                    if text or finish or (logprobs is not None and end > start) or \
                            (echo is not None and index not in echoed):
                        yield sse({**chunk, "choices": [choice(index, index, output, text, start, end, finish)]})
                if (body.stream_options or {}).get("include_usage"):
                    yield sse({**chunk, "choices": [], "usage": usage(finals)})
            except APIError as error:
                yield sse(error.body())
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
        if isinstance(error, HTTPException):  # an unknown route (404), a method it does not take (405, with Allow)
            code = "not_found" if error.status_code == 404 else None
            error = APIError(error.status_code, str(error.detail), code=code, headers=error.headers)
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

    async def parse(request: Request, schema: type[BaseModel]) -> BaseModel:
        authorize(request)
        body = parse_body(schema, await request.body(), service.max_n)
        if body.model is not None and body.model != service.model_name:  # (/tokenize's model may be unset)
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{service.model_name!r}", param="model", code="model_not_found")
        return body

    def openapi() -> dict:  # FastAPI's, with the request bodies' schemas (the routes parse their bodies themselves)
        if app.openapi_schema is None:
            schema = FastAPI.openapi(app)
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                components(CompletionRequest, ChatRequest, TokenizeRequest, DetokenizeRequest))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    completion_extra, completion_responses = post_operation(CompletionRequest)
    chat_extra, chat_responses = post_operation(ChatRequest)

    @app.post("/v1/completions", openapi_extra=completion_extra, responses=completion_responses)
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        prompt = body.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        check(bool(prompt), "prompt", "the prompt is empty")
        if body.suffix is not None:
            fim = fill_in_the_middle_tokens(service.tokenizer)
            check(fim is not None, "suffix", "this model's tokenizer has no fill-in-the-middle tokens "
                   "(<|fim_prefix|>, <fim_prefix> or <PRE> and theirs): leave suffix unset")
            check(all(isinstance(p, str) for p in prompt), "suffix", "suffix needs text prompts, not token ids")
            encode = lambda text: service.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
            prompts = [[fim[0], *encode(p), fim[1], *encode(body.suffix), fim[2]] for p in prompt]
        else:
            prompts = [service.tokenizer(p)["input_ids"] if isinstance(p, str) else list(p) for p in prompt]
        echo = [p if isinstance(p, str) else service.tokenizer.decode(p) for p in prompt] if body.echo else None
        return await service.respond(request, body, prompts, 16 if body.max_tokens is None else body.max_tokens,
                                     body.logprobs, echo)

    @app.post("/v1/chat/completions", openapi_extra=chat_extra, responses=chat_responses)
    async def chat_completions(request: Request):
        body = await parse(request, ChatRequest)
        check(body.top_logprobs is None or body.logprobs, "top_logprobs", "top_logprobs needs logprobs: true")
        try:
            tools = ToolPlan.of(body.tools, body.tool_choice, body.parallel_tool_calls)
        except ToolError as error:
            raise APIError(400, str(error), param=error.param) from None
        messages = []
        for m in body.messages:
            parts = m.content if isinstance(m.content, list) else [{"type": "text", "text": m.content or ""}]
            check(all(part.get("type") == "text" for part in parts), "messages", "only text content is supported")
            messages.append({"role": m.role, "content": "".join(str(part.get("text", "")) for part in parts),
                             "name": m.name, "tool_calls": m.tool_calls, "tool_call_id": m.tool_call_id})
        try:
            ids = service.tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=True,
                                                        tools=tools.shown if tools is not None else None)
        except Exception as error:  # the template refuses the conversation (raise_exception, missing fields)
            raise APIError(400, f"the chat template cannot render these messages: {error}", param="messages") from None
        return await service.respond(request, body, [ids], body.max_completion_tokens or body.max_tokens,
                                     (body.top_logprobs or 0) if body.logprobs else None, tools=tools)

    tokenize_extra, tokenize_responses = post_operation(TokenizeRequest, streams=False)
    detokenize_extra, detokenize_responses = post_operation(DetokenizeRequest, streams=False)

    @app.post("/tokenize", openapi_extra=tokenize_extra, responses=tokenize_responses)
    async def tokenize(request: Request):
        body = await parse(request, TokenizeRequest)
        check((body.prompt is None) != (body.messages is None), "prompt", "give either prompt or messages")
        if body.prompt is not None:
            ids = service.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            try:
                ids = service.tokenizer.apply_chat_template([m.model_dump(exclude_none=True) for m in body.messages],
                                                            add_generation_prompt=body.add_generation_prompt)
            except Exception as error:
                raise APIError(400, f"the chat template cannot render these messages: {error}",
                               param="messages") from None
        return {"count": len(ids), "max_model_len": service.limit(), "tokens": ids}

    @app.post("/detokenize", openapi_extra=detokenize_extra, responses=detokenize_responses)
    async def detokenize(request: Request):
        body = await parse(request, DetokenizeRequest)
        vocab = service.manager.model.config.get("vocab_size")
        check(vocab is None or all(t < vocab for t in body.tokens), "tokens",
              f"tokens must be ids of the vocabulary [0, {vocab})")
        return {"prompt": service.tokenizer.decode(body.tokens)}

    @app.get("/v1/models", responses=errors(401))
    async def models(request: Request):
        authorize(request)
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": service.created,
                                            "owned_by": "kvgen", "max_model_len": service.limit()}]}

    @app.get("/health", responses=errors(503))
    async def health():
        service.check_ready()
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"description": "Prometheus' text format", "content": {"text/plain": {
                 "schema": {"type": "string"}}}}})
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
