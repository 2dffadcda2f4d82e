"""`eagleray cluster check`: every stage by `ray job submit` on a three-node cluster, with a
worker node killed (`kill -9` of its raylet) once in the middle of each stage, and each job's status and
output checked against the undisturbed run's (docs/USAGE.md "On a cluster"). The jobs' configs and their
submission live in infer/cluster/jobs.py, the serving jobs and the flywheel round in infer/cluster/serving.py.

The worker nodes have disks of their own (`LocalCluster(private_disks=True)`, proved by
infer/cluster/isolation.py before the jobs start): what they share is Ray and S3 (moto's server, `S3Server`;
each node gets its endpoint and credentials in its environment, as a real cluster's nodes would). Work goes
to them through their custom resource (`eagleray_worker: 1`: one actor, train worker or replica per worker
node); the head runs the job drivers. Every stage's data lives on S3: the target, the corpus, run_dir and
shards, the trainer's out_dir with Ray Train's checkpoints, the heads, the eval report, the served traffic
and the flywheel's rounds. Only the configs are local files (on the head, where the drivers read them).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

from infer.cluster.isolation import prove_isolation
from infer.cluster.jobs import (BUCKET, ONPOLICY_RECORDS, eval_tree, latest_step, make_inputs, node_rss_mb,
                                onpolicy_round, pipeline_tree, read_json, run_job, shard_digests, throughput,
                                train_tree, write_yaml)
from infer.cluster.local import LocalCluster, S3Server
from infer.cluster.serving import flywheel, serve_fault, serve_vllm
from pipeline import storage

PIPELINE_STAGES = ("ingest", "regenerate", "tokenize", "capture", "vocab")
FAULT_STAGES = PIPELINE_STAGES + ("training", "eval", "serving")


def kill_when(cl: LocalCluster, node: str, ready, what: str, wait_s: float = 600, down_s: float = 4,
              progress=None, running=None) -> dict:
    """Wait for `ready()`, kill -9 `node`'s raylet, let the cluster see it dead, start the node again.
    Read at the kill: `progress()`, how far the stage was (`at_kill`); `running()`, whether it had not
    yet ended (`running_at_kill`: a kill that came too late proves nothing)."""
    deadline = time.time() + wait_s
    while not ready():
        if time.time() > deadline:
            return {"killed": False, "why": f"{what} never reached"}
        time.sleep(0.2)
    t = time.time()
    pid = cl.kill_node(node)
    at_kill = progress() if progress else None
    still = running() if running else None
    time.sleep(down_s)
    cl.restart_node(node)
    return {"killed": True, "raylet_pid": pid, "killed_at": round(t, 1), "node": node, "at_kill": at_kill,
            "running_at_kill": still}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stage_outputs(run_dir: str) -> dict:
    """Each pipeline stage's output at run_dir: its rows, their ids and a digest of what it wrote."""
    out = {}
    for stage in ("ingest", "regenerate"):
        loc = f"{run_dir}/{stage}/records.jsonl"
        if storage.is_file(loc):
            data = storage.read_bytes(loc)
            out[stage] = {"rows": data.count(b"\n"), "digest": _sha(data),
                          "ids": [json.loads(x)["id"] for x in data.splitlines() if x.strip()]}
    loc = f"{run_dir}/tokenize/tokens.parquet"
    if storage.is_file(loc):
        ids = storage.read_table(loc, ["id"])["id"].to_pylist()
        out["tokenize"] = {"rows": len(ids), "digest": _sha(storage.read_bytes(loc)), "ids": ids}
    if storage.is_file(f"{run_dir}/capture/manifest.json"):
        cap = shard_digests(f"{run_dir}/capture")
        out["capture"] = {"rows": cap["rows"], "ids": cap["ids"], "digest": _sha(json.dumps(
            [cap["rows_digests"], cap["bytes"], cap["tokens"]], sort_keys=True).encode())}
    loc = f"{run_dir}/capture/draft_vocab.safetensors"
    if storage.is_file(loc):
        # its content, not its bytes: safetensors writes the metadata in a hash map's order, which differs
        # between any two processes
        from safetensors.numpy import load

        data = storage.read_bytes(loc)
        tensors = load(data)
        meta = json.loads(data[8:8 + int.from_bytes(data[:8], "little")]).get("__metadata__", {})
        out["vocab"] = {"rows": len(tensors["d2t"]), "ids": [], "digest": _sha(json.dumps(
            [sorted(meta.items()), {k: v.tolist() for k, v in sorted(tensors.items())}]).encode())}
    return out


def compare(found: dict | None, base: dict) -> dict:
    """One stage's output against the undisturbed run's."""
    if not found:
        return {"rows_expected": base["rows"], "rows_found": 0, "duplicates": 0, "digests_equal": False}
    return {"rows_expected": base["rows"], "rows_found": found["rows"],
            "duplicates": len(found["ids"]) - len(set(found["ids"])),
            "digests_equal": found["digest"] == base["digest"]}


def stage_triggers(cl: LocalCluster, sid: str, run_dir: str) -> dict:
    """Per stage: (under way, how far, not yet ended), read from the job's log (each stage logs `[stage]`
    when it ends) and from what it has written at the URI: capture's shards (3 of 16: mid-way) and
    regeneration's finished chunks (1 of 4)."""
    from pipeline.regenerate import PARTS

    log = lambda: cl.job_logs(sid)  # noqa: E731
    shards = lambda: len(storage.list_names(f"{run_dir}/capture", "shard-*.parquet"))  # noqa: E731
    chunks = lambda: len(storage.list_names(f"{run_dir}/regenerate/{PARTS}", "part-*"))  # noqa: E731
    after = {"ingest": "pipeline: ", "tokenize": "[regenerate]", "vocab": "[capture]"}
    out = {stage: ((lambda m=mark: m in log()), None, (lambda s=stage: f"[{s}]" not in log()))
           for stage, mark in after.items()}
    out["regenerate"] = (lambda: "[ingest]" in log() and chunks() >= 1, chunks, lambda: "[regenerate]" not in log())
    out["capture"] = (lambda: shards() >= 3, shards, lambda: "[capture]" not in log())
    return out


def retried(log: str) -> dict:
    """Ray's own lines in a job's log for each task or actor call it retried after the kill, by name."""
    import re

    names = re.findall(r"Task (\S+?)(?:\.\w+)? failed\. There are \w+ retries remaining", log)
    return {n: names.count(n) for n in sorted(set(names))}


def pipeline_fault(cl: LocalCluster, out: Path, corpus, target: str, records: int, baseline: dict,
                   stages=PIPELINE_STAGES, regenerate: bool = True, name: str = "pipeline_fault") -> dict:
    """The pipeline again, worker1 killed once in each of `stages` (a stage's kill waits for it to be under
    way); every stage's output against `baseline` (`stage_outputs` of the undisturbed run)."""
    run_dir = f"{BUCKET}/{name}"
    cfg = write_yaml(out / f"{name}.yaml", pipeline_tree(run_dir, target, corpus, records, regenerate))
    kills = {}

    def during(c, sid):
        triggers = stage_triggers(c, sid, run_dir)
        for stage in stages:
            ready, progress, running = triggers[stage]
            kills[stage] = kill_when(c, "worker1", ready, stage, progress=progress, running=running)
    status, _ = run_job(cl, name, ["python", "-m", "pipeline", str(cfg)], out, during=during)
    found = stage_outputs(run_dir)
    return {stage: {"job": status, **kills.get(stage, {}), **compare(found.get(stage), baseline[stage])}
            for stage in stages if stage in baseline}


def train_fault(cl: LocalCluster, out: Path, target: str, shards: str) -> tuple[str, dict]:
    out_dir = f"{BUCKET}/train"
    cfg = write_yaml(out / "train.yaml", train_tree(out_dir, target, shards))
    status, kill = run_job(cl, "trainer", ["python", "-m", "trainer", str(cfg)], out,
                           during=lambda c, _: kill_when(c, "worker2", lambda: latest_step(out_dir) >= 20, "step 20",
                                                      progress=lambda: latest_step(out_dir)))
    resumes = [json.loads(x) for x in storage.read_text(f"{out_dir}/resumes.jsonl").splitlines()] \
        if storage.is_file(f"{out_dir}/resumes.jsonl") else []
    report, history = read_json(f"{out_dir}/report.json", {}), read_json(f"{out_dir}/history.json", [])
    steps = [h["step"] for h in history if "loss" in h]
    return status, {**(kill or {}), "resumed_from_step": resumes[-1]["step"] if resumes else None,
                    "final_step": report.get("steps"), "steps_logged_twice": len(steps) - len(set(steps)),
                    "exported": storage.is_file(f"{out_dir}/head_speculators/config.json")}


def eval_outputs(out_dir: str) -> dict:
    """What a greedy eval decides (its timings aside): per benchmark the turns, tokens, tau and acceptance."""
    rep = read_json(f"{out_dir}/report.json", {}).get("benchmarks", {})
    keep = ("prompts", "turns", "generated_tokens", "tau", "accept_by_depth", "match_rate")
    figures = {b: {k: v.get(k) for k in keep} for b, v in rep.items()}
    return {"rows": sum(v["turns"] or 0 for v in figures.values()), "ids": [],
            "digest": _sha(json.dumps(figures, sort_keys=True).encode())} if figures else {}


def eval_fault(cl: LocalCluster, out: Path, target: str, head: str) -> tuple[str, dict]:
    """The eval undisturbed, then again with worker1 killed once its actors decode."""
    base_dir, fault_dir = f"{BUCKET}/eval", f"{BUCKET}/eval_fault"
    base = run_job(cl, "eval", ["python", "-m", "infer.eval", str(write_yaml(out / "eval.yaml", eval_tree(
        base_dir, target, head)))], out)[0]
    cfg = write_yaml(out / "eval_fault.yaml", eval_tree(fault_dir, target, head))
    # `eval: <path line>` is printed once the first actor has loaded the target and head
    decoding = lambda c, sid: lambda: c.job_logs(sid).count("eval: ") >= 2  # noqa: E731
    running = lambda: not storage.is_file(f"{fault_dir}/report.json")  # noqa: E731
    status, kill = run_job(cl, "eval_fault", ["python", "-m", "infer.eval", str(cfg)], out,
                           during=lambda c, sid: kill_when(c, "worker1", decoding(c, sid), "eval", running=running))
    found, want = eval_outputs(fault_dir), eval_outputs(base_dir)
    res = {"job": status, **(kill or {}), **(compare(found, want) if want else {"digests_equal": False})}
    return base, res


def head_fault(cl: LocalCluster, out: Path, target: str, corpus, records: int) -> dict:
    """The head lost mid-capture (`kill -9` of every process of it: GCS, raylet, job driver): Ray has no GCS
    fault tolerance without an external Redis, so the job and the cluster are gone. Start the cluster again,
    submit the same job, and count what the rerun captured against what it found complete at the URI."""
    import signal

    from infer.cluster.local import processes

    run_dir = f"{BUCKET}/pipeline_head"
    cfg = write_yaml(out / "pipeline_head.yaml", pipeline_tree(run_dir, target, corpus, records, regenerate=False))
    shards = lambda: len(storage.list_names(f"{run_dir}/capture", "shard-*.parquet"))  # noqa: E731
    res = cl.submit(["python", "-m", "pipeline", str(cfg)], f"pipeline_head-{int(time.time())}", wait=False)
    deadline = time.time() + 600
    while res.returncode == 0 and shards() < 3 and time.time() < deadline:
        time.sleep(0.2)
    head = cl.nodes[0]
    for p in processes((head.temp_dir + "/", f"--address={cl.address}")):
        try:
            p.send_signal(signal.SIGKILL)
        except Exception:  # noqa: BLE001 - a process that just ended
            pass
    at_kill, t = shards(), time.time()
    time.sleep(2)
    cl.stop()
    cl.start()
    restart_s = round(time.time() - t, 1)
    status, _ = run_job(cl, "pipeline_head_rerun", ["python", "-m", "pipeline", str(cfg)], out)
    cap = read_json(f"{run_dir}/summary.json", {}).get("capture", {})
    return {"rerun_job": status, "shards_at_kill": at_kill, "shards": cap.get("shards"),
            "shards_redone": cap.get("captured"), "shards_kept": cap.get("skipped_complete"),
            "cluster_restart_s": restart_s}


def pipeline_faults(cl: LocalCluster, out: Path, corpus, target: str, records: int, stages, result: dict,
                    attempts: int = 3) -> None:
    """One pipeline job with a worker killed in each of the pipeline `stages` asked for, into `result`. A
    kill that landed after its stage had ended (the node's restart after one kill can outlast a short next
    stage) is tried again, in a pipeline job of its own, up to `attempts` jobs in all; `attempts` per stage
    says how many it took."""
    todo = [x for x in stages if x in PIPELINE_STAGES]
    base = stage_outputs(f"{BUCKET}/pipeline") if todo else {}
    for attempt in range(1, attempts + 1):
        if not todo:
            return
        name = "pipeline_fault" if attempt == 1 else f"pipeline_fault_{attempt}"
        found = pipeline_fault(cl, out, corpus, target, records, base, todo, name=name)
        result["faults"] |= {stage: {**f, "attempts": attempt} for stage, f in found.items()}
        result["retried_by_ray"][name] = retried((out / f"{name}.log").read_text())
        todo = [x for x in todo if found.get(x, {}).get("running_at_kill") is False]


def downstream_faults(cl: LocalCluster, out: Path, target: str, stages, result: dict) -> None:
    """Training (killed or not) on the undisturbed run's shards, then eval and serving from its head."""
    shards, head = f"{BUCKET}/pipeline/capture", f"{BUCKET}/train/head_speculators"
    if "training" in stages:
        result["jobs"]["trainer"], train = train_fault(cl, out, target, shards)
        result["faults"]["training"] = {"job": result["jobs"]["trainer"], **train}
    else:
        cfg = write_yaml(out / "train.yaml", train_tree(f"{BUCKET}/train", target, shards))
        result["jobs"]["trainer"] = run_job(cl, "trainer", ["python", "-m", "trainer", str(cfg)], out)[0]
    if result["jobs"]["trainer"] != "SUCCEEDED":
        return
    if "eval" in stages:
        result["jobs"]["eval"], result["faults"]["eval"] = eval_fault(cl, out, target, head)
        result["retried_by_ray"]["eval_fault"] = retried((out / "eval_fault.log").read_text())
    if "serving" in stages:
        result["jobs"]["serve"], serve = serve_fault(cl, out, target, head)
        result["faults"]["serving"] = {"job": result["jobs"]["serve"], **serve}
        result["serve_stopped"] = serve["serve_stopped"]


def served_jobs(cl: LocalCluster, out: Path, target: str, corpus: str, args, result: dict) -> None:
    """The vllm backend (a worker killed under it), one flywheel round against the eagleray backend, then
    one on-policy training round (Serve stopped: its replicas hold the worker nodes), all from the trained head."""
    head = f"{BUCKET}/train/head_speculators"
    if getattr(args, "vllm", True):
        result["jobs"]["serve_vllm"], result["serve_vllm"] = serve_vllm(cl, out, target, head)
    if getattr(args, "flywheel", True):
        result["jobs"]["flywheel"], result["flywheel"] = flywheel(cl, out, target, head, corpus)
    if getattr(args, "onpolicy", True):
        result["jobs"]["onpolicy"], result["onpolicy"] = onpolicy_round(cl, out, target, corpus)


def run_check(args) -> dict:
    """Every stage by `ray job submit`, undisturbed, then with a worker node killed in each of
    `args.fault_stages`; `result["ok"]` only when every job ended SUCCEEDED with its output equal to the
    undisturbed run's (and no request failed after the served load recovered)."""
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    corpus, target = make_inputs(out / "inputs")
    records = 64
    stages = [x for x in args.fault_stages.split(",") if x]
    result: dict = {"jobs": {}, "faults": {}, "retried_by_ray": {}, "storage": BUCKET}
    private = result["private_disks_asked"] = getattr(args, "private_disks", True)
    # No CPU on the head: every task and actor runs on the worker nodes, so a killed worker loses work
    with S3Server() as s3, LocalCluster(Path(args.dir), workers=args.workers, head_cpus=0, env=s3.env,
                                        private_disks=private, private=[str(out)]) as cl:
        os.environ.update(s3.env)  # this process reads the results from the same store
        result["isolation"] = prove_isolation(cl) if private else {"private_disks": False}
        storage.write_bytes(f"{BUCKET}/corpus/train.jsonl", corpus.read_bytes())
        corpus = f"{BUCKET}/corpus/train.jsonl"
        result["target_files"] = storage.upload(target, f"{BUCKET}/target")
        target = f"{BUCKET}/target"
        result["nodes"] = len(cl.alive_nodes())
        result["ray_rss_mb_at_start"] = node_rss_mb(cl)
        cfg = write_yaml(out / "pipeline.yaml", pipeline_tree(f"{BUCKET}/pipeline", target, corpus, records))
        result["jobs"]["pipeline"] = run_job(cl, "pipeline", ["python", "-m", "pipeline", str(cfg)], out)[0]
        if result["jobs"]["pipeline"] == "SUCCEEDED":
            pipeline_faults(cl, out, corpus, target, records, stages, result)
            downstream_faults(cl, out, target, stages, result)
            if result["jobs"]["trainer"] == "SUCCEEDED":
                served_jobs(cl, out, target, corpus, args, result)
        if args.head_kill and result["jobs"]["pipeline"] == "SUCCEEDED":
            result["head_fault"] = head_fault(cl, out, target, corpus, records)
        result["check_wall_s"] = round(time.time() - t0, 1)  # the check itself, before --throughput
        if args.throughput and result["jobs"]["pipeline"] == "SUCCEEDED":
            result["capture_2_vs_1"], result["train_2_vs_1"] = throughput(cl, out, target, corpus, records)
    result["ok"] = verdict(result, stages)
    result["wall_s"] = round(time.time() - t0, 1)
    (out / "result.json").write_text(json.dumps(result, indent=2))
    return result


def served_ok(result: dict) -> bool:
    """The vllm backend answered every request, the same before and after its replica's node was lost, and
    drafted with the head; the flywheel promoted a head that both replicas, on two nodes, then served; the
    on-policy round decoded every prompt on actors on both worker nodes, captured them, exported its head."""
    v, fw, op = result.get("serve_vllm"), result.get("flywheel"), result.get("onpolicy")
    if op is not None and not (op.get("records") == ONPOLICY_RECORDS and op.get("actor_nodes") == 2 and op.get("rows")
                               and op.get("exported")):
        return False
    if v is not None and (v.get("failed") or not v.get("drafts") or not v.get("same_answers_after_restart")
                          or not v.get("replicas_back")):
        return False
    return fw is None or bool(fw.get("promoted") and fw.get("swapped") and fw.get("replica_nodes") == 2
                              and fw.get("replicas_on_new_head") == 2)


def verdict(result: dict, stages: list[str]) -> bool:
    """Every job SUCCEEDED on the disks asked for, every asked-for fault landed while its stage ran and
    its stage's output equals the undisturbed run's, the served jobs did what they must."""
    jobs_ok = all(v == "SUCCEEDED" for v in result["jobs"].values())
    faults = result["faults"]
    if set(stages) - set(faults):
        return False
    if result.get("private_disks_asked") and not result.get("isolation", {}).get("private_disks"):
        return False
    for stage, f in faults.items():
        if f.get("job") != "SUCCEEDED" or not f.get("killed") or f.get("running_at_kill") is False:
            return False
        if stage == "serving":
            if f.get("failed_after") or not f.get("requests_after"):
                return False
        elif stage == "training":
            if f.get("steps_logged_twice") or not f.get("exported") or f.get("resumed_from_step") is None:
                return False
        elif not (f.get("digests_equal") and f.get("duplicates") == 0
                  and f.get("rows_found") == f.get("rows_expected")):
            return False
    return jobs_ok and served_ok(result)
