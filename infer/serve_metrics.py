"""Prometheus metrics of the `eagleray` serve backend, through Ray's own metrics (`ray.util.metrics`).

Each replica records into one `ServeMetrics`; Ray's metrics agent on every node collects what that node's
processes record and exports it as Prometheus text on the node's metrics export port (`ray.nodes()`'s
"MetricsExportPort"), every `metrics_report_interval_ms` (Ray's default: 10 s). Ray prefixes every name with
`ray_` and a counter's with `_total` too: `eagleray_requests` is scraped as `ray_eagleray_requests_total`.
`GET /metrics` (infer/serve.py) returns those series from every alive node (`scrape`).

Errors are not a counter of their own: `ray_eagleray_requests_total{status=~"4..|5.."}` counts them.
"""
import time
import urllib.request

NAME = "eagleray_"
EXPORTED = "ray_" + NAME  # the names Ray's agent exports
CONTENT_TYPE = "text/plain; version=0.0.4"  # Prometheus' text exposition format

# tau = tokens per verify forward (1: nothing accepted; the tiny test head reaches ~2.4)
TAU_BUCKETS = [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0]
SECONDS_BUCKETS = [0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]


class ServeMetrics:
    """A replica's metrics, each tagged with the model name clients send (`ServeConfig.model_name`), so
    two applications on one cluster stay apart. One per replica (`EagleServer.__init__`); Ray labels each
    replica's series with its WorkerId, and a dashboard sums them."""

    def __init__(self, model: str):
        from ray.util.metrics import Counter, Histogram

        def counter(name, doc, tags=()):
            return Counter(NAME + name, doc, tag_keys=("model", *tags)).set_default_tags({"model": model})

        def histogram(name, doc, buckets, tags=()):
            return Histogram(NAME + name, doc, boundaries=buckets,
                             tag_keys=("model", *tags)).set_default_tags({"model": model})

        self.requests = counter("requests", "HTTP responses by route and status code", ("route", "status"))
        self.request_seconds = histogram("request_seconds", "HTTP request latency, first byte in to last "
                                         "byte out (a stream's whole length)", SECONDS_BUCKETS, ("route",))
        self.prompt_tokens = counter("prompt_tokens", "prompt tokens prefilled, once per decode")
        self.completion_tokens = counter("completion_tokens", "tokens generated")
        self.tau = histogram("tau", "tokens per verify forward of one decode", TAU_BUCKETS)
        self.generation_seconds = histogram("generation_seconds", "one decode's wall time on the replica, "
                                            "waiting for the replica included", SECONDS_BUCKETS)
        self.accepted = counter("accepted_by_position", "drafting rounds that accepted the draft token at "
                                "position d (d = 1..depth): accepted length > d - 1", ("position",))
        self.draft_seconds = counter("draft_seconds", "seconds drafting: tree growth and the draft's ingest")
        self.verify_seconds = counter("verify_seconds", "seconds in the target's verify forwards")
        self.rounds = counter("rounds", "target forwards after the prefill (verify rounds and plain steps)")
        self.drafting_rounds = counter("drafting_rounds", "rounds that drafted (rounds minus plain steps)")

    def record_response(self, route: str, status: int, seconds: float | None = None) -> None:
        """One HTTP response (`ResponseMetrics`)."""
        self.requests.inc(tags={"route": route, "status": str(status)})
        if seconds is not None:
            self.request_seconds.observe(seconds, tags={"route": route})

    def record_generation(self, stats, prompt_tokens: int, completion_tokens: int, seconds: float) -> None:
        """One decode's `SpecStats` (infer/generate.py), finished or cut short: the work was done either way.
        A request with n choices records n decodes."""
        _add(self.prompt_tokens, prompt_tokens)
        _add(self.completion_tokens, completion_tokens)
        self.generation_seconds.observe(seconds)
        if stats.rounds:  # a decode that ended at the prefill verified nothing: no tau to speak of
            self.tau.observe(stats.tau)
        _add(self.rounds, stats.rounds)
        # without a head (depth 0) every round is a plain one, though `accepted` logs each as 0 accepted
        _add(self.drafting_rounds, stats.rounds - stats.plain_steps if stats.depth else 0)
        for d in range(1, stats.depth + 1):
            _add(self.accepted, sum(a > d - 1 for a in stats.accepted), {"position": str(d)})
        _add(self.draft_seconds, stats.split["draft"])
        _add(self.verify_seconds, stats.split["verify"])


def _add(counter, value, tags=None) -> None:
    """Ray's Counter.inc refuses 0."""
    if value > 0:
        counter.inc(value, tags=tags)


class ResponseMetrics:
    """ASGI middleware counting every HTTP response by route and status code (plain ASGI like
    `ApiKeyGate`, not Starlette's BaseHTTPMiddleware: it only watches `send`, so streams pass untouched).
    Installed outside the key gate, so its 401s count too. Reads the replica's `api.state.metrics`; an app
    without one (tests of the wire protocol) passes through. A client gone before any response is not
    counted; an exception that escapes the app counts as the 500 Starlette answers with."""

    def __init__(self, app, api):
        self.app, self.api, self.paths = app, api, None

    async def __call__(self, scope, receive, send):
        metrics = getattr(self.api.state, "metrics", None)
        if scope["type"] != "http" or metrics is None:
            await self.app(scope, receive, send)
            return
        t0, status = time.monotonic(), None

        async def watched(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            status = status or 500
            raise
        finally:
            if status is not None:
                metrics.record_response(self.route(scope), status, time.monotonic() - t0)

    def route(self, scope) -> str:
        """The app's route the path names, else "other": a tag per path a client invents would grow the
        series without bound."""
        if self.paths is None:  # every route is declared before the first request
            self.paths = {getattr(r, "path", None) for r in self.api.routes}
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root + "/"):  # a Serve route_prefix other than "/"
            path = path[len(root):]
        return path if path in self.paths else "other"


def export_urls() -> list[str]:
    """The metrics export endpoint of every alive node (public `ray.nodes()`)."""
    import ray

    return [f"http://{n['NodeManagerAddress']}:{n['MetricsExportPort']}/metrics" for n in ray.nodes()
            if n.get("Alive") and n.get("MetricsExportPort")]


def scrape(urls: list[str] | None = None, timeout_s: float = 5.0) -> str:
    """Our series from every node's export, merged into one Prometheus text. Blocking: run it off the
    event loop. A node that does not answer is left out (it may be going away); the others still count."""
    texts = []
    for url in export_urls() if urls is None else urls:
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                texts.append(r.read().decode("utf-8", "replace"))
        except OSError:
            continue
    return merge(texts)


def merge(texts: list[str]) -> str:
    """The `ray_eagleray_` families of several node exports, one # HELP / # TYPE header each, their samples
    under it. Only ours: the rest is Ray's own (~1,400 lines a node, Ray's dashboards read them) and each
    agent's unlabelled process_* / python_* series would repeat, identically named, once per node: merged,
    that is not valid exposition text. Prometheus reads Ray's own from the nodes' ports directly."""
    families: dict[str, dict] = {}
    for text in texts:
        family = None
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                _, kind, family = line.split(" ", 3)[:3]
                if family.startswith(EXPORTED):  # the first node's header of a family stands for all
                    families.setdefault(family, {"HELP": None, "TYPE": None, "samples": []})
                    families[family][kind] = families[family][kind] or line
            elif line and not line.startswith("#") and family in families and line.startswith(EXPORTED):
                families[family]["samples"].append(line)
    out = []
    for f in families.values():
        out += [h for h in (f["HELP"], f["TYPE"]) if h] + f["samples"]
    return "\n".join(out) + "\n" if out else ""

