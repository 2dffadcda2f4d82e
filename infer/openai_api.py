"""The OpenAI wire protocol of the `eagleray` serve backend: request schemas, OpenAI-style error bodies, and
the response / stream-chunk bodies. Pure data: no model, no Ray.

Errors: FastAPI's validation errors and our own `RequestError` become 4xx bodies
`{"error": {"message", "type", "param", "code"}}` whose message names the offending field.
"""
import json
from typing import Literal

from pydantic import BaseModel, Field


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class Sampling(BaseModel):
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatRequest(Sampling):
    messages: list[Message]


class CompletionRequest(Sampling):
    prompt: str


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

    api = FastAPI(title="EagleRay")
    api.add_middleware(ApiKeyGate, api=api)

    @api.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        return JSONResponse(validation_error_body(exc.errors()), status_code=400)

    @api.exception_handler(RequestError)
    async def _bad(_request, exc: RequestError):
        return JSONResponse(error_body(exc.message, exc.param, exc.code), status_code=exc.status)

    return api


def finish_reason(decoder_reason: str | None) -> str | None:
    """Our decoder's reasons (eos, stop, length, None while running) -> OpenAI's (stop, length)."""
    if decoder_reason is None:
        return None
    return "stop" if decoder_reason in ("eos", "stop") else "length"


def response_body(rid: str, created: int, model: str, chat: bool, text: str, finish: str, usage: dict) -> dict:
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
              if chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [choice], "usage": usage}


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
