"""python -m infer.serve CONFIG.yaml [key=value ...]  — OpenAI-compatible speculative decoding on Ray Serve.

Routes: POST /v1/chat/completions (stream or not), POST /v1/completions, GET /v1/models, GET /health.
Every request is validated before it reaches the model; errors are OpenAI-style JSON bodies naming the
field. A replica decodes one request at a time (batch 1) between rounds of which it checks the client
and the request deadline, so a disconnected stream frees the replica at the next round.
No postponed annotations here: the handlers travel to the replicas by value, where FastAPI must still see
their real parameter types. The application is importable for `serve run infer.serve:app_from_env` too (config in $EAGLERAY_SERVE_CONFIG).
"""
import asyncio
import json
import os
import time
import uuid
from typing import Literal

from fastapi import Request
from pydantic import BaseModel, Field

from infer.generate import TreeShape
from pipeline.cluster import ensure_ray
from pipeline.config import ExistingPath, StrictModel, config_arguments, load_or_exit


class VllmServe(StrictModel):
    """Options of the `vllm` backend only (Ray Serve LLM running vLLM)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = Field(None, gt=0)
    max_num_seqs: int = Field(64, gt=0)            # continuous batching width
    kv_cache_gb: int = Field(1, ge=1)              # CPU KV cache (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enforce_eager: bool = True
    ingress_num_cpus: float = Field(0, ge=0)       # the OpenAI ingress actor (needs none on CPU boxes)


class ServeConfig(StrictModel):
    backend: Literal["eagleray", "vllm"] = "eagleray"  # eagleray: our tree decoder, batch 1 per replica;
    #                                                    vllm: Ray Serve LLM + vLLM, continuous batching, chains
    target: ExistingPath
    head: ExistingPath | None = None           # None: vanilla decoding of the target
    model_name: str = "eagleray"
    host: str = "127.0.0.1"
    port: int = Field(8000, gt=0, lt=65536)
    app_name: str = "eagleray"
    route_prefix: str = "/"
    num_replicas: int = Field(1, gt=0)
    max_ongoing_requests: int = Field(32, gt=0)
    num_cpus_per_replica: float = Field(1, ge=0)
    num_gpus_per_replica: float = Field(0, ge=0)
    threads_per_replica: int | None = None
    max_tokens_limit: int = Field(512, gt=0)
    default_max_tokens: int = Field(128, gt=0)
    request_timeout_s: float = Field(120, gt=0)
    speculative: TreeShape = TreeShape()       # vllm backend: a chain of `depth` draft tokens
    vllm: VllmServe = VllmServe()
    ray_address: str | None = None


# ---- request schemas (validated by FastAPI; errors turned into OpenAI-style 400s) ----------------
class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str


class _Sampling(BaseModel):
    model: str
    max_tokens: int | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False


class ChatRequest(_Sampling):
    messages: list[Message]


class CompletionRequest(_Sampling):
    prompt: str


def error_body(message: str, param: str | None, code: str | None = None, kind: str = "invalid_request_error"):
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class RequestError(Exception):
    def __init__(self, status: int, message: str, param: str | None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def build_app(cfg: ServeConfig):
    """The FastAPI app + the Serve deployment class bound to cfg."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from ray import serve

    api = FastAPI(title="EagleRay")

    @api.exception_handler(RequestValidationError)
    async def _invalid(_request, exc: RequestValidationError):
        err = exc.errors()[0]
        if err.get("type") == "json_invalid":
            return JSONResponse(error_body("request body is not valid JSON", "body"), status_code=400)
        param = ".".join(str(x) for x in err.get("loc", []) if x != "body") or "body"
        msg = f"{param}: {err.get('msg')}"
        return JSONResponse(error_body(msg, param), status_code=400)

    @api.exception_handler(RequestError)
    async def _bad(_request, exc: RequestError):
        return JSONResponse(error_body(exc.message, exc.param, exc.code), status_code=exc.status)

    @serve.deployment(num_replicas=cfg.num_replicas, max_ongoing_requests=cfg.max_ongoing_requests,
                      ray_actor_options={"num_cpus": cfg.num_cpus_per_replica, "num_gpus": cfg.num_gpus_per_replica})
    @serve.ingress(api)
    class EagleServer:
        def __init__(self, conf: dict):
            from concurrent.futures import ThreadPoolExecutor

            self.cfg = ServeConfig.model_validate(conf)
            # All torch work of the replica runs on this one thread, loading included: CPU torch ops run
            # from a second thread after the first has used the OpenMP pool measured 2-3x slower here.
            self.pool = ThreadPoolExecutor(1, thread_name_prefix="eagleray-decode")
            self.gen = self.pool.submit(self._load).result()
            self.context = getattr(self.gen.target.model.config, "max_position_embeddings", 2048)
            self.lock = asyncio.Lock()  # batch 1: one decode at a time per replica

        def _load(self):
            import torch

            from infer.generate import EagleGenerator

            if self.cfg.threads_per_replica:
                torch.set_num_threads(self.cfg.threads_per_replica)
            device = "cuda" if self.cfg.num_gpus_per_replica > 0 else "cpu"
            return EagleGenerator.from_folders(self.cfg.target, self.cfg.head, device=device)

        def _settings(self, req: _Sampling, prompt_len: int):
            from infer.generate import SpecSettings

            if req.model != self.cfg.model_name:
                raise RequestError(404, f"model '{req.model}' does not exist; this server has "
                                        f"'{self.cfg.model_name}'", "model", "model_not_found")
            n = req.max_tokens if req.max_tokens is not None else min(self.cfg.default_max_tokens,
                                                                       self.cfg.max_tokens_limit)
            if n <= 0 or n > self.cfg.max_tokens_limit:
                raise RequestError(400, f"max_tokens must be in 1..{self.cfg.max_tokens_limit}, got {n}", "max_tokens")
            if prompt_len + n > self.context:
                raise RequestError(400, f"prompt ({prompt_len} tokens) + max_tokens ({n}) exceeds the context "
                                        f"length {self.context}", "messages" if isinstance(req, ChatRequest) else "prompt")
            stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
            return SpecSettings(**self.cfg.speculative.model_dump(), max_new_tokens=n, temperature=req.temperature,
                                top_p=req.top_p, seed=req.seed, stop=stop)

        def _chat_ids(self, req: ChatRequest) -> list[int]:
            if not req.messages:
                raise RequestError(400, "messages must hold at least one message", "messages")
            msgs = [m.model_dump() for m in req.messages]
            return self.gen.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]

        async def _run(self, ids, settings, request: Request | None, on_round=None, cancel: asyncio.Event | None = None):
            """Decode round by round in a worker thread; stop on disconnect, cancel or deadline."""
            deadline = time.monotonic() + self.cfg.request_timeout_s
            async with self.lock:
                it = self.gen.stream(ids, settings)
                last = None
                try:
                    while True:
                        snap = await asyncio.get_running_loop().run_in_executor(self.pool, next, it, None)
                        if snap is None:
                            return last, "done"
                        last = snap
                        if on_round is not None:
                            await on_round(snap)
                        if snap.finish_reason is not None:
                            return last, "done"
                        if (cancel is not None and cancel.is_set()) or (
                                request is not None and await request.is_disconnected()):
                            return last, "disconnected"
                        if time.monotonic() > deadline:
                            return last, "timeout"
                finally:
                    it.close()

        def _usage(self, ids, g):
            return {"prompt_tokens": len(ids), "completion_tokens": len(g.tokens),
                    "total_tokens": len(ids) + len(g.tokens), "tau": round(g.stats.tau, 4),
                    "verify_rounds": g.stats.rounds}

        def _text(self, tokens) -> str:
            return self.gen.tokenizer.decode(tokens, skip_special_tokens=True)

        async def _respond(self, req: _Sampling, ids: list[int], request: Request, chat: bool):
            settings = self._settings(req, len(ids))
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            created = int(time.time())
            obj = "chat.completion" if chat else "text_completion"
            if not req.stream:
                g, why = await self._run(ids, settings, None)
                if why == "timeout":
                    raise RequestError(504, f"request exceeded request_timeout_s={self.cfg.request_timeout_s}", None,
                                       "timeout")
                text = self._text(g.tokens)
                finish = "stop" if g.finish_reason in ("eos", "stop") else "length"
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                          if chat else {"index": 0, "text": text, "finish_reason": finish, "logprobs": None})
                return {"id": rid, "object": obj, "created": created, "model": req.model, "choices": [choice],
                        "usage": self._usage(ids, g)}
            queue: asyncio.Queue = asyncio.Queue()

            async def on_round(snap):
                await queue.put(snap)

            cancel = asyncio.Event()

            async def events():
                sent = ""
                task = asyncio.create_task(self._run(ids, settings, request, on_round, cancel))
                try:
                    if chat:
                        yield self._sse(rid, created, req.model, chat, {"role": "assistant", "content": ""}, None)
                    while True:
                        getter = asyncio.create_task(queue.get())
                        done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                        if getter in done:
                            snap = getter.result()
                            text = self._text(snap.tokens)
                            delta, sent = text[len(sent):], text
                            finish = None
                            if snap.finish_reason is not None:
                                finish = "stop" if snap.finish_reason in ("eos", "stop") else "length"
                            if delta or finish:
                                yield self._sse(rid, created, req.model, chat, {"content": delta} if chat else delta,
                                                finish, self._usage(ids, snap) if finish else None)
                            if finish:
                                break
                        else:
                            getter.cancel()
                            if queue.empty():
                                g, why = task.result()
                                if g is not None:
                                    yield self._sse(rid, created, req.model, chat, {"content": ""} if chat else "",
                                                    "length", self._usage(ids, g))
                                break
                    yield "data: [DONE]\n\n"
                finally:
                    cancel.set()  # a client that went away stops the decode at its next round

            return StreamingResponse(events(), media_type="text/event-stream")

        @staticmethod
        def _sse(rid, created, model, chat, delta, finish, usage=None) -> str:
            if chat:
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
                body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": [choice]}
            else:
                body = {"id": rid, "object": "text_completion", "created": created, "model": model,
                        "choices": [{"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}]}
            if usage:
                body["usage"] = usage
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        @api.post("/v1/chat/completions")
        async def chat(self, body: ChatRequest, request: Request):
            return await self._respond(body, self._chat_ids(body), request, chat=True)

        @api.post("/v1/completions")
        async def completions(self, body: CompletionRequest, request: Request):
            if not body.prompt:
                raise RequestError(400, "prompt must not be empty", "prompt")
            ids = self.gen.tokenizer(body.prompt, add_special_tokens=False)["input_ids"]
            return await self._respond(body, ids, request, chat=False)

        @api.get("/v1/models")
        async def models(self):
            return {"object": "list", "data": [{"id": self.cfg.model_name, "object": "model", "created": 0,
                                                "owned_by": "eagleray"}]}

        @api.get("/health")
        async def health(self):
            return {"status": "ok", "head": str(self.cfg.head) if self.cfg.head else None}

    return EagleServer


def build_application(cfg: ServeConfig):
    cfg = cfg.model_copy(update={"target": cfg.target.resolve(), "head": cfg.head.resolve() if cfg.head else None})
    return build_app(cfg).bind(json.loads(cfg.model_dump_json()))


def app_from_env(args: dict | None = None):
    """For `serve run infer.serve:app_from_env`: the config path in $EAGLERAY_SERVE_CONFIG."""
    from pipeline.config import load_config

    return build_application(load_config(ServeConfig, os.environ["EAGLERAY_SERVE_CONFIG"]))


def start(cfg: ServeConfig, blocking: bool = False):
    from ray import serve

    ensure_ray(cfg.ray_address)
    serve.start(http_options={"host": cfg.host, "port": cfg.port, "request_timeout_s": cfg.request_timeout_s + 30})
    if cfg.backend == "vllm":
        from infer.serve_vllm import build_vllm_application

        cfg = cfg.model_copy(update={"target": cfg.target.resolve(), "head": cfg.head.resolve() if cfg.head else None})
        app = build_vllm_application(cfg)
    else:
        app = build_application(cfg)
    serve.run(app, name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=blocking)
    return f"http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}"


def main(argv: list[str] | None = None) -> None:
    args = config_arguments("python -m infer.serve", __doc__).parse_args(argv)
    cfg = load_or_exit(ServeConfig, args.config, args.overrides)
    url = start(cfg)
    print(f"serving {cfg.model_name} at {url}/v1 (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        from ray import serve

        serve.shutdown()


if __name__ == "__main__":
    main()
