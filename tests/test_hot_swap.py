"""Learning from traffic on a live endpoint: the hot swap under load, a head reaching a second replica, and
one `eagleray flywheel` round against the endpoint (infer/head_swap.py, infer/flywheel.py). This module starts
its own keyed endpoint with the traffic log on (tests/test_serve.py's fixture), so its swaps touch no other
module's server."""
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from test_serve import AUTH, KEY, MODEL, MSGS, client, greedy_text, post, server  # noqa: F401 (server: the fixture)

pytestmark = pytest.mark.slow


def perturbed_head(src, dst, scale: float):
    """A copy of a head folder with its weights scaled a little: another version, as lossless as any head."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        state = load_file(f)
        save_file({k: v * scale if v.is_floating_point() else v for k, v in state.items()}, f)
    return dst


def test_hot_swap_under_load_and_a_broken_head_refused(server, tiny_head, tiny_target, tmp_path):
    """16 clients ask without pause while a new head is promoted: none fails, every answer is the target's
    greedy text, each usage names the head that decoded it, and requests sent after the promotion returned
    are all the new head's. A head whose weights do not load is refused (422) and the new head keeps serving."""
    from trainer.export import head_version

    c = client(server)
    old, new = head_version(tiny_head), head_version(perturbed_head(tiny_head, tmp_path / "head_b", 0.97))
    broken = perturbed_head(tiny_head, tmp_path / "head_broken", 1.0)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    want = greedy_text(tiny_target, MSGS, 24)
    swapped, results, errors = [], [], []

    def ask(i):
        while not swapped or time.time() < swapped[0] + 3:
            sent = time.time()
            try:
                r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=24, temperature=0)
                results.append((sent, r.choices[0].message.content, r.usage.model_extra["head_version"]))
            except Exception as e:  # counted: the goal is none
                errors.append(repr(e))

    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(ask, i) for i in range(16)]
        time.sleep(4)
        status, body = post(server, "/v1/admin/head", json.dumps({"head": str(tmp_path / "head_b")}).encode())
        swapped.append(time.time())
        for f in futures:
            f.result()
    assert status == 200 and body["head_version"] == new and body["previous"] == old, body
    assert errors == []
    assert {text for _, text, _ in results} == {want}
    by = {v: sum(1 for _, _, x in results if x == v) for v in (old, new)}
    assert by[old] > 0 and by[new] > 0 and by[old] + by[new] == len(results), by
    assert all(v == new for sent, _, v in results if sent > swapped[0])

    status, body = post(server, "/v1/admin/head", json.dumps({"head": str(broken)}).encode())
    assert status == 422 and body["error"]["param"] == "head" and "does not load" in body["error"]["message"]
    with urllib.request.urlopen(urllib.request.Request(server + "/v1/admin/head", headers=AUTH), timeout=30) as r:
        state = json.loads(r.read())
    assert state["head_version"] == new and state["refused"][-1]["head"] == str(broken)
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=24, temperature=0)
    assert r.choices[0].message.content == want and r.usage.model_extra["head_version"] == new
    status, body = post(server, "/v1/admin/head", json.dumps({"head": str(tiny_head)}).encode())
    assert status == 200 and body["head_version"] == old  # the module's other tests see the fixture's head


def test_a_head_promoted_on_one_replica_reaches_the_other(server, tiny_target, tiny_head, tmp_path):
    """Two replicas: the admin call swaps the one it reaches, the other takes the head from the registry
    within its poll; after that every answer, whichever replica gives it, is the new head's and the target's."""
    from ray import serve

    from infer.serve import ServeConfig, start
    from trainer.export import head_version

    port = int(server.rsplit(":", 1)[1])
    cfg = ServeConfig(target=tiny_target, head=tiny_head, model_name=MODEL, port=port, app_name="two",
                      route_prefix="/two", num_replicas=2, num_cpus_per_replica=0, threads_per_replica=1,
                      max_tokens_limit=64, speculative={"sizing": "fixed"}, api_key=KEY, swap_poll_s=0.5)
    url = start(cfg)
    try:
        new = head_version(perturbed_head(tiny_head, tmp_path / "head_two", 0.98))
        status, body = post(url, "/v1/admin/head", json.dumps({"head": str(tmp_path / "head_two")}).encode())
        assert status == 200 and body["head_version"] == new
        time.sleep(4)  # the other replica's poll (0.5 s), its load and check
        c, want = client(url), greedy_text(tiny_target, MSGS, 16)
        ask = lambda i: c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=16, temperature=0)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, range(24)))
        assert {(a.choices[0].message.content, a.usage.model_extra["head_version"]) for a in answers} == {(want, new)}
        get = lambda i: json.loads(urllib.request.urlopen(urllib.request.Request(  # noqa: E731
            url + "/v1/admin/head", headers=AUTH), timeout=30).read())
        with ThreadPoolExecutor(8) as pool:
            states = {(st["replica"], st["head_version"]) for st in pool.map(get, range(48))}
        assert len(states) == 2 and {v for _, v in states} == {new}, states  # both replicas answered, both new
    finally:
        serve.delete("two")


def test_flywheel_round_against_the_endpoint(server, tiny_target, tiny_head, pipeline_run, demo_corpus, tmp_path):
    """`eagleray flywheel`: the endpoint's logged traffic ingested (a held-out share kept apart), a head
    warm-started from the serving one trained on it with replay, gated, swapped in on the endpoint; run again
    with no new traffic it waits; the round's steps are in its state and its line in report.md."""
    from conftest import pipeline_tree, write_yaml
    from infer.cli import main as eagleray
    from trainer.export import head_version

    c = client(server)
    asks = [f"Tell me about the river number {i}, please." for i in range(48)]
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda q: c.chat.completions.create(model=MODEL, max_tokens=24, temperature=0, messages=[
            {"role": "user", "content": q}]), asks))
    time.sleep(1.5)  # the log's batches are written every flush_s (0.2 s)
    base = write_yaml(tmp_path / "pipeline.yaml", pipeline_tree(tmp_path / "unused", tiny_target,
                                                               demo_corpus / "train.jsonl"))
    trainer = write_yaml(tmp_path / "trainer.yaml", {
        "target": str(tiny_target), "out_dir": str(tmp_path / "unused"),
        "data": {"shards": "unused", "max_rows_per_batch": 4, "val_rows": 0}, "model": {"ttt_length": 3},
        "optim": {"lr": 1e-3}, "max_steps": 30, "epochs": 2, "log_every": 10,
        "scaling": {"num_workers": 1, "cpus_per_worker": 1}})
    cfg = write_yaml(tmp_path / "flywheel.yaml", {
        "endpoint": server, "api_key": KEY, "work_dir": str(tmp_path / "fly"), "min_records": 32, "held_out": 0.25,
        "pipeline": str(base), "trainer": str(trainer),
        "replay": {"shards": str(pipeline_run / "capture"), "share": 0.5},
        # the mechanics, not the lift: 30 steps on 36 records may not raise tau, so any head no worse than half
        "gate": {"benchmarks": [{"name": "mt_bench", "kind": "mt_bench", "path": "data/mt_bench/question.jsonl",
                                 "limit": 2}], "min_gain": 0.5, "max_drop": 0.5, "decode": {"max_new_tokens": 24}}})
    assert eagleray(["flywheel", str(cfg)]) == 0
    state = json.loads((tmp_path / "fly" / "round-001" / "state.json").read_text())
    steps = state["steps"]
    assert list(steps) == ["log", "pipeline", "train", "gate", "swap", "report"]
    assert steps["log"]["records"] >= 48 and steps["log"]["head"] == str(tiny_head)
    # the module's repeated greedy questions are duplicates and its completions no chats: counted rejects
    assert steps["pipeline"]["records"] + steps["pipeline"]["held_out"] >= 48
    assert steps["pipeline"]["held_out"] >= 12
    gate = steps["gate"]
    assert gate["promote"] and gate["identical"] and set(gate["sets"]) == {"traffic", "mt_bench"}
    assert gate["sets"]["traffic"]["prompts"] == steps["pipeline"]["held_out"]
    new = head_version(steps["train"]["candidate"])
    assert steps["swap"]["head_version"] == new and steps["swap"]["previous"] == head_version(tiny_head)
    with urllib.request.urlopen(server + "/health", timeout=30) as r:
        assert json.loads(r.read())["head_version"] == new
    r = c.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=24, temperature=0)
    assert r.usage.model_extra["head_version"] == new and r.choices[0].message.content == greedy_text(
        tiny_target, MSGS, 24)
    assert (tmp_path / "fly" / "report.md").read_text().count("\n| 1 |") == 1
    assert eagleray(["flywheel", str(cfg), "min_records=1000"]) == 0  # waits: round 2 has no step done
    assert not (tmp_path / "fly" / "round-002" / "state.json").exists()
    status, body = post(server, "/v1/admin/head", json.dumps({"head": str(tiny_head)}).encode())
    assert status == 200 and body["head_version"] == head_version(tiny_head)
