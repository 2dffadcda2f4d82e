"""The OpenAI-compatible Ray Serve endpoint, driven by the real `openai` client on 127.0.0.1."""
import glob
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infer.cluster.local import free_port as _free_port

pytestmark = pytest.mark.slow
MODEL = "tiny-eagle"
KEY = "test-key-1"  # the whole module runs against a keyed endpoint (ServeConfig.api_key)
AUTH = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server(ray_cluster, tiny_target, tiny_head, tmp_path_factory):
    from ray import serve

    from infer.serve import ServeConfig, start

    cfg = ServeConfig(target=tiny_target, head=tiny_head, model_name=MODEL, port=_free_port(),
                      num_cpus_per_replica=0, threads_per_replica=1, max_tokens_limit=64, request_timeout_s=60,
                      max_ongoing_requests=80,
                      # fixed: tau below is then this head's, not this machine's load (adaptive: the SIGTERM test)
                      speculative={"sizing": "fixed"},
                      api_key=KEY, traffic_log={"path": str(tmp_path_factory.mktemp("traffic")), "flush_rows": 1,
                                                "flush_s": 0.2})
    url = start(cfg)
    yield url
    serve.shutdown()


def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def greedy_text(target, messages, n):
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def post(url, path, body: bytes, headers=AUTH):
    req = urllib.request.Request(url + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


MSGS = [{"role": "user", "content": "What is the capital of Kaloria?"}]


def test_models_health_and_greedy_chat(server, tiny_target):
    c = client(server)
    assert [m.id for m in c.models.list().data] == [MODEL]
    with urllib.request.urlopen(server + "/health", timeout=30) as r:
        assert json.loads(r.read())["status"] == "ok"
    want = greedy_text(tiny_target, MSGS, 40)
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, temperature=0)
    assert r.choices[0].message.content == want
    # tiny_head reaches chain tau ~2.4 at k=3 (conftest); a decoder that never accepted a draft reads 1.0
    assert r.usage.completion_tokens > 0 and r.usage.model_extra["tau"] > 1.5
    chunks = list(c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=40, temperature=0, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    comp = c.completions.create(model=MODEL, prompt="<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
                                max_tokens=16, temperature=0)
    assert comp.choices[0].text == greedy_text(tiny_target, [{"role": "user", "content": "Hi!"}], 16)


def test_traffic_log_rows_are_the_answers_and_ingest_reads_them(server, tmp_path):
    """The replica's log: one Parquet row per finished decode, its output ids the answer's tokens, the
    head's version the usage's; ingest's `format: served` reads the files back as conversations."""
    import pyarrow.parquet as pq

    from pipeline.config import Ingest
    from pipeline.ingest import run_ingest

    msgs = [{"role": "user", "content": "Log this question, please."}]
    r = client(server).chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    rows, files, deadline = [], [], time.time() + 30
    while time.time() < deadline and not rows:
        with urllib.request.urlopen(server + "/health", timeout=10) as h:
            folder = json.loads(h.read())["traffic_log"]["path"]
        files = sorted(glob.glob(f"{folder}/*.parquet"))
        rows = [x for f in files for x in pq.read_table(f).to_pylist() if x["request_id"] == r.id]
        time.sleep(0.3)
    assert len(rows) == 1, files
    row = rows[0]
    assert json.loads(row["messages"]) == msgs and row["output_text"] == r.choices[0].message.content
    assert len(row["output_ids"]) == r.usage.completion_tokens and row["finished_at"] >= row["started_at"]
    assert row["head_version"] == r.usage.model_extra["head_version"] != ""
    assert len(row["accepted"]) == len(row["round_starts"]) > 0
    summary = run_ingest(Ingest(sources=[{"path": f"{folder}/*.parquet", "format": "served"}]), tmp_path)
    # the module's other greedy requests ask the same question twice: duplicates, counted, not kept
    # the module's other requests: repeated greedy questions (duplicates) and completions (bad_served), counted
    assert set(summary["rejected_by_reason"]) <= {"duplicate", "bad_served"} and summary["records"] >= 1
    recs = [json.loads(x) for x in (tmp_path / "records.jsonl").read_text().splitlines()]
    mine = [x for x in recs if x["id"] == r.id]
    assert mine[0]["served"] is True and mine[0]["messages"][-1] == {"role": "assistant",
                                                                    "content": r.choices[0].message.content}


def test_stream_ends_with_done(server):
    body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 8, "temperature": 0, "stream": True}).encode()
    req = urllib.request.Request(server + "/v1/chat/completions", data=body, headers=AUTH)
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = [x.decode().strip() for x in r.read().splitlines() if x.strip()]
    assert all(x.startswith("data: ") for x in lines) and lines[-1] == "data: [DONE]"


@pytest.mark.parametrize("body,status,param", [
    (b'{"model": "tiny-eagle", "messages": [', 400, "body"),
    (json.dumps({"model": MODEL}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": "hi"}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}).encode(), 400, "messages.0.role"),
    (json.dumps({"model": "gpt-17", "messages": MSGS}).encode(), 404, "model"),
    (json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 65}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": "many"}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "messages": MSGS, "temperature": -0.5}).encode(), 400, "temperature"),
    (json.dumps({"model": MODEL, "messages": MSGS, "temperature": 1e9}).encode(), 400, "temperature"),
    (json.dumps({"model": MODEL, "messages": MSGS, "n": 3, "temperature": 0}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "messages": MSGS, "n": 2, "stream": True}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "messages": MSGS, "n": 17}).encode(), 400, "n"),
    (json.dumps({"model": MODEL, "messages": MSGS, "top_logprobs": 2}).encode(), 400, "top_logprobs"),
    (json.dumps({"model": MODEL, "messages": MSGS, "presence_penalty": 0.5}).encode(), 400, "presence_penalty"),
    (json.dumps({"model": MODEL, "messages": MSGS, "frobnicate": 1}).encode(), 400, "frobnicate"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x", "mood": 1}]}).encode(), 400,
     "messages.0.mood"),
    (b'{"model": "tiny-eagle", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400, "body"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "word " * 2100}]}).encode(), 400, "messages"),
])
def test_bad_requests(server, body, status, param):
    code, err = post(server, "/v1/chat/completions", body)
    assert code == status and err["error"]["param"] == param and err["error"]["message"]


def test_unknown_fields_are_named_as_openai_names_them(server):
    code, err = post(server, "/v1/chat/completions",
                     json.dumps({"model": MODEL, "messages": MSGS, "frobnicate": 1}).encode())
    assert err["error"]["message"] == "Unrecognized request argument supplied: frobnicate"
    code, err = post(server, "/v1/chat/completions", b'{"model": "x", "messages": "\xff"}')
    assert code == 400 and set(err) == {"error"} and err["error"]["type"] == "invalid_request_error"


def test_n_choices_are_independent_samples_with_usage_summed(server):
    c = client(server)
    ask = dict(model=MODEL, messages=MSGS, max_tokens=12, temperature=0.9, seed=7)
    r = c.chat.completions.create(n=3, **ask)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert all(ch.finish_reason in ("stop", "length") and ch.message.content for ch in r.choices)
    one = c.chat.completions.create(n=1, **ask)
    assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counted once
    assert 3 <= r.usage.completion_tokens <= 36 and r.usage.total_tokens == r.usage.prompt_tokens + \
        r.usage.completion_tokens
    assert r.usage.model_extra["verify_rounds"] >= 3  # three decodes, each at least one round
    again = c.chat.completions.create(n=3, **ask)  # a seed makes the whole set repeatable
    assert [ch.message.content for ch in again.choices] == [ch.message.content for ch in r.choices]
    for extra in ({"max_completion_tokens": 5}, {"max_tokens": 5, "user": "u-1"}):  # honoured, not dropped
        body = {"model": MODEL, "messages": MSGS, "temperature": 0, **extra}
        code, out = post(server, "/v1/chat/completions", json.dumps(body).encode())
        assert code == 200 and 1 <= out["usage"]["completion_tokens"] <= 5, (extra, code, out)
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 5, "stream_options": {"include_usage": True}}
    code, out = post(server, "/v1/chat/completions", json.dumps(body).encode())  # as OpenAI: only with stream
    assert code == 400 and out["error"]["param"] == "stream_options"


def test_openai_client_raises_on_bad_request(server):
    with pytest.raises(openai.BadRequestError):
        client(server).chat.completions.create(model=MODEL, messages=[], max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client(server).chat.completions.create(model="nope", messages=MSGS, max_tokens=4)


def target_logprobs(model, ids: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """HF greedy's continuation of ids (n tokens at most) and log_softmax of one plain forward: row i
    scores out[i]."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1: -1]
    return out, torch.log_softmax(logits.float(), dim=-1)


def test_logprobs_are_the_targets(server, tiny_target):
    """Chat (top_logprobs=2) and completions (logprobs=2) through the openai client: each token's entry is
    the target's raw log-softmax (a plain HF forward here), its text joins into the message; the stream
    carries the same entries."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()  # the server's on CPU
    piece = lambda t: tok.decode([t], skip_special_tokens=True)
    c = client(server)
    ask = dict(model=MODEL, messages=MSGS, max_tokens=24, temperature=0, logprobs=True, top_logprobs=2)
    r = c.chat.completions.create(**ask)
    content = r.choices[0].logprobs.content
    assert "".join(e.token for e in content) == r.choices[0].message.content
    ids = tok.apply_chat_template(MSGS, add_generation_prompt=True, return_dict=True)["input_ids"]
    out, ref = target_logprobs(model, ids, 24)
    assert len(content) == len(out) == r.usage.completion_tokens
    for i, (t, e) in enumerate(zip(out, content)):
        assert e.token == piece(t) and e.bytes == list(e.token.encode()) and abs(e.logprob - ref[i, t]) < 1e-4
        vals, top = torch.topk(ref[i], 2)
        assert [a.token for a in e.top_logprobs] == [piece(a) for a in top.tolist()], i
        assert all(abs(a.logprob - v) < 1e-4 for a, v in zip(e.top_logprobs, vals.tolist())), i
    chunks = list(c.chat.completions.create(stream=True, **ask))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(abs(s.logprob - e.logprob) < 1e-4 for s, e in zip(streamed, content))
    assert [[a.token for a in s.top_logprobs] for s in streamed] == [[a.token for a in e.top_logprobs] for e in content]

    prompt = "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    comp = c.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, logprobs=2)
    lp = comp.choices[0].logprobs
    out, ref = target_logprobs(model, tok(prompt, add_special_tokens=False)["input_ids"], 16)
    assert lp.tokens == [piece(t) for t in out] and "".join(lp.tokens) == comp.choices[0].text
    assert all(abs(got - ref[i, t]) < 1e-4 for i, (t, got) in enumerate(zip(out, lp.token_logprobs)))
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(out))]
    for i, (t, top) in enumerate(zip(out, lp.top_logprobs)):  # the 2 likeliest, and the token itself
        vals, ids2 = torch.topk(ref[i], 2)
        want = {piece(a): v for a, v in zip(ids2.tolist(), vals.tolist())}
        want.setdefault(piece(t), float(ref[i, t]))
        assert top.keys() == want.keys() and all(abs(top[k] - want[k]) < 1e-4 for k in want), i


def test_64_concurrent_requests(server):
    c = client(server)
    ask = lambda i: c.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "user", "content": f"How many people live in country number {i}?"}])
    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(ask, range(64)))
    assert len(results) == 64 and all(r.choices[0].message.content is not None for r in results)
    assert all(r.usage.completion_tokens >= 1 for r in results)


def test_cancelled_stream_frees_the_replica(server):
    c = client(server)
    stream = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=64, temperature=0.9, seed=1,
                                       stream=True)
    next(iter(stream))
    stream.close()  # the client goes away mid-generation
    t0 = time.time()
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=8, temperature=0)
    assert r.choices[0].message.content is not None and time.time() - t0 < 60


def test_api_key_required(server):
    """As vLLM's --api-key: no key or a wrong one gets 401 with OpenAI's invalid_api_key body; /health needs none."""
    body = json.dumps({"model": MODEL, "messages": MSGS, "max_tokens": 4}).encode()
    for headers in ({"Content-Type": "application/json"},
                    {"Content-Type": "application/json", "Authorization": "Bearer wrong"},
                    {"Content-Type": "application/json", "Authorization": KEY}):  # no scheme
        status, err = post(server, "/v1/chat/completions", body, headers)
        assert status == 401 and err["error"]["code"] == "invalid_api_key", (headers, status, err)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    with urllib.request.urlopen(server + "/health", timeout=30) as r:
        assert r.status == 200
    assert client(server).models.list().data[0].id == MODEL


def test_api_key_rules(monkeypatch, tiny_target):
    from infer.serve import ServeConfig, is_loopback, with_api_key

    assert all(map(is_loopback, ["127.0.0.1", "127.0.0.2", "::1", "localhost"]))
    assert not any(map(is_loopback, ["0.0.0.0", "10.0.0.7", "example.org"]))
    monkeypatch.delenv("EAGLERAY_API_KEY", raising=False)
    open_cfg = ServeConfig(target=tiny_target, host="0.0.0.0")
    with pytest.raises(ValueError, match="api_key: required when host is 0.0.0.0"):
        with_api_key(open_cfg)
    assert with_api_key(ServeConfig(target=tiny_target)).api_key is None  # loopback: a key is optional
    monkeypatch.setenv("EAGLERAY_API_KEY", "from-env")
    assert with_api_key(open_cfg).api_key == "from-env"
    assert with_api_key(open_cfg.model_copy(update={"api_key": "from-yaml"})).api_key == "from-yaml"
    with pytest.raises(ValueError, match="vllm backend"):
        with_api_key(ServeConfig(target=tiny_target, host="0.0.0.0", backend="vllm"))


def test_sigterm_drains_requests_in_flight_then_exits_cleanly(tmp_path, tiny_target, tiny_head):
    """`eagleray serve` stopped as a process manager stops it (SIGTERM): every request already sent
    finishes whole, then the process exits 0 with no traceback. Its own Ray head: stopping Serve there
    leaves the session's endpoint alone."""
    import signal
    import subprocess
    import sys

    from conftest import start_head, stop_head, write_yaml

    head = start_head()
    port = _free_port()
    cfg = write_yaml(tmp_path / "serve.yaml", {
        "target": str(tiny_target), "head": str(tiny_head), "model_name": MODEL, "port": port,
        "ray_address": head["address"], "app_name": "drain", "num_cpus_per_replica": 0,
        "threads_per_replica": 1, "max_tokens_limit": 64, "request_timeout_s": 60})
    proc = subprocess.Popen([sys.executable, "-m", "infer.serve", str(cfg)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=head["env"])
    try:
        url = f"http://127.0.0.1:{port}"
        for line in proc.stdout:  # the deployment is up once it says where it serves
            if line.startswith("serving "):
                break
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        def ask(i):
            r = c.chat.completions.create(model=MODEL, max_tokens=64, temperature=0, messages=[
                {"role": "user", "content": f"Tell me about the number {i}."}])
            return r, time.monotonic()

        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(ask, i) for i in range(8)]  # one replica, batch 1: they queue on it
            time.sleep(0.5)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            results, done = zip(*[f.result() for f in futures])
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
        stop_head(head["markers"])
    assert proc.returncode == 0, out[-3000:]
    assert max(done) > signalled  # some were still running when the signal came, and finished
    assert all(r.choices[0].finish_reason in ("stop", "length") and r.usage.completion_tokens >= 1
               for r in results)
    assert "Traceback" not in out and "stopped tiny-eagle" in out, out[-3000:]
