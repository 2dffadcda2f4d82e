"""`eagleray cluster check`: every stage by `ray job submit` on a three-node cluster, with a
worker node killed (`kill -9` of its raylet) in the middle of capture, of training and of a served load
(docs/USAGE.md "On a cluster").

Work goes to the worker nodes through their custom resource (`eagleray_worker: 1`: one actor, train worker
or replica per worker node); the head runs the job drivers. Every stage's data lives on S3 (moto's server,
`S3Server`, started beside the nodes; each node gets its endpoint and credentials in its environment, as a
real cluster's nodes would): the corpus, run_dir and shards, the trainer's out_dir with Ray Train's
checkpoints, the head, the eval report. Only the target and the configs are local files.
"""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import os

import pyarrow.fs as pafs
import yaml

from infer.cluster.local import ROOT, LocalCluster, S3Server, free_port
from pipeline import storage

BUCKET = "s3://eagleray/check"

ON_WORKERS = {"eagleray_worker": 1}
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}


def write_yaml(path: Path, tree: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def make_inputs(folder: Path) -> tuple[Path, Path]:
    """The demo corpus (0.5 MB) and the tiny target (trained here, ~20 s), made once and reused."""
    corpus, target = folder / "corpus", folder / "target"
    if not (corpus / "train.jsonl").is_file():
        subprocess.run([sys.executable, "-m", "infer.demo.corpus", "--out", str(corpus), "--seed", "0",
                        "--size-mb", "0.5"], check=True, stdout=subprocess.DEVNULL)
    if not (target / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "infer.demo.target", "--out", str(target), "--preset", "tiny",
                        "--corpus", str(corpus / "train.jsonl")], check=True, stdout=subprocess.DEVNULL)
    return corpus / "train.jsonl", target


def pipeline_tree(run_dir: str, target: Path, corpus: str, records: int, regenerate: bool = True) -> dict:
    """Every stage, its actors one per worker node; capture cut small (4 rows a shard) so a kill lands mid-way."""
    actors = {"num_actors": 2, "num_cpus_per_actor": 0.5, "threads_per_actor": 1, "resources_per_actor": ON_WORKERS}
    return {"run_dir": str(run_dir), "target": str(target),
            "ingest": {"sources": [{"path": str(corpus), "format": "sharegpt", "max_records": records}]},
            "regenerate": {"enabled": regenerate, "engine": "hf", "max_new_tokens": 24, "batch_size": 4, **actors},
            "tokenize": {"max_length": 256},
            "capture": {"rows_per_shard": 4, "batch_tokens": 256, **actors},
            "vocab": {"draft_vocab_size": 256}}


def run_job(cl: LocalCluster, name: str, entrypoint: list[str], out: Path, during=None,
            timeout_s: float = 900) -> tuple[str, dict | None]:
    """Submit, call `during(cl)` once the job runs (a fault), wait for its end; its logs go to out/NAME.log.
    -> (the job's status, what `during` returned)."""
    sid = f"{name}-{int(time.time())}"
    res = cl.submit(entrypoint, sid, wait=False)
    if res.returncode:
        (out / f"{name}.log").write_text(res.stdout + res.stderr)
        return f"NOT SUBMITTED: {res.stderr.strip().splitlines()[-1:]}", None
    extra = during(cl) if during else None
    deadline, status = time.time() + timeout_s, "PENDING"
    while time.time() < deadline:
        status = cl.job_status(sid)
        if status in TERMINAL:
            break
        time.sleep(2)
    (out / f"{name}.log").write_text(cl.job_logs(sid))
    return status, extra


def shard_digests(capture: str) -> dict:
    """The manifest's counts and row digests, and every shard file's bytes and ids as found at the URI."""
    man = json.loads(storage.read_text(storage.join(capture, "manifest.json")))
    files = storage.list_names(capture, "shard-*.parquet")
    return {"rows": man["rows"], "tokens": man["tokens"], "files": len(files),
            "rows_digests": {s["file"]: s["rows_digest"] for s in man["shards"]},
            "bytes": {f: hashlib.sha256(storage.read_bytes(storage.join(capture, f))).hexdigest() for f in files},
            "ids": [i for f in files for i in storage.read_table(storage.join(capture, f), ["id"])["id"].to_pylist()]}


def read_json(loc, default=None):
    return json.loads(storage.read_text(loc)) if storage.is_file(loc) else default


def kill_when(cl: LocalCluster, node: str, ready, what: str, wait_s: float = 600, down_s: float = 4,
              progress=None) -> dict:
    """Wait for `ready()`, kill -9 `node`'s raylet, let the cluster see it dead, start the node again.
    `progress()`, read at the kill, says how far the stage was (`at_kill`)."""
    deadline = time.time() + wait_s
    while not ready():
        if time.time() > deadline:
            return {"killed": False, "why": f"{what} never reached"}
        time.sleep(0.2)
    t = time.time()
    pid = cl.kill_node(node)
    at_kill = progress() if progress else None
    time.sleep(down_s)
    cl.restart_node(node)
    return {"killed": True, "raylet_pid": pid, "killed_at": round(t, 1), "node": node, "at_kill": at_kill}


def capture_fault(cl: LocalCluster, out: Path, corpus: Path, target: Path, records: int, baseline: dict,
                  regenerate: bool = True) -> dict:
    """The pipeline again, worker1 killed once 3 shards are written; its manifest against `baseline`'s."""
    run_dir = f"{BUCKET}/pipeline_fault"
    cfg = write_yaml(out / "pipeline_fault.yaml", pipeline_tree(run_dir, target, corpus, records, regenerate))
    written = lambda: len(storage.list_names(f"{run_dir}/capture", "shard-*.parquet"))  # noqa: E731
    status, kill = run_job(cl, "pipeline_fault", ["python", "-m", "pipeline", str(cfg)], out,
                           during=lambda c: kill_when(c, "worker1", lambda: written() >= 3, "capture",
                                                      progress=written))
    res = {"job": status, **(kill or {}), "rows_expected": baseline["rows"]}
    if storage.is_file(f"{run_dir}/capture/manifest.json"):
        found = shard_digests(f"{run_dir}/capture")
        res |= {"rows_found": found["rows"], "tokens_equal": found["tokens"] == baseline["tokens"],
                "duplicates": len(found["ids"]) - len(set(found["ids"])), "shard_files": found["files"],
                "digests_equal": found["rows_digests"] == baseline["rows_digests"],
                "bytes_equal": found["bytes"] == baseline["bytes"]}
    return res


def train_tree(out_dir: str, target: Path, shards: str) -> dict:
    return {"target": str(target), "out_dir": str(out_dir),
            "data": {"shards": str(shards), "max_rows_per_batch": 4, "val_rows": 8},
            "model": {"ttt_length": 3}, "optim": {"lr": 5e-3}, "max_steps": 60, "epochs": 30,
            "log_every": 5, "checkpoint_every": 10, "eval_every": 30,
            "scaling": {"num_workers": 2, "cpus_per_worker": 0.5, "threads_per_worker": 1,
                        "resources_per_worker": ON_WORKERS, "max_failures": 3}}


def latest_step(out_dir: str) -> int:
    """The newest checkpoint's step at the URI (Ray Train's storage), 0 before the first."""
    fs, path = storage.filesystem(f"{out_dir}/ray/train")
    steps = [read_json(f"{out_dir}/ray/train/{d.base_name}/trainer_state.json", {}).get("global_step", 0)
             for d in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)) if d.base_name.startswith("checkpoint_")]
    return max(steps, default=0)


def train_fault(cl: LocalCluster, out: Path, target: Path, shards: str) -> tuple[str, dict]:
    out_dir = f"{BUCKET}/train"
    cfg = write_yaml(out / "train.yaml", train_tree(out_dir, target, shards))
    status, kill = run_job(cl, "trainer", ["python", "-m", "trainer", str(cfg)], out,
                           during=lambda c: kill_when(c, "worker2", lambda: latest_step(out_dir) >= 20, "step 20",
                                                      progress=lambda: latest_step(out_dir)))
    resumes = [json.loads(x) for x in storage.read_text(f"{out_dir}/resumes.jsonl").splitlines()] \
        if storage.is_file(f"{out_dir}/resumes.jsonl") else []
    report, history = read_json(f"{out_dir}/report.json", {}), read_json(f"{out_dir}/history.json", [])
    steps = [h["step"] for h in history if "loss" in h]
    return status, {**(kill or {}), "resumed_from_step": resumes[-1]["step"] if resumes else None,
                    "final_step": report.get("steps"), "steps_logged_twice": len(steps) - len(set(steps)),
                    "exported": storage.is_file(f"{out_dir}/head_speculators/config.json")}


def eval_tree(out_dir: str, target: Path, head: str) -> dict:
    return {"target": str(target), "head": str(head), "out_dir": str(out_dir),
            "benchmarks": [{"name": "mt_bench", "kind": "mt_bench", "path": str(ROOT / "data/mt_bench/question.jsonl"),
                            "limit": 2}, {"name": "gsm8k", "kind": "gsm8k", "path": str(ROOT / "data/gsm8k/test.jsonl"),
                                          "limit": 2}],
            "decode": {"max_new_tokens": 24}, "num_actors": 2, "cpus_per_actor": 0.5, "threads_per_actor": 1,
            "resources_per_actor": ON_WORKERS}


class Load:
    """One client sending chat requests back to back through the `openai` client; each outcome timed."""

    def __init__(self, url: str, key: str, model: str):
        from openai import OpenAI

        self.client = OpenAI(base_url=url, api_key=key, max_retries=0, timeout=60)
        self.model, self.log, self.stop = model, [], threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def loop(self):
        while not self.stop.is_set():
            t = time.time()
            try:
                r = self.client.chat.completions.create(model=self.model, max_tokens=12,
                                                        messages=[{"role": "user", "content": "Say hello."}])
                ok = bool(r.choices[0].message.content is not None)
            except Exception:  # noqa: BLE001 - a failed request is what is counted
                ok = False
                time.sleep(0.2)
            self.log.append((t, time.time(), ok))


def running(cl: LocalCluster, app: str = "eagleray") -> int:
    """Replicas of the Serve app in state RUNNING (Serve's REST API on the dashboard); 0 while it answers not."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{cl.dashboard}/api/serve/applications/", timeout=10) as r:
            apps = json.loads(r.read())["applications"]
    except (OSError, ValueError):
        return 0
    deps = apps.get(app, {}).get("deployments", {})
    return sum(1 for d in deps.values() for rep in d.get("replicas", []) if rep.get("state") == "RUNNING")


def stop_serve(cl: LocalCluster, wait_s: float = 120) -> bool:
    """Shut Serve down (its REST API on the dashboard): its replicas hold the worker nodes' `eagleray_worker`
    resource, and a later job asking for it would wait forever (the first --throughput run hung so)."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(f"{cl.dashboard}/api/serve/applications/", method="DELETE"),
                           timeout=60)
    deadline = time.time() + wait_s
    while running(cl) and time.time() < deadline:
        time.sleep(2)
    return running(cl) == 0


def serve_fault(cl: LocalCluster, out: Path, target: Path, head: str) -> tuple[str, dict]:
    port, key = free_port(), "cluster-check-key"
    cfg = write_yaml(out / "serve.yaml", {
        "target": str(target), "head": str(head), "model_name": "eagleray-check", "host": "127.0.0.1", "port": port,
        "api_key": key, "num_replicas": 2, "num_cpus_per_replica": 0.5, "threads_per_replica": 1,
        "resources_per_replica": ON_WORKERS, "proxy_location": "HeadOnly", "default_max_tokens": 12,
        "speculative": {"mode": "chain", "depth": 3}})
    status, _ = run_job(cl, "serve", ["python", "-m", "infer.serve", str(cfg), "--detach"], out)
    deadline = time.time() + 600
    while time.time() < deadline and running(cl) < 2:
        time.sleep(2)
    load = Load(f"http://127.0.0.1:{port}/v1", key, "eagleray-check")
    load.thread.start()
    time.sleep(10)
    t_kill = time.time()
    cl.kill_node("worker1")
    time.sleep(4)
    cl.restart_node("worker1")
    while time.time() < deadline and running(cl) < 2:
        time.sleep(1)
    t_back = time.time()
    time.sleep(20)
    load.stop.set()
    load.thread.join(timeout=90)
    before = [ok for t0, _, ok in load.log if t0 < t_kill]
    during = [ok for t0, _, ok in load.log if t_kill <= t0 < t_back]
    after = [ok for t0, _, ok in load.log if t0 >= t_back]
    return status, {"requests_before": len(before), "failed_before": before.count(False),
                    "requests_during": len(during), "failed_during": during.count(False),
                    "requests_after": len(after), "failed_after": after.count(False),
                    "down_s": round(t_back - t_kill, 1)}


def node_rss_mb(cl: LocalCluster) -> dict:
    """Resident memory of each node's processes (Ray's own: GCS, raylet, dashboard, agents, idle workers)."""
    from infer.cluster.local import processes

    out = {}
    for n in cl.nodes:
        rss = 0
        for p in processes((n.temp_dir + "/",)):
            try:
                rss += p.memory_info().rss
            except Exception:  # noqa: BLE001 - a process that just ended
                pass
        out[n.name] = round(rss / 2 ** 20)
    return out


def throughput(cl: LocalCluster, out: Path, target: Path, corpus: Path, records: int) -> tuple[dict, dict]:
    """Capture and training tokens/s on one worker node against two, one after the other in this run.
    Capture reruns on the pipeline's tokens (the other stages off); training trains 30 steps, no fault."""
    one, both = {"eagleray_worker1": 1}, ON_WORKERS
    cap, train = {}, {}
    for nodes, res in ((1, one), (2, both)):
        run_dir = f"{BUCKET}/capture_{nodes}node"
        storage.write_bytes(f"{run_dir}/tokenize/tokens.parquet",
                            storage.read_bytes(f"{BUCKET}/pipeline/tokenize/tokens.parquet"))
        tree = pipeline_tree(run_dir, target, corpus, records, regenerate=False)
        tree["ingest"]["enabled"] = False
        tree["tokenize"]["enabled"] = tree["vocab"]["enabled"] = False
        tree["capture"] |= {"num_actors": nodes, "resources_per_actor": res}
        cfg = write_yaml(out / f"capture_{nodes}node.yaml", tree)
        status, _ = run_job(cl, f"capture_{nodes}node", ["python", "-m", "pipeline", str(cfg)], out)
        c = read_json(f"{run_dir}/summary.json", {}).get("capture") if status == "SUCCEEDED" else {}
        cap[nodes] = round(c["tokens"] / c["wall_s"], 1) if c else None
        t_out = f"{BUCKET}/train_{nodes}node"
        t = train_tree(t_out, target, f"{BUCKET}/pipeline/capture")
        t |= {"max_steps": 30, "checkpoint_every": 30, "eval_every": 30}
        t["scaling"] |= {"num_workers": nodes, "resources_per_worker": res, "max_failures": 0}
        status, _ = run_job(cl, f"train_{nodes}node", ["python", "-m", "trainer", str(write_yaml(out / f"train_{nodes}node.yaml", t))], out)
        r = read_json(f"{t_out}/report.json", {}) if status == "SUCCEEDED" else {}
        train[nodes] = r.get("tokens_per_s")
    ratio = lambda d: round(d[2] / d[1], 3) if d.get(1) and d.get(2) else None  # noqa: E731
    return ({"one_node_tokens_per_s": cap[1], "two_nodes_tokens_per_s": cap[2], "ratio": ratio(cap)},
            {"one_node_tokens_per_s": train[1], "two_nodes_tokens_per_s": train[2], "ratio": ratio(train)})


def run_check(args) -> dict:
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    corpus, target = make_inputs(out / "inputs")
    records = 64
    result: dict = {"jobs": {}, "storage": BUCKET}
    with S3Server() as s3, LocalCluster(Path(args.dir), workers=args.workers, env=s3.env) as cl:
        os.environ.update(s3.env)  # this process reads the results from the same store
        storage.write_bytes(f"{BUCKET}/corpus/train.jsonl", corpus.read_bytes())
        corpus = f"{BUCKET}/corpus/train.jsonl"
        result["nodes"] = len(cl.alive_nodes())
        result["ray_rss_mb_at_start"] = node_rss_mb(cl)
        cfg = write_yaml(out / "pipeline.yaml", pipeline_tree(f"{BUCKET}/pipeline", target, corpus, records))
        result["jobs"]["pipeline"] = run_job(cl, "pipeline", ["python", "-m", "pipeline", str(cfg)], out)[0]
        shards = f"{BUCKET}/pipeline/capture"
        if result["jobs"]["pipeline"] == "SUCCEEDED":
            result["capture_fault"] = capture_fault(cl, out, corpus, target, records, shard_digests(shards))
            result["jobs"]["trainer"], result["train_fault"] = train_fault(cl, out, target, shards)
        head = f"{BUCKET}/train/head_speculators"
        if result["jobs"].get("trainer") == "SUCCEEDED":
            ecfg = write_yaml(out / "eval.yaml", eval_tree(f"{BUCKET}/eval", target, head))
            result["jobs"]["eval"] = run_job(cl, "eval", ["python", "-m", "infer.eval", str(ecfg)], out)[0]
            result["jobs"]["serve"], result["serve_fault"] = serve_fault(cl, out, target, head)
            result["serve_stopped"] = stop_serve(cl)
        result["check_wall_s"] = round(time.time() - t0, 1)  # the check itself, before --throughput
        if args.throughput and result["jobs"]["pipeline"] == "SUCCEEDED":
            result["capture_2_vs_1"], result["train_2_vs_1"] = throughput(cl, out, target, corpus, records)
    result["wall_s"] = round(time.time() - t0, 1)
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return result
