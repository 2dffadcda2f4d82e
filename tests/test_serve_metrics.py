"""GET /metrics of the `eagleray` serve backend: what a replica records through Ray's metrics, read back from
Ray's metrics export through the endpoint, against what the endpoint answered."""
import re
import time
import urllib.error
import urllib.request

import openai
import pytest

from infer.cluster.local import free_port
from infer.serve_metrics import merge

pytestmark = pytest.mark.slow
MODEL = "metrics-eagle"  # the series' model tag: other tests' replicas on the session's Ray count apart
KEY = "metrics-key"
MSGS = [{"role": "user", "content": "What is the capital of Kaloria?"}]
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_target, tiny_head):
    from ray import serve

    from infer.serve import ServeConfig, start

    cfg = ServeConfig(target=tiny_target, head=tiny_head, model_name=MODEL, port=free_port(), api_key=KEY,
                      num_cpus_per_replica=0, threads_per_replica=1, max_tokens_limit=64,
                      request_timeout_s=60, speculative={"sizing": "fixed"})
    url = start(cfg)
    yield url
    serve.shutdown()


def get_metrics(url: str, key: str | None = KEY) -> tuple[str, str]:
    """(content type, body) of GET /metrics."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=headers), timeout=60) as r:
        return r.headers["Content-Type"], r.read().decode()


def parse(text: str) -> dict[str, list[tuple[dict, float]]]:
    """Prometheus text -> {sample name: [(labels, value)]} (no escaped quotes in these labels)."""
    out: dict[str, list] = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)$", line)
        if m:
            out.setdefault(m.group(1), []).append((dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")),
                                                   float(m.group(3))))
    return out


def total(samples: dict, name: str, **labels) -> float:
    """A counter summed over this module's replicas (one series per Ray worker) where `labels` match."""
    return sum(v for lab, v in samples.get("ray_eagleray_" + name, [])
               if lab.get("model") == MODEL and all(lab.get(k) == w for k, w in labels.items()))


def test_merge_keeps_ours_once_per_family():
    node = ("# HELP process_open_fds Number of open file descriptors.\n# TYPE process_open_fds gauge\n"
            "process_open_fds 53.0\n# HELP ray_eagleray_rounds_total rounds\n"
            '# TYPE ray_eagleray_rounds_total counter\nray_eagleray_rounds_total{{WorkerId="{w}"}} 3.0\n')
    text = merge([node.format(w="a"), node.format(w="b")])
    assert text.splitlines() == ["# HELP ray_eagleray_rounds_total rounds",
                                 "# TYPE ray_eagleray_rounds_total counter",
                                 'ray_eagleray_rounds_total{WorkerId="a"} 3.0',
                                 'ray_eagleray_rounds_total{WorkerId="b"} 3.0']
    assert merge([node.split("# HELP ray_")[0]]) == ""


def test_metrics_count_what_the_endpoint_answered(server):
    c = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)
    prompt = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    usages = [c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=24, temperature=0).usage,
              c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).usage]
    chunks = list(c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=24, temperature=0.9,
                                            seed=3, stream=True))
    usages.append(chunks[-1].usage)  # the finishing chunk carries the usage
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model=MODEL, messages=MSGS, max_tokens=4)
    with pytest.raises(urllib.error.HTTPError) as no_key:
        get_metrics(server, key=None)
    assert no_key.value.code == 401

    want = {"requests": {(CHAT, "200"): 2, (COMPLETIONS, "200"): 1, (CHAT, "400"): 1, (CHAT, "401"): 1},
            "completion_tokens": sum(u.completion_tokens for u in usages),
            "prompt_tokens": sum(u.prompt_tokens for u in usages),
            "rounds": sum(u.model_extra["verify_rounds"] for u in usages)}
    deadline = time.monotonic() + 60  # Ray's agent exports what workers report every 10 s (its default)
    while True:
        ctype, text = get_metrics(server)
        s = parse(text)
        by_status = {k: total(s, "requests_total", route=k[0], status=k[1]) for k in want["requests"]}
        seen = {"requests": by_status,
                **{k: total(s, k + "_total") for k in ("completion_tokens", "prompt_tokens", "rounds")}}
        if seen == want or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert seen == want, text
    assert ctype.startswith("text/plain; version=0.0.4")
    assert "# TYPE ray_eagleray_requests_total counter" in text
    assert "# TYPE ray_eagleray_tau histogram" in text
    drafting = total(s, "drafting_rounds_total")
    assert want["rounds"] >= drafting > 0
    # the tiny head accepts drafts (tests/test_serve.py: tau > 1.5): some rounds took position 1's token
    assert 0 < total(s, "accepted_by_position_total", position="1") <= drafting
    assert total(s, "tau_count") == 3 and total(s, "generation_seconds_count") == 3
    assert total(s, "draft_seconds_total") > 0 and total(s, "verify_seconds_total") > 0
    assert total(s, "request_seconds_count", route=CHAT) == 4  # 2 answered, the 400 and the 401
