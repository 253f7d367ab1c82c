"""``kvgen serve``'s request bodies and errors: the fields each route takes (wrong types answer 422, values out
of range 400), their checks, and OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``.

Example:
    >>> body = parse_body(CompletionRequest, b'{"model": "m", "prompt": "Hi", "max_tokens": 4}', max_n=8)
    >>> body.prompt, body.max_tokens
    ('Hi', 4)
"""

from __future__ import annotations

from typing import Annotated

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StringConstraints, ValidationError

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


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore")  # like OpenAI: fields it does not know are ignored
    model: str
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    n: StrictInt = Field(1, ge=1)
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: dict[str, StrictBool] | None = None
    frequency_penalty: StrictFloat = Field(0.0, ge=-2, le=2)
    presence_penalty: StrictFloat = Field(0.0, ge=-2, le=2)
    logit_bias: dict[Annotated[str, StringConstraints(pattern=r"^[0-9]+$")],
                     Annotated[StrictFloat, Field(ge=-100, le=100)]] | None = None  # token id -> added to its logit
    response_format: dict | None = None  # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    # vLLM's extensions
    top_k: StrictInt | None = Field(None, ge=-1)  # -1 or 0: all tokens
    min_p: StrictFloat | None = Field(None, ge=0, le=1)
    repetition_penalty: StrictFloat | None = Field(None, gt=0)
    ignore_eos: StrictBool = False  # vLLM's and llama.cpp's extension: go on past the end-of-sequence token


class CompletionRequest(Body):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(None, ge=0)  # 0: with echo, the prompt scored and nothing generated
    logprobs: StrictInt | None = Field(None, ge=0, le=5)
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = Field(None, ge=1)


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's answer to one


class ChatRequest(Body):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: StrictBool = True
    # OpenAI's fields that would change the answer and that kvgen does not serve: refused, never ignored
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    audio: dict | None = None
    modalities: list[str] | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's): a prompt, or messages through the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


#: pydantic's errors of a value out of its range (400); other errors are of a wrong type (422)
RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "too_short",
                "string_pattern_mismatch"}


def parse_body(schema: type[BaseModel], raw: bytes, max_n: int) -> BaseModel:
    """The request body ``raw`` as ``schema``, checked; an :class:`APIError` naming the first wrong field."""
    try:
        body = schema.model_validate_json(raw)
    except ValidationError as error:
        first = error.errors()[0]
        if first["type"] == "json_invalid":
            raise APIError(400, f"the body is not valid JSON: {first['msg']}") from None
        where = ".".join(map(str, first["loc"]))
        raise APIError(400 if first["type"] in RANGE_ERRORS else 422, f"{where or 'body'}: {first['msg']}",
                       param=str(first["loc"][0]) if first["loc"] else None) from None
    if not isinstance(body, Body):
        return body
    check(body.n <= max_n, "n", f"n must be at most {max_n}")
    if isinstance(body, ChatRequest):
        for name, instead in (("functions", "tools"), ("function_call", "tool_choice"), ("audio", None),
                              ("prediction", None), ("web_search_options", None)):
            check(getattr(body, name) is None, name, f"{name} is not supported" + (f"; use {instead}" if instead
                                                                                     else "; leave it unset"))
        check(body.modalities in (None, ["text"]), "modalities", 'only the "text" modality is supported')
    if isinstance(body, CompletionRequest):
        check(body.max_tokens != 0 or body.echo, "max_tokens", "max_tokens must be at least 1 (0 only with "
               "echo: true, which scores the prompt)")
        best_of = body.best_of or body.n
        check(best_of >= body.n, "best_of", f"best_of ({best_of}) must be at least n ({body.n})")
        check(best_of <= max_n, "best_of", f"best_of must be at most {max_n}")
        check(best_of == body.n or not body.stream, "best_of", "best_of cannot be streamed: leave stream unset")
    check(all(body.stop) if isinstance(body.stop, list) else body.stop != "", "stop", "stop strings must not be empty")
    return body


def check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise APIError(400, message, param=param)




# -- OpenAPI: what /openapi.json says of each route ----------------------------------------------------

ERROR_BODY = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_STATUS = {400: "A value out of range, or a request this server cannot serve", 401: "No API key, or a wrong one",
           404: "An unknown model or route", 405: "A method the route does not take", 422: "A field of the wrong type",
           429: "The queue is full: retry after Retry-After seconds", 500: "Generation failed",
           503: "The server is draining or its engine stopped"}


def errors(*statuses: int) -> dict:
    """OpenAPI ``responses`` of the error ``statuses``, each OpenAI's error body (429 with its Retry-After)."""
    out = {}
    for status in statuses:
        out[status] = {"description": _STATUS[status], "content": {"application/json": {"schema": ERROR_BODY}}}
        if status == 429:
            out[status]["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
    return out


def post_operation(body: type[BaseModel], streams: bool = True) -> tuple[dict, dict]:
    """(``openapi_extra``, ``responses``) of a POST route taking ``body``: its request body by reference (the
    models' schemas go under ``components``, :func:`components`) and every answer it gives."""
    extra = {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}}
    content = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    ok = {200: {"description": "The answer" + (", or with stream: true its server-sent events" if streams else ""),
                "content": content}}
    return extra, {**ok, **errors(400, 401, 404, 422, *((429, 500, 503) if streams else ()))}


def components(*bodies: type[BaseModel]) -> dict:
    """The OpenAPI schemas of ``bodies`` and of the models they refer to, by name."""
    out = {}
    for body in bodies:
        schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[body.__name__] = schema
    return out
