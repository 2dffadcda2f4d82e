"""python -m infer.serve CONFIG.yaml [key=value ...]  — OpenAI-compatible speculative decoding on Ray Serve.

Routes: POST /v1/chat/completions (stream or not), POST /v1/completions, GET /v1/models, GET /health, GET
/metrics (infer/serve_metrics.py), GET and POST /v1/admin/head (the hot swap, infer/head_swap.py). Requests
are validated before the model; errors are OpenAI-style JSON bodies naming the field. A replica decodes one
request at a time (batch 1), checking the client and the deadline between rounds, so a disconnected stream
frees it at the next round. The deployment is a module-level class sized by `.options()` from the YAML. No
postponed annotations: FastAPI must see the handlers' real types. `serve run infer.serve:app_from_env` too.
"""
import asyncio
import logging
import os
import signal
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import Request
from fastapi.responses import StreamingResponse
from ray import serve

from infer.generate import SpecSettings
from infer.head_swap import HeadWatcher, Slot, reset_registry
from infer.openai_api import (SSE_DONE, ChatRequest, CompletionRequest, RequestError, Sampling, finish_reason,
                              logprobs_body, logprobs_k, make_api, refusal, response_body, sse_chunk, summed_usage,
                              visible_text)
from infer.serve_config import HeadRequest, ServeConfig, is_loopback, with_api_key  # noqa: F401 (tests import them here)
from infer.serve_metrics import CONTENT_TYPE, ServeMetrics, scrape
from infer.traffic_log import TrafficLog
from pipeline.served import served_row
from trainer.export import head_version
from pipeline.cluster import check_shared, ensure_ray
from pipeline import storage
from pipeline.yaml_config import config_arguments, load_or_exit


def _load_generator(cfg: ServeConfig):
    import torch

    from infer.generate import EagleGenerator
    from pipeline.target import torch_dtype

    if cfg.threads_per_replica:
        torch.set_num_threads(cfg.threads_per_replica)
    device = "cuda" if cfg.num_gpus_per_replica > 0 else "cpu"
    head = storage.node_copy(cfg.head) if cfg.head else None  # each replica, on its node
    version = head_version(head) if head else ""
    gen = EagleGenerator.from_folders(cfg.target, head, dtype=torch_dtype(cfg.dtype, device), device=device,
                                      cpu_path=cfg.speculative.cpu_path)
    logging.getLogger("ray.serve").info(gen.path_line)  # the replica's log: which CPU path it runs, and why
    spec = cfg.speculative
    if spec.sizing == "adaptive" and gen.draft is not None:  # measured here, not on the first request
        gen.round_costs(cfg.adaptive_top_k)
    return Slot(gen, version, str(cfg.head) if cfg.head else None)


api = make_api()


@serve.deployment
@serve.ingress(api)
class EagleServer:
    """One replica: the generator, decoding one request at a time (sized by `build_application`)."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        api.state.api_key = cfg.api_key  # read by the app's middleware (infer/openai_api.py make_api)
        api.state.metrics = self.metrics = ServeMetrics(cfg.model_name)  # and this by ResponseMetrics
        # All torch work of the replica runs on this one thread, loading included: CPU torch ops run
        # from a second thread after the first has used the OpenMP pool measured 2-3x slower here.
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="eagleray-decode")
        self.slot = self.pool.submit(_load_generator, self.cfg).result()
        self.replica_id = f"{socket.gethostname()}:{os.getpid()}"
        self.traffic = TrafficLog(cfg.traffic_log) if cfg.traffic_log.path is not None else None
        self.context = getattr(self.gen.target.model.config, "max_position_embeddings", 2048)
        self.lock = asyncio.Lock()  # batch 1: one decode at a time per replica
        self.heads = HeadWatcher(self, cfg.app_name, cfg.swap_poll_s, cfg.adaptive_top_k)
        self.heads.take_promoted()  # a replica started after a promotion serves the promoted head
        self.heads.start()

    @property
    def gen(self):
        """The serving generator (tokenizer and target are the same in every slot)."""
        return self.slot.gen

    def _settings(self, req: Sampling, prompt_len: int) -> SpecSettings:
        """The request's decode settings, or a RequestError naming the field."""
        if req.model != self.cfg.model_name:
            raise RequestError(404, f"model '{req.model}' does not exist; this server has "
                                    f"'{self.cfg.model_name}'", "model", "model_not_found")
        refused = refusal(req)
        if refused:
            raise RequestError(400, refused[1], refused[0])
        n = req.new_tokens()
        n = n if n is not None else min(self.cfg.default_max_tokens, self.cfg.max_tokens_limit)
        if n <= 0 or n > self.cfg.max_tokens_limit:
            param = "max_tokens" if req.max_completion_tokens is None else "max_completion_tokens"
            raise RequestError(400, f"{param} must be in 1..{self.cfg.max_tokens_limit}, got {n}", param)
        if prompt_len + n > self.context:
            raise RequestError(400, f"prompt ({prompt_len} tokens) + max_tokens ({n}) exceeds the context "
                                    f"length {self.context}", "messages" if isinstance(req, ChatRequest) else "prompt")
        return SpecSettings(**self.cfg.speculative.model_dump(), max_new_tokens=n, temperature=req.temperature,
                            top_p=req.top_p, seed=req.seed, stop=req.stop_list(), logprobs=logprobs_k(req))

    def __del__(self):  # Serve's replica shutdown: what the log holds is written
        if getattr(self, "traffic", None) is not None:
            self.traffic.close()

    async def _run(self, slot: Slot, ids, settings, request: Request | None, on_round=None,
                   cancel: asyncio.Event | None = None, meta: dict | None = None):
        """Decode round by round on slot's generator in the replica's torch thread; stop on disconnect,
        cancel or deadline. Returns (last snapshot, "done" | "disconnected" | "timeout"). meta ({request_id,
        route, messages}): the request as the traffic log stores it."""
        deadline = time.monotonic() + self.cfg.request_timeout_s
        async with self.lock:
            it = slot.gen.stream(ids, settings)
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
                if last is not None:  # the decode's work counts whether it finished or was cut short
                    began = deadline - self.cfg.request_timeout_s  # so the lock's wait counts too
                    self.metrics.record_generation(last.stats, len(ids), len(last.tokens),
                                                   time.monotonic() - began)
                    if meta is not None:  # set only when the traffic log is on
                        self.traffic.record(self._served(meta, ids, settings, last, slot.version, time.time() - (
                            time.monotonic() - began)))

    @staticmethod
    def _usage(ids, g, version: str) -> dict:
        return {"prompt_tokens": len(ids), "completion_tokens": len(g.tokens),
                "total_tokens": len(ids) + len(g.tokens), "tau": round(g.stats.tau, 4),
                "verify_rounds": g.stats.rounds, "head_version": version}

    def _served(self, meta: dict, ids, settings: SpecSettings, g, version: str, started_at: float) -> dict:
        """A finished (or cut short) decode as a traffic log row."""
        st = g.stats
        return served_row(request_id=meta["request_id"], model=self.cfg.model_name, route=meta["route"],
                          messages=meta["messages"], prompt_tokens=len(ids), output_ids=g.tokens,
                          output_text=self._text(g.tokens), finish_reason=g.finish_reason or "length",
                          temperature=settings.temperature, depth=st.depth, accepted=st.accepted,
                          round_starts=st.round_starts, tau=st.tau, head_version=version,
                          started_at=started_at, finished_at=time.time())

    def _text(self, tokens) -> str:
        return self.gen.tokenizer.decode(tokens, skip_special_tokens=True)

    def _named(self, tokens, entries) -> list:
        """Decoder logprob entries -> (token text, logprob, [(alternative text, logprob)]). A token's text is
        `decode([id])`, what it adds to the text (special tokens '', as `_text` drops them):
        convert_ids_to_tokens gives byte-level BPE's symbols ('Ġ' for a space), not text."""
        piece = self._text
        return [(piece([t]), lp, [(piece([a]), alp) for a, alp in top]) for t, (lp, top) in zip(tokens, entries)]

    def _logprobs(self, chat: bool, k: int | None, g, mark: dict) -> dict | None:
        """The logprobs body of g's tokens from mark["tokens"] on (a stream chunk's: the tokens whose text it
        adds), their completions text_offset from mark["offset"]; advances mark past them."""
        if k is None:
            return None
        entries = self._named(g.tokens[mark["tokens"]:], g.logprobs[mark["tokens"]:])
        body = logprobs_body(chat, entries, k, mark["offset"])
        mark["tokens"], mark["offset"] = len(g.tokens), mark["offset"] + sum(len(t) for t, _, _ in entries)
        return body

    async def _respond(self, req: Sampling, ids: list[int], request: Request, chat: bool):
        settings = self._settings(req, len(ids))
        slot = self.slot  # this request's head, whatever is promoted while it runs
        head = (("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], int(time.time()), req.model, chat)
        meta = None if self.traffic is None else {  # only what the traffic log stores
            "request_id": head[0], "route": "chat" if chat else "completion",
            "messages": [m.model_dump(exclude={"name"}) for m in req.messages] if chat
            else [{"role": "user", "content": req.prompt}]}
        if req.stream:
            return StreamingResponse(self._events(slot, head, ids, settings, request, meta),
                                     media_type="text/event-stream")
        choices, usages = [], []
        for i in range(req.n):  # n independent samples, each its own seed when the request gives one
            one = settings if req.seed is None else settings.model_copy(update={"seed": req.seed + i})
            mine = dict(meta, request_id=f"{head[0]}-{i}") if meta is not None and req.n > 1 else meta
            g, why = await self._run(slot, ids, one, None, meta=mine)
            if why == "timeout":
                raise RequestError(504, f"request exceeded request_timeout_s={self.cfg.request_timeout_s}", None,
                                   "timeout")
            text = visible_text(self._text(g.tokens), settings.stop, True)
            choices.append((text, finish_reason(g.finish_reason),
                            self._logprobs(chat, settings.logprobs, g, {"tokens": 0, "offset": 0})))
            usages.append(self._usage(ids, g, slot.version))
        return response_body(*head, choices, summed_usage(usages))

    async def _events(self, slot: Slot, head: tuple, ids, settings, request: Request, meta: dict | None = None):
        """Server-sent events: one chunk per verify round with new text, a final chunk with usage, [DONE].
        A decode cut short (disconnect, deadline) ends with finish_reason "length"."""
        chat = head[3]
        queue: asyncio.Queue = asyncio.Queue()
        cancel = asyncio.Event()
        task = asyncio.create_task(self._run(slot, ids, settings, request, queue.put, cancel, meta))
        sent, mark = "", {"tokens": 0, "offset": 0}  # mark: the tokens whose logprobs were sent
        try:
            if chat:
                yield sse_chunk(*head, {"role": "assistant", "content": ""}, None)
            while True:
                getter = asyncio.create_task(queue.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    if queue.empty():
                        g, _why = task.result()
                        if g is not None:  # cut short: what was held back for a stop string goes out too
                            rest = visible_text(self._text(g.tokens), settings.stop, True)[len(sent):]
                            yield sse_chunk(*head, {"content": rest} if chat else rest, "length",
                                            self._usage(ids, g, slot.version), self._logprobs(chat, settings.logprobs, g, mark))
                        break
                    continue
                snap = getter.result()
                finish = finish_reason(snap.finish_reason)
                text = visible_text(self._text(snap.tokens), settings.stop, finish is not None)
                delta, sent = text[len(sent):], text
                if delta or finish:
                    yield sse_chunk(*head, {"content": delta} if chat else delta, finish,
                                    self._usage(ids, snap, slot.version) if finish else None,
                                    self._logprobs(chat, settings.logprobs, snap, mark))
                if finish:
                    break
            yield SSE_DONE
        finally:
            cancel.set()  # a client that went away stops the decode at its next round

    @api.post("/v1/chat/completions")
    async def chat(self, body: ChatRequest, request: Request):
        if not body.messages:
            raise RequestError(400, "messages must hold at least one message", "messages")
        msgs = [m.model_dump() for m in body.messages]
        ids = self.gen.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
        return await self._respond(body, ids, request, chat=True)

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

    @api.get("/metrics")
    async def prometheus(self):
        """Our series (`ray_eagleray_*`) from Ray's metrics export on every alive node, so one scrape of the
        endpoint sees every replica; behind the API key like every route but /health."""
        from fastapi.responses import PlainTextResponse

        # blocking HTTP, on the loop's default executor: not self.pool, where the decodes run
        text = await asyncio.get_running_loop().run_in_executor(None, scrape)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    @api.post("/v1/admin/head")
    async def promote_head(self, body: HeadRequest):
        """Load, check and serve another head on every replica (infer/head_swap.py); 422 when it is refused."""
        try:
            return await self.heads.promote(str(body.head))
        except ValueError as err:
            await self.heads.registry.refuse.remote(self.replica_id, str(body.head), str(err))
            raise RequestError(422, str(err), "head", "head_refused") from None

    @api.get("/v1/admin/head")
    async def head_status(self):
        return await self.heads.status()

    @api.get("/health")
    async def health(self):
        head = self.slot.head
        return {"status": "ok", "head": storage.redact(head) if head else None, "head_version": self.slot.version,
                "traffic_log": dict(self.traffic.stats(), path=storage.redact(self.cfg.traffic_log.path))
                if self.traffic is not None else None}


def build_application(cfg: ServeConfig):
    """The `eagleray` backend's Serve application: EagleServer sized from the config."""
    log_path = storage.absolute(cfg.traffic_log.path)  # each replica writes where the driver said, not in its cwd
    cfg = cfg.model_copy(update={"target": storage.absolute(cfg.target), "head": storage.absolute(cfg.head),
                                 "traffic_log": cfg.traffic_log.model_copy(update={"path": log_path})})
    return EagleServer.options(
        num_replicas=cfg.num_replicas, max_ongoing_requests=cfg.max_ongoing_requests,
        ray_actor_options={"num_cpus": cfg.num_cpus_per_replica, "num_gpus": cfg.num_gpus_per_replica,
                           "resources": cfg.resources_per_replica},
        # a replica being stopped finishes the requests it holds, each within its own deadline
        graceful_shutdown_timeout_s=cfg.request_timeout_s + 5,
    ).bind(cfg)


def app_from_env(args: dict | None = None):
    """For `serve run infer.serve:app_from_env`: the config path in $EAGLERAY_SERVE_CONFIG."""
    from pipeline.yaml_config import load_config

    return build_application(load_config(ServeConfig, os.environ["EAGLERAY_SERVE_CONFIG"]))


def start(cfg: ServeConfig, blocking: bool = False):
    from ray import serve

    from pipeline.cluster import verbose

    cfg = with_api_key(cfg)
    storage.check("target", cfg.target, must_exist=True)  # before any work: one line naming the key
    if cfg.head:
        storage.check("head", cfg.head, must_exist=True)
    ensure_ray(cfg.ray_address)
    # replicas on other nodes read the target and head and append the traffic log: URIs on a cluster
    check_shared({"target": cfg.target, "head": cfg.head, "traffic_log.path": cfg.traffic_log.path})
    reset_registry(cfg.app_name)  # a new deployment serves its configured head
    if not verbose():  # Serve's start-up INFO lines on the driver (proxy, controller, app deployed)
        logging.getLogger("ray.serve").setLevel(logging.WARNING)
    serve.start(proxy_location=cfg.proxy_location,
                http_options={"host": cfg.host, "port": cfg.port, "request_timeout_s": cfg.request_timeout_s + 30})
    if cfg.backend == "vllm":
        from infer.serve_vllm import build_vllm_application

        # each replica copies the target and head onto its own node (serve_vllm.NodeCopies)
        cfg = cfg.model_copy(update={"target": storage.absolute(cfg.target), "head": storage.absolute(cfg.head)})
        app = build_vllm_application(cfg)
    else:
        app = build_application(cfg)
    serve.run(app, name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=blocking)
    return f"http://{cfg.host}:{cfg.port}{cfg.route_prefix.rstrip('/')}"


def stop() -> None:
    """Serve's graceful shutdown on a cluster we joined. On the local Ray this process started, stopping Ray
    ends Serve with it: Serve's controller exits inside its own graceful_shutdown task, and Ray then logs
    that task's retry as an error on the console."""
    import ray
    from ray import serve

    from pipeline.cluster import started_local_ray

    if started_local_ray():
        ray.shutdown()
    else:
        serve.shutdown()


def main(argv: list[str] | None = None) -> None:
    ap = config_arguments("python -m infer.serve", __doc__)
    ap.add_argument("--detach", action="store_true",
                    help="deploy onto the cluster and exit (a `ray job submit` job that succeeds); the app keeps "
                         "serving until `serve shutdown`")
    args = ap.parse_args(argv)
    cfg = load_or_exit(ServeConfig, args.config, args.overrides)
    try:
        url = start(cfg)
    except ValueError as err:
        raise SystemExit(f"config error: {args.config}: {err}") from None
    if args.detach:
        print(f"deployed {cfg.model_name} at {url}/v1 (stop: serve shutdown)", flush=True)
        return
    print(f"serving {cfg.model_name} at {url}/v1 (Ctrl-C or SIGTERM stops it once requests in flight end)",
          flush=True)
    signal.signal(signal.SIGTERM, _interrupt)  # as a process manager stops a server: the same clean stop
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        drain(cfg)
        stop()
        print(f"stopped {cfg.model_name}", flush=True)


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


def drain(cfg: ServeConfig) -> None:
    """Delete the app: Serve stops routing to it and each replica finishes the requests it holds
    (`graceful_shutdown_timeout_s`) before it exits."""
    from ray import serve

    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal does not cut the drain short
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve.delete(cfg.app_name)


if __name__ == "__main__":
    main()
