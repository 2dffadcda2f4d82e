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
    """SIGKILL the capture actor mid-run: Ray Data restarts it and retries its shard, so the same run ends
    with every row once; Ray's false-alarm line for restartable actors is filtered out of its output
    (pipeline.cluster.drop_false_alarms)."""
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
    assert "constructor arguments in the object store" not in out, out[-2000:]
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["capture"]["captured"] == 40 and summary["capture"]["shards"] == 40, summary["capture"]
    tokens = pq.read_table(tmp_path / "run/tokenize/tokens.parquet")
    rows = pq.read_table(sorted(cap.glob("shard-*.parquet")), columns=["id"])["id"].to_pylist()
    assert len(rows) == tokens.num_rows == 160 and len(set(rows)) == 160
    assert json.loads((cap / "manifest.json").read_text())["rows"] == 160


def test_stderr_filter_drops_only_the_false_alarm(tmp_path):
    """What a driver writes to fd 2 passes through, progress bars' partial lines at once; only Ray's
    false-alarm line is dropped (pipeline.cluster.drop_false_alarms)."""
    code = ("import os, sys, time\n"
            "from pipeline.cluster import drop_false_alarms\n"
            "drop_false_alarms()\n"
            "os.write(2, b'kept 1\\n[2026 E 1 1] core_worker.cc:2465: Actor has constructor arguments in the object "
            "store and max_restarts > 0. See\\n')\n"
            "os.write(2, b'\\rbar 50%')\n"
            "time.sleep(0.5)\n"
            "print('partial shown:', open(sys.argv[1]).read().count('bar 50%'), flush=True)\n"
            "os.write(2, b'\\n[2026 E 1 1] other.cc:1: a real error\\n')\n")
    log = tmp_path / "err.txt"
    with open(log, "wb") as err:
        res = subprocess.run([sys.executable, "-c", code, str(log)], cwd=REPO, stdout=subprocess.PIPE, stderr=err,
                             text=True, timeout=120)
    assert res.returncode == 0 and "partial shown: 1" in res.stdout, res
    assert log.read_bytes() == b"kept 1\n\rbar 50%\n[2026 E 1 1] other.cc:1: a real error\n"


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
