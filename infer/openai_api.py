"""The OpenAI wire protocol of the `eagleray` serve backend: request schemas, OpenAI-style error bodies, and
the response / stream-chunk bodies. Pure data: no model, no Ray.

Errors: FastAPI's validation errors, its body-parsing errors and our own `RequestError` become 4xx bodies
`{"error": {"message", "type", "param", "code"}}` whose message names the offending field.

Every field a request may carry is honoured or refused, never dropped: a field this server does not know is
refused as OpenAI's API refuses one ("Unrecognized request argument supplied"), and a known field whose
value this server cannot honour (logprobs, penalties, n > 1 at temperature 0) is refused by `refusal`.
"""
import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

N_MAX = 16  # choices a request may ask for (n), each decoded in turn on the replica


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str
    name: str | None = None  # a participant's name: accepted, as OpenAI's; not part of the chat template


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = True  # the last chunk carries usage either way


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None  # the newer name of max_tokens
    temperature: float = Field(1.0, ge=0, le=2)  # OpenAI's range
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=N_MAX)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the caller's end-user id: accepted, not stored
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class ChatRequest(Sampling):
    messages: list[Message]
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)


class CompletionRequest(Sampling):
    prompt: str
    logprobs: int | None = Field(None, ge=0, le=5)  # the completions API's spelling: top-k logprobs
    echo: bool = False


def refusal(req: Sampling) -> tuple[str, str] | None:
    """(param, message) for a valid field whose value this server cannot honour, else None."""
    if req.n > 1 and req.temperature == 0:
        return "n", "n > 1 needs temperature > 0: greedy decoding gives n identical choices"
    if req.n > 1 and req.stream:
        return "n", "n > 1 is not supported with stream: true"
    if req.stream_options is not None and not req.stream:
        return "stream_options", "stream_options is only allowed when stream is true"
    if req.logprobs or getattr(req, "top_logprobs", None):
        return "logprobs", "logprobs are not supported by this server"
    if getattr(req, "echo", False):
        return "echo", "echo is not supported by this server"
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            return name, f"{name} is not supported by this server (only 0)"
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        return "max_completion_tokens", "max_tokens and max_completion_tokens disagree: send one"
    return None


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def error_body(message: str, param: str | None, code: str | None = None, kind: str = "invalid_request_error"):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def validation_error_body(errors: list[dict]) -> dict:
    """FastAPI's first validation error -> an OpenAI error body naming the field."""
    err = errors[0]
    if err.get("type") == "json_invalid":
        return error_body("request body is not valid JSON", "body")
    param = ".".join(str(x) for x in err.get("loc", []) if x != "body") or "body"
    if err.get("type") == "extra_forbidden":
        return error_body(f"Unrecognized request argument supplied: {param}", param)
    return error_body(f"{param}: {err.get('msg')}", param)


def authorized(header: str | None, key: str | None) -> bool:
    """`Authorization: Bearer KEY` against the deployment's key (None: no key asked)."""
    import hmac

    if not key:
        return True
    scheme, _, given = (header or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


class ApiKeyGate:
    """ASGI middleware for the bearer key (plain ASGI, not Starlette's BaseHTTPMiddleware, so streamed
    responses and client disconnects pass through untouched)."""

    def __init__(self, app, api):
        self.app, self.api = app, api

    async def __call__(self, scope, receive, send):
        key = getattr(self.api.state, "api_key", None)
        if scope["type"] == "http" and key and not scope["path"].endswith("/health"):
            header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            if not authorized(header, key):
                from fastapi.responses import JSONResponse

                body = error_body("Incorrect or missing API key: send `Authorization: Bearer KEY`", None,
                                  "invalid_api_key")
                await JSONResponse(body, status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def make_api():
    """A FastAPI app whose errors are OpenAI-style JSON bodies. A replica that sets `api.state.api_key`
    answers every route but /health with 401 and OpenAI's invalid_api_key body unless the request
    carries that key as a bearer token (as vLLM's --api-key)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    api = FastAPI(title="EagleRay")
    api.add_middleware(ApiKeyGate, api=api)

    @api.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        return JSONResponse(validation_error_body(exc.errors()), status_code=400)

    @api.exception_handler(RequestError)
    async def _bad(_request, exc: RequestError):
        return JSONResponse(error_body(exc.message, exc.param, exc.code), status_code=exc.status)

    @api.exception_handler(StarletteHTTPException)  # a body that is not UTF-8, an unknown route, ...
    async def _http(_request, exc: StarletteHTTPException):
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        param = "body" if exc.status_code == 400 else None
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(detail, param, None, kind), status_code=exc.status_code)

    return api


def finish_reason(decoder_reason: str | None) -> str | None:
    """Our decoder's reasons (eos, stop, length, None while running) -> OpenAI's (stop, length)."""
    if decoder_reason is None:
        return None
    return "stop" if decoder_reason in ("eos", "stop") else "length"


def response_body(rid: str, created: int, model: str, chat: bool, choices: list[tuple[str, str]],
                  usage: dict) -> dict:
    """choices: (text, finish_reason) per choice, in index order."""
    def one(i, text, finish):
        return ({"index": i, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                if chat else {"index": i, "text": text, "finish_reason": finish, "logprobs": None})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [one(i, t, f) for i, (t, f) in enumerate(choices)], "usage": usage}


def summed_usage(usages: list[dict]) -> dict:
    """n choices of one prompt: the prompt counted once, completions summed, tau pooled over rounds."""
    completion = sum(u["completion_tokens"] for u in usages)
    rounds = sum(u["verify_rounds"] for u in usages)
    tau = sum(u["tau"] * u["verify_rounds"] for u in usages) / rounds if rounds else usages[0]["tau"]
    return {"prompt_tokens": usages[0]["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": usages[0]["prompt_tokens"] + completion, "tau": round(tau, 4), "verify_rounds": rounds}


def sse_chunk(rid: str, created: int, model: str, chat: bool, delta, finish: str | None, usage=None) -> str:
    """One server-sent event: `delta` is {"role"/"content": ...} for chat, a text piece for completions."""
    if chat:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    else:
        body = {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}]}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
