"""A real three-node Ray cluster on this machine (infer/cluster/local.py) sharing a real S3 server (moto's,
`S3Server`), its worker nodes with disks of their own (`private_disks`, proved first): the pipeline by
`ray job submit` with its target, corpus, run_dir and shards on S3, then again with a
worker node's raylet killed (`kill -9`) mid-capture and again when the vocabulary step starts: the job
SUCCEEDED, its manifest lists the same rows, tokens and per-shard row digests as the undisturbed run, each
shard object once, and the draft vocabulary has the same bytes."""
import json

import pytest

from infer.cluster.check import pipeline_fault, stage_outputs
from infer.cluster.isolation import prove_isolation
from infer.cluster.jobs import BUCKET, pipeline_tree, run_job, shard_digests, write_yaml
from infer.cluster.local import LocalCluster, S3Server
from pipeline import storage

pytestmark = pytest.mark.slow


def test_three_nodes_capture_to_s3_survives_a_killed_node(tmp_path, tiny_target, demo_corpus, monkeypatch,
                                                          own_driver):
    records = 48
    # temp dirs under /tmp (short socket paths); no CPU on the head, so the kills land on work
    with S3Server() as s3, LocalCluster(workers=2, head_cpus=0, env=s3.env, private_disks=True,
                                        private=[str(tmp_path)]) as cl:
        for k, v in s3.env.items():
            monkeypatch.setenv(k, v)  # this process checks the results in the same store
        isolation = prove_isolation(cl)
        assert isolation["private_disks"], isolation  # no worker sees this machine's files
        target = f"{BUCKET}/target"
        assert storage.upload(tiny_target, target) == len([f for f in tiny_target.rglob("*") if f.is_file()])
        corpus = f"{BUCKET}/corpus/train.jsonl"
        storage.write_bytes(corpus, (demo_corpus / "train.jsonl").read_bytes())
        nodes = cl.alive_nodes()
        assert len(nodes) == 3
        cfg = write_yaml(tmp_path / "p.yaml", pipeline_tree(f"{BUCKET}/base", target, corpus, records, False))
        assert run_job(cl, "pipeline", ["python", "-m", "pipeline", str(cfg)], tmp_path)[0] == "SUCCEEDED", \
            job_story(tmp_path / "pipeline.log")
        base = shard_digests(f"{BUCKET}/base/capture")
        assert base["rows"] == records and len(base["rows_digests"]) == base["files"] == records // 4
        faults = pipeline_fault(cl, tmp_path, corpus, target, records, stage_outputs(f"{BUCKET}/base"),
                                ("capture", "vocab"), regenerate=False)
        log = job_story(tmp_path / "pipeline_fault.log")
        cap, vocab = faults["capture"], faults["vocab"]
        assert cap["killed"] and vocab["killed"] and cap["job"] == "SUCCEEDED", (faults, log)
        assert 3 <= cap["at_kill"] < records // 4, faults  # the node died mid-capture
        assert cap["rows_found"] == records and cap["duplicates"] == 0 and cap["digests_equal"], faults
        assert vocab["rows_found"] == vocab["rows_expected"] == 256 and vocab["digests_equal"], faults
        found = shard_digests(f"{BUCKET}/pipeline_fault/capture")
        assert found["files"] == records // 4 and found["bytes"] == base["bytes"], found["files"]
        # the manifest was written once, after every shard: it names each shard object exactly once
        man = json.loads(storage.read_text(f"{BUCKET}/pipeline_fault/capture/manifest.json"))
        assert sorted(s["file"] for s in man["shards"]) == sorted(base["rows_digests"])
    assert cl.stop() == []  # everything it started is gone


def job_story(log) -> str:
    """The job log's lines that tell what happened: a dead raylet's state dump fills its tail otherwise."""
    lines = [x for x in log.read_text().splitlines() if "[state-dump]" not in x and x.strip()]
    return "\n".join(x[:400] for x in lines)[-6000:]
