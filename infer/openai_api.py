"""The OpenAI wire protocol of the `eagleray` serve backend: request schemas, OpenAI-style error bodies, and
the response / stream-chunk bodies. Pure data: no model, no Ray.

Errors: FastAPI's validation errors, its body-parsing errors and our own `RequestError` become 4xx bodies
`{"error": {"message", "type", "param", "code"}}` whose message names the offending field.

Every field a request may carry is honoured or refused, never dropped: a field this server does not know is
refused as OpenAI's API refuses one ("Unrecognized request argument supplied"), and a known field whose
value this server cannot honour (echo, penalties, n > 1 at temperature 0) is refused by `refusal`.

Logprobs come from the target's raw distribution (infer/generate.py `token_logprobs`); the bodies here take
them as entries (token text, logprob, [(alternative text, logprob)]), one per completion token.
"""
import json
from typing import Annotated, Literal

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
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None  # OpenAI's limit: 4
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
    if isinstance(req, ChatRequest) and req.top_logprobs is not None and not req.logprobs:
        return "top_logprobs", "top_logprobs needs logprobs: true"
    if getattr(req, "echo", False):
        return "echo", "echo is not supported by this server"
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            return name, f"{name} is not supported by this server (only 0)"
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        return "max_completion_tokens", "max_tokens and max_completion_tokens disagree: send one"
    return None


def logprobs_k(req: Sampling) -> int | None:
    """SpecSettings.logprobs of a request: None (none asked), else the alternatives per token. Chat:
    `logprobs: true` with `top_logprobs` (0 when absent); completions: `logprobs` itself."""
    if isinstance(req, ChatRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return getattr(req, "logprobs", None)


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

    from infer.serve_metrics import ResponseMetrics

    api = FastAPI(title="EagleRay")
    api.add_middleware(ApiKeyGate, api=api)
    api.add_middleware(ResponseMetrics, api=api)  # added last, so outermost: it counts the gate's 401s too

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


def visible_text(text: str, stops: list[str], final: bool) -> str:
    """What the client is shown of a decode's text: cut before the first stop string (OpenAI leaves the
    stop sequence out). While decoding goes on (final False) the longest tail that could begin a stop
    string is held back, so a stream never sends text that a later token turns into a stop; what is shown
    only grows (a stop starting inside the shown text would have been held back)."""
    cuts = [i for i in (text.find(st) for st in stops if st) if i >= 0]
    if cuts:
        return text[:min(cuts)]
    if final:
        return text
    hold = max((k for st in stops for k in range(1, len(st)) if text.endswith(st[:k])), default=0)
    return text[:len(text) - hold]


def finish_reason(decoder_reason: str | None) -> str | None:
    """Our decoder's reasons (eos, stop, length, None while running) -> OpenAI's (stop, length)."""
    if decoder_reason is None:
        return None
    return "stop" if decoder_reason in ("eos", "stop") else "length"


def _finite(logprob: float) -> float:
    """-9999.0 for a token the target rules out (-inf is not JSON), as OpenAI's API writes it."""
    return max(logprob, -9999.0)


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": _finite(logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: list) -> dict:
    """A chat choice's (or chunk's) `logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]},
    content[i] for entries[i]; `bytes` are the UTF-8 bytes of the token's text."""
    return {"content": [{**_token(t, lp), "top_logprobs": [_token(a, alp) for a, alp in top]}
                        for t, lp, top in entries]}


def _completion_top(text: str, logprob: float, top: list) -> dict:
    """{text: logprob} of the k alternatives plus the token itself (OpenAI's "up to logprobs + 1")."""
    out = {a: _finite(alp) for a, alp in top}
    out.setdefault(text, _finite(logprob))
    return out


def completion_logprobs(entries: list, k: int, offset: int = 0) -> dict:
    """A completions choice's (or chunk's) `logprobs`: tokens, token_logprobs, top_logprobs (null when k is
    0) and text_offset[i]: offset (the text earlier chunks sent) plus the lengths of tokens[:i]."""
    offsets, at = [], offset
    for text, _, _ in entries:
        offsets.append(at)
        at += len(text)
    return {"tokens": [t for t, _, _ in entries], "token_logprobs": [_finite(lp) for _, lp, _ in entries],
            "top_logprobs": None if k == 0 else [_completion_top(*e) for e in entries], "text_offset": offsets}


def logprobs_body(chat: bool, entries: list | None, k: int | None, offset: int = 0) -> dict | None:
    """The `logprobs` of a choice or chunk in its API's shape; None when the request asked none."""
    if k is None or entries is None:
        return None
    return chat_logprobs(entries) if chat else completion_logprobs(entries, k, offset)


def response_body(rid: str, created: int, model: str, chat: bool, choices: list[tuple[str, str, dict | None]],
                  usage: dict) -> dict:
    """choices: (text, finish_reason, logprobs body or None) per choice, in index order."""
    def one(i, text, finish, logprobs):
        return ({"index": i, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                 "finish_reason": finish}
                if chat else {"index": i, "text": text, "finish_reason": finish, "logprobs": logprobs})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": [one(i, *c) for i, c in enumerate(choices)], "usage": usage}


def summed_usage(usages: list[dict]) -> dict:
    """n choices of one prompt: the prompt counted once, completions summed, tau pooled over rounds."""
    completion = sum(u["completion_tokens"] for u in usages)
    rounds = sum(u["verify_rounds"] for u in usages)
    tau = sum(u["tau"] * u["verify_rounds"] for u in usages) / rounds if rounds else usages[0]["tau"]
    return {"prompt_tokens": usages[0]["prompt_tokens"], "completion_tokens": completion,
            "total_tokens": usages[0]["prompt_tokens"] + completion, "tau": round(tau, 4), "verify_rounds": rounds,
            **({"head_version": usages[0]["head_version"]} if "head_version" in usages[0] else {})}


def sse_chunk(rid: str, created: int, model: str, chat: bool, delta, finish: str | None, usage=None,
              logprobs: dict | None = None) -> str:
    """One server-sent event: `delta` is {"role"/"content": ...} for chat, a text piece for completions;
    logprobs: `logprobs_body` of the tokens whose text this chunk adds."""
    if chat:
        body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    else:
        body = {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": delta, "finish_reason": finish, "logprobs": logprobs}]}
    if usage:
        body["usage"] = usage
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"
