"""The cluster check's serving jobs (infer/cluster/check.py): each deployed by `ray job submit ... --detach`
with its two replicas on the two worker nodes, which have disks of their own, so the target and the heads
reach the replicas only from S3.

- `serve_fault`: the eagleray backend under load, worker1 killed: requests before, during, after.
- `serve_vllm`: the vllm backend (Ray Serve LLM), its replicas' engines drafting with the head; worker2
  killed, and the restarted replica's engine finds the head again on its fresh disk.
- `flywheel`: the eagleray backend logging its traffic to S3, one `eagleray flywheel` round as a job with
  its work_dir on S3, and the promoted head served by both replicas.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from infer.cluster.isolation import connected
from infer.cluster.jobs import (BUCKET, ON_WORKERS, Load, pipeline_tree, read_json, run_job, running, stop_serve,
                                train_tree, write_yaml)
from infer.cluster.local import ROOT, LocalCluster, free_port
from pipeline import storage

KEY = "cluster-check-key"


def wait_replicas(cl: LocalCluster, count: int, deployment: str = "", wait_s: float = 600) -> bool:
    deadline = time.time() + wait_s
    while time.time() < deadline:
        if running(cl, deployment=deployment) >= count:
            return True
        time.sleep(2)
    return False


def eagleray_serve(port: int, target: str, head: str, **extra) -> dict:
    return {"target": target, "head": head, "model_name": "eagleray-check", "host": "127.0.0.1", "port": port,
            "api_key": KEY, "num_replicas": 2, "num_cpus_per_replica": 0.5, "threads_per_replica": 1,
            "resources_per_replica": ON_WORKERS, "proxy_location": "HeadOnly", "default_max_tokens": 12,
            "speculative": {"mode": "chain", "depth": 3}, **extra}


def serve_fault(cl: LocalCluster, out: Path, target: str, head: str) -> tuple[str, dict]:
    port = free_port()
    cfg = write_yaml(out / "serve.yaml", eagleray_serve(port, target, head))
    status, _ = run_job(cl, "serve", ["python", "-m", "infer.serve", str(cfg), "--detach"], out)
    wait_replicas(cl, 2)
    load = Load(f"http://127.0.0.1:{port}/v1", KEY, "eagleray-check")
    load.thread.start()
    time.sleep(10)
    t_kill = time.time()
    cl.kill_node("worker1")
    time.sleep(4)
    cl.restart_node("worker1")
    wait_replicas(cl, 2)
    t_back = time.time()
    time.sleep(20)
    load.stop.set()
    load.thread.join(timeout=90)
    stopped = stop_serve(cl)
    before = [ok for t0, _, ok in load.log if t0 < t_kill]
    during = [ok for t0, _, ok in load.log if t_kill <= t0 < t_back]
    after = [ok for t0, _, ok in load.log if t0 >= t_back]
    return status, {"killed": True, "requests_before": len(before), "failed_before": before.count(False),
                    "requests_during": len(during), "failed_during": during.count(False),
                    "requests_after": len(after), "failed_after": after.count(False),
                    "down_s": round(t_back - t_kill, 1), "serve_stopped": stopped}


def answers(url: str, model: str, prompts: list[str], key: str | None = None, max_tokens: int = 16) -> list:
    """Greedy chat answers through the `openai` client, 4 at a time -> (text or None) per prompt."""
    from openai import OpenAI

    client = OpenAI(base_url=url, api_key=key or "none", max_retries=2, timeout=180)

    def ask(q):
        try:
            r = client.chat.completions.create(model=model, max_tokens=max_tokens, temperature=0,
                                               messages=[{"role": "user", "content": q}])
            return r.choices[0].message.content
        except Exception:  # noqa: BLE001 - a failed request is what is counted
            return None

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(ask, prompts))


def serve_vllm(cl: LocalCluster, out: Path, target: str, head: str) -> tuple[str, dict]:
    """The vllm backend, detached: 8 requests, worker2 killed and restarted, 8 more once its replica is
    back; vLLM's draft counters say the engines drafted with the head."""
    from infer.serve_vllm import engine_spec_counters

    port, model = free_port(), "eagleray-check-vllm"
    cfg = write_yaml(out / "serve_vllm.yaml", {
        "backend": "vllm", "target": target, "head": head, "model_name": model, "host": "127.0.0.1",
        "port": port, "num_replicas": 2, "num_cpus_per_replica": 1, "resources_per_replica": ON_WORKERS,
        "proxy_location": "HeadOnly", "speculative": {"mode": "chain", "depth": 3},
        "vllm": {"max_model_len": 512, "max_num_seqs": 4, "kv_cache_gb": 1}})
    status, _ = run_job(cl, "serve_vllm", ["python", "-m", "infer.serve", str(cfg), "--detach"], out)
    url, prompts = f"http://127.0.0.1:{port}/v1", [f"Name a colour, number {i}." for i in range(8)]
    res = {"replicas_up": wait_replicas(cl, 2, "LLMServer")}
    first = answers(url, model, prompts)
    cl.kill_node("worker2")
    time.sleep(4)
    cl.restart_node("worker2")
    t = time.time()
    res["replicas_back"] = wait_replicas(cl, 2, "LLMServer", wait_s=900)
    res["restart_s"] = round(time.time() - t, 1)
    time.sleep(3)
    second = answers(url, model, prompts)
    time.sleep(8)  # the engines' metrics reach Ray's export every few seconds
    with connected(cl):
        counters = engine_spec_counters(model)
    res |= {"requests": len(first) + len(second), "failed": (first + second).count(None),
            "same_answers_after_restart": first == second and None not in first,
            "drafts": counters["drafts"], "tau": counters["tau"], "serve_stopped": stop_serve(cl)}
    return status, res


def head_states(url: str, n: int = 24) -> set:
    """(node, head_version) of the replicas that answer n GETs of /v1/admin/head."""
    import urllib.request

    def get(_):
        req = urllib.request.Request(url + "/v1/admin/head", headers={"Authorization": f"Bearer {KEY}"})
        try:
            st = json.loads(urllib.request.urlopen(req, timeout=30).read())
            return st["node"], st["head_version"]
        except (OSError, ValueError, KeyError):
            return None

    with ThreadPoolExecutor(4) as pool:
        return {s for s in pool.map(get, range(n)) if s}


def traffic_rows(traffic: str) -> int:
    return sum(storage.parquet_file(f).metadata.num_rows for f in storage.expand(storage.join(traffic, "*.parquet")))


def send_traffic(url: str, traffic: str, count: int, wait_s: float = 300) -> int:
    """`count` distinct chats, then wait for the replicas' log files at the URI to hold them -> rows there."""
    answers(f"{url}/v1", "eagleray-check", [f"Tell me about the river number {i}, please." for i in range(count)],
            KEY, max_tokens=24)
    deadline = time.time() + wait_s
    while traffic_rows(traffic) < count and time.time() < deadline:
        time.sleep(2)
    return traffic_rows(traffic)


def flywheel_configs(out: Path, url: str, target: str, corpus: str, work_dir: str) -> Path:
    """The round's base YAMLs and its own: plain CPUs for its jobs (the replicas hold `eagleray_worker`);
    a gate that promotes any head no worse than half the serving one (the mechanics, not the lift)."""
    base = pipeline_tree(f"{BUCKET}/unused", target, corpus, 8, regenerate=False)
    for stage in ("capture",):
        base[stage] |= {"resources_per_actor": {}}
    trainer = train_tree(f"{BUCKET}/unused", target, "unused")
    trainer |= {"max_steps": 20, "checkpoint_every": 20, "eval_every": 20, "data": {
        "shards": "unused", "max_rows_per_batch": 4, "val_rows": 0}}
    trainer["scaling"] |= {"resources_per_worker": {}, "max_failures": 0}
    bench = {"name": "mt_bench", "kind": "mt_bench", "path": str(ROOT / "data/mt_bench/question.jsonl"), "limit": 2}
    return write_yaml(out / "flywheel.yaml", {
        "endpoint": url, "api_key": KEY, "work_dir": work_dir, "min_records": 32, "held_out": 0.25,
        "pipeline": str(write_yaml(out / "flywheel_pipeline.yaml", base)),
        "trainer": str(write_yaml(out / "flywheel_trainer.yaml", trainer)),
        "replay": {"shards": f"{BUCKET}/pipeline/capture", "share": 0.5},
        "gate": {"benchmarks": [bench], "min_gain": 0.5, "max_drop": 0.5, "held_out_limit": 8,
                 "decode": {"max_new_tokens": 24}}})


def flywheel(cl: LocalCluster, out: Path, target: str, head: str, corpus: str) -> tuple[str, dict]:
    """Serve with the traffic log at S3, send 40 chats, one flywheel round as a job (work_dir at S3), then
    which head each replica serves."""
    from trainer.export import head_version

    port, traffic, work_dir = free_port(), f"{BUCKET}/traffic", f"{BUCKET}/flywheel"
    url = f"http://127.0.0.1:{port}"
    serve = write_yaml(out / "serve_flywheel.yaml", eagleray_serve(
        port, target, head, traffic_log={"path": traffic, "flush_s": 1}, swap_poll_s=1))
    serve_status, _ = run_job(cl, "serve_flywheel", ["python", "-m", "infer.serve", str(serve), "--detach"], out)
    res: dict = {"serve_job": serve_status, "replicas_up": wait_replicas(cl, 2)}
    res["traffic_rows"] = send_traffic(url, traffic, 40)
    cfg = flywheel_configs(out, url, target, corpus, work_dir)
    status, _ = run_job(cl, "flywheel", ["python", "-m", "infer.flywheel", str(cfg)], out, timeout_s=1200)
    state = read_json(f"{work_dir}/round-001/state.json", {}).get("steps", {})
    new = head_version(storage.node_copy(state["train"]["candidate"])) if "train" in state else None
    deadline, states = time.time() + 60, set()
    while time.time() < deadline:
        states = head_states(url)
        if new and len({n for n, _ in states}) == 2 and {v for _, v in states} == {new}:
            break
        time.sleep(3)
    res |= {"steps": list(state), "promoted": bool(state.get("gate", {}).get("promote")),
            "swapped": bool(state.get("swap", {}).get("swapped")), "new_head_version": new,
            "replica_nodes": len({n for n, _ in states}),
            "replicas_on_new_head": len({n for n, v in states if v == new}), "serve_stopped": stop_serve(cl)}
    return status, res
