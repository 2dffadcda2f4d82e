"""What `eagleray cluster check` (infer/cluster/check.py) runs its jobs with: the inputs, each stage's config
tree with its work on the worker nodes (`eagleray_worker: 1`: one actor, train worker or replica per worker
node; the head runs the job drivers), `ray job submit` and its wait, the served load, and the one-node
against two-node throughput."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.fs as pafs
import yaml

from infer.cluster.local import ROOT, LocalCluster
from pipeline import storage

BUCKET = "s3://eagleray/check"

ON_WORKERS = {"eagleray_worker": 1}
TERMINAL = {"SUCCEEDED", "FAILED", "STOPPED"}
ONPOLICY_RECORDS = 8  # the check's on-policy round: fresh prompts decoded


def write_yaml(path: Path, tree: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def make_inputs(folder: Path) -> tuple[Path, Path]:
    """The demo corpus (0.5 MB) and the tiny target (trained here, ~20 s), made once and reused; the check
    uploads both to S3, where the worker nodes read them."""
    corpus, target = folder / "corpus", folder / "target"
    if not (corpus / "train.jsonl").is_file():
        subprocess.run([sys.executable, "-m", "infer.demo.corpus", "--out", str(corpus), "--seed", "0",
                        "--size-mb", "0.5"], check=True, stdout=subprocess.DEVNULL)
    if not (target / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "infer.demo.target", "--out", str(target), "--preset", "tiny",
                        "--corpus", str(corpus / "train.jsonl")], check=True, stdout=subprocess.DEVNULL)
    return corpus / "train.jsonl", target


def pipeline_tree(run_dir: str, target: str, corpus: str, records: int, regenerate: bool = True) -> dict:
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
    """Submit, call `during(cl, submission_id)` once submitted (a fault), wait for its end; its logs go to
    out/NAME.log.
    -> (the job's status, what `during` returned)."""
    sid = f"{name}-{int(time.time())}"
    res = cl.submit(entrypoint, sid, wait=False)
    if res.returncode:
        (out / f"{name}.log").write_text(res.stdout + res.stderr)
        return f"NOT SUBMITTED: {res.stderr.strip().splitlines()[-1:]}", None
    extra = during(cl, sid) if during else None
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


def train_tree(out_dir: str, target: str, shards: str) -> dict:
    return {"target": str(target), "out_dir": str(out_dir),
            "data": {"shards": str(shards), "max_rows_per_batch": 4, "val_rows": 8},
            "model": {"ttt_length": 3}, "optim": {"lr": 5e-3}, "max_steps": 60, "epochs": 30,
            "log_every": 5, "checkpoint_every": 10, "eval_every": 30,
            "scaling": {"num_workers": 2, "cpus_per_worker": 0.5, "threads_per_worker": 1,
                        "resources_per_worker": ON_WORKERS, "max_failures": 3}}


def onpolicy_round(cl: LocalCluster, out: Path, target: str, corpus: str) -> tuple[str, dict]:
    """`eagleray train` with one on-policy round as a job: the trained head decodes 8 fresh corpus prompts on
    Ray Data actors, one per worker node (`resources_per_actor`), the round's shards and warm start at S3.
    actor_nodes: the nodes the decode's actors were placed on; decode_nodes: those that decoded rows (an
    actor that starts last may find every prompt taken)."""
    out_dir = f"{BUCKET}/onpolicy"
    pipe = write_yaml(out / "onpolicy_pipeline.yaml", pipeline_tree(f"{BUCKET}/unused", target, corpus, 8, regenerate=False))
    tree = train_tree(out_dir, target, f"{BUCKET}/pipeline/capture") | {"max_steps": 20, "checkpoint_every": 20,
                                                                        "eval_every": 20}
    tree["data"] |= {"val_rows": 2}  # of the round's rows
    tree["onpolicy"] = {"rounds": 1, "pipeline": str(pipe), "start_head": f"{BUCKET}/train/head_speculators",
                        "records_per_round": ONPOLICY_RECORDS, "max_new_tokens": 24, "num_actors": 2, "cpus_per_actor": 0.5,
                        "threads_per_actor": 1, "resources_per_actor": ON_WORKERS}
    cfg = write_yaml(out / "onpolicy.yaml", tree)
    status, _ = run_job(cl, "onpolicy", ["python", "-m", "infer.onpolicy", str(cfg)], out, timeout_s=1200)
    report = read_json(f"{out_dir}/report.json", {}).get("onpolicy", {})
    r1 = (report.get("rounds") or [{}])[0]
    decode, data = r1.get("decode", {}), r1.get("data", {})
    return status, {"steps": list(read_json(f"{out_dir}/state.json", {})), "records": decode.get("records"),
                    "actor_nodes": len(set(cl.actor_nodes("RoundDecoder"))), "decode_nodes": decode.get("nodes"),
                    "decode_tau": decode.get("tau"), "rows": data.get("rows"),
                    "extra_target_forwards": report.get("extra_target_forwards"),
                    "exported": storage.is_file(f"{out_dir}/head_speculators/config.json")}


def latest_step(out_dir: str) -> int:
    """The newest checkpoint's step at the URI (Ray Train's storage), 0 before the first."""
    fs, path = storage.filesystem(f"{out_dir}/ray/train")
    steps = [read_json(f"{out_dir}/ray/train/{d.base_name}/trainer_state.json", {}).get("global_step", 0)
             for d in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)) if d.base_name.startswith("checkpoint_")]
    return max(steps, default=0)


def eval_tree(out_dir: str, target: str, head: str) -> dict:
    return {"target": str(target), "head": str(head), "out_dir": str(out_dir),
            "benchmarks": [{"name": "mt_bench", "kind": "mt_bench", "path": str(ROOT / "data/mt_bench/question.jsonl"),
                            "limit": 2}, {"name": "gsm8k", "kind": "gsm8k", "path": str(ROOT / "data/gsm8k/test.jsonl"),
                                          "limit": 2}],
            # a fixed shape and greedy decoding: each benchmark's tau and acceptance repeat exactly run to run
            "decode": {"max_new_tokens": 24, "sizing": "fixed"}, "compare_fixed": False, "num_actors": 2, "cpus_per_actor": 0.5, "threads_per_actor": 1,
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


def running(cl: LocalCluster, app: str = "eagleray", deployment: str = "") -> int:
    """Replicas of the Serve app's deployments whose name holds `deployment` (the vllm backend's are
    `LLMServer:<model>` and `OpenAiIngress`) in state RUNNING (Serve's REST API on the dashboard); 0 while
    it answers not."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"{cl.dashboard}/api/serve/applications/", timeout=10) as r:
            apps = json.loads(r.read())["applications"]
    except (OSError, ValueError):
        return 0
    deps = apps.get(app, {}).get("deployments", {})
    return sum(1 for name, d in deps.items() if deployment in name
               for rep in d.get("replicas", []) if rep.get("state") == "RUNNING")


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


def throughput(cl: LocalCluster, out: Path, target: str, corpus: Path, records: int) -> tuple[dict, dict]:
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
