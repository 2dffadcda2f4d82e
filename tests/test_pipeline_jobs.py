"""The pipeline as users run it: SIGKILLed mid-capture and rerun; submitted with `ray job submit`."""
import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest

from conftest import REPO, pipeline_tree, write_yaml

pytestmark = pytest.mark.slow


def digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("shard-*.parquet"))}


def test_sigkill_mid_capture_then_rerun(tmp_path, ray_cluster, tiny_target, demo_corpus):
    tree = pipeline_tree(tmp_path / "run", tiny_target, demo_corpus / "train.jsonl", records=160,
                         capture={"rows_per_shard": 4, "batch_tokens": 128})
    cfg = write_yaml(tmp_path / "c.yaml", tree)
    # The job gets its own local Ray in its own process group, so SIGKILL takes down the driver and
    # its workers at once, as when a node dies; joining the session cluster would let actors finish.
    env = {k: v for k, v in ray_cluster["env"].items() if k != "RAY_ADDRESS"}
    cap = tmp_path / "run" / "capture"
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", str(cfg)], cwd=REPO, env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 600  # ingest and tokenize first: minutes on a loaded 2-core box
    while time.time() < deadline and len(list(cap.glob("shard-*.parquet"))) < 3:
        assert proc.poll() is None, "pipeline ended before it could be killed"
        time.sleep(0.05)
    assert len(list(cap.glob("shard-*.parquet"))) >= 3, "capture wrote no 3 shards in 10 minutes"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(2)  # let the cluster reap the dead job's actors
    complete = digests(cap)
    assert 3 <= len(complete) < 40, "kill should land mid-capture"
    assert not (cap / "manifest.json").exists()

    time.sleep(3)
    assert digests(cap) == complete, "nothing may write after the kill"
    rerun = subprocess.run([sys.executable, "-m", "pipeline", str(cfg)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    after = digests(cap)
    assert {k: after[k] for k in complete} == complete  # finished shards untouched
    tokens = pq.read_table(tmp_path / "run/tokenize/tokens.parquet")
    rows = pq.read_table(sorted(cap.glob("shard-*.parquet")), columns=["id"])["id"].to_pylist()
    assert len(rows) == tokens.num_rows == 160
    assert len(set(rows)) == len(rows) and sorted(rows) == sorted(tokens["id"].to_pylist())
    assert not list(cap.glob(".*tmp"))
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["capture"]["skipped_complete"] == len(complete)


def test_killed_capture_actor_is_redone_in_one_run(tmp_path, ray_cluster, tiny_target, demo_corpus):
    """SIGKILL the capture actor mid-run: the same run redoes the unwritten shards (pipeline.cluster.retry_lost)
    and ends with every row once; no restartable actor, so Ray's core prints no error line of its own."""
    from conftest import actor_processes

    tree = pipeline_tree(tmp_path / "run", tiny_target, demo_corpus / "train.jsonl", records=160,
                         capture={"rows_per_shard": 4, "batch_tokens": 128})
    cfg = write_yaml(tmp_path / "c.yaml", tree)
    cap = tmp_path / "run" / "capture"
    # ray_cluster's env names no address: the stage starts a Ray of its own, under its process
    proc = subprocess.Popen([sys.executable, "-m", "pipeline", str(cfg)], cwd=REPO, env=ray_cluster["env"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed, deadline = [], time.time() + 600
    while not killed and time.time() < deadline and proc.poll() is None:
        if len(list(cap.glob("shard-*.parquet"))) >= 3:
            for p in actor_processes("CaptureWorker", root=proc.pid):
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.append(len(list(cap.glob("shard-*.parquet"))))
                break
        time.sleep(0.05)
    out, _ = proc.communicate(timeout=600)
    assert killed and killed[0] < 40, (killed, out[-2000:])  # the kill landed mid-capture
    assert proc.returncode == 0, out[-3000:]
    assert "[capture] a worker was lost" in out and "attempt 2 of 3" in out, out[-2000:]
    assert "core_worker.cc" not in out, out[-2000:]
    tokens = pq.read_table(tmp_path / "run/tokenize/tokens.parquet")
    rows = pq.read_table(sorted(cap.glob("shard-*.parquet")), columns=["id"])["id"].to_pylist()
    assert len(rows) == tokens.num_rows == 160 and len(set(rows)) == 160
    assert json.loads((cap / "manifest.json").read_text())["rows"] == 160


def test_a_retry_waits_until_ray_holds_the_lost_actor_dead(ray_cluster):
    """`retry_lost` starts its next attempt only once the GCS holds the lost actor dead: before that, a node
    whose raylet died unseen still takes new actors (tests/test_cluster.py lost an attempt so)."""
    import ray
    from ray import exceptions as rx

    from pipeline.cluster import await_verdict, lost_worker

    @ray.remote(num_cpus=0)
    class Idle:
        def ping(self):
            return 1

    actor = Idle.remote()
    assert ray.get(actor.ping.remote()) == 1
    unseen = rx.ActorUnavailableError("connection reset", actor._actor_id.binary())  # as a dead raylet's RPC says
    assert 2.0 <= await_verdict(unseen, timeout_s=2.0) < 10.0  # alive in the GCS: the retry waits its bound out
    ray.kill(actor)
    with pytest.raises(rx.RayActorError) as died:
        ray.get(actor.ping.remote())
    try:
        raise RuntimeError("Dataset execution aborted") from died.value  # as Ray Data wraps it
    except RuntimeError as wrapped:
        assert lost_worker(wrapped) is died.value
    assert lost_worker(ValueError("our code's bug")) is None
    assert await_verdict(died.value, timeout_s=30.0) < 3.0  # already dead: no wait


def submit(ray_cluster, module: str, cfg) -> subprocess.CompletedProcess:
    """`ray job submit --working-dir <repo> -- python -m <module> <cfg>` against the session head node."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    for attempt in range(6):
        res = subprocess.run([ray_bin, "job", "submit", "--address", ray_cluster["dashboard"], "--working-dir",
                              str(REPO), "--", "python", "-m", module, str(cfg)], cwd=REPO, env=ray_cluster["env"],
                             capture_output=True, text=True, timeout=600)
        # The head's job agent registers late on a loaded machine; Ray's own answer is "try again later".
        if res.returncode == 0 or "No available agent to submit job" not in res.stderr:
            break
        time.sleep(10)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    return res


def test_ray_job_submit(tmp_path, ray_cluster, tiny_target, demo_corpus):
    tree = pipeline_tree(tmp_path / "run", tiny_target, demo_corpus / "train.jsonl", records=24)
    res = submit(ray_cluster, "pipeline", write_yaml(tmp_path / "c.yaml", tree))
    assert "succeeded" in res.stdout
    man = json.loads((tmp_path / "run/capture/manifest.json").read_text())
    assert man["rows"] == 24
    assert (tmp_path / "run/capture/draft_vocab.safetensors").is_file()


def test_trainer_under_ray_job_submit(tmp_path, ray_cluster, pipeline_run, tiny_target):
    tree = {"target": str(tiny_target), "out_dir": str(tmp_path / "head"),
            "data": {"shards": str(pipeline_run / "capture"), "max_rows_per_batch": 8, "val_rows": 8},
            "model": {"ttt_length": 2}, "max_steps": 3, "log_every": 1,
            "scaling": {"num_workers": 2, "cpus_per_worker": 0.5, "threads_per_worker": 1}}
    submit(ray_cluster, "trainer", write_yaml(tmp_path / "t.yaml", tree))
    report = json.loads((tmp_path / "head/report.json").read_text())
    assert report["steps"] == 3 and (tmp_path / "head/head_speculators/model.safetensors").is_file()
