"""A real three-node Ray cluster on this machine (tools/local_cluster.py): the pipeline by `ray job submit`,
then again with a worker node's raylet killed (`kill -9`) mid-capture: the job succeeds and its manifest
lists the same rows, tokens and per-shard row digests as the undisturbed run (issue 51, fault a)."""
import json

import pytest

from cluster_check import capture_fault, pipeline_tree, run_job, shard_digests, write_yaml
from local_cluster import LocalCluster

pytestmark = pytest.mark.slow


def test_three_nodes_capture_survives_a_killed_node(tmp_path, tiny_target, demo_corpus):
    records, corpus = 48, demo_corpus / "train.jsonl"
    with LocalCluster(workers=2) as cl:  # its temp dirs under /tmp: Ray's socket paths must stay short
        nodes = cl.alive_nodes()
        assert len(nodes) == 3
        cfg = write_yaml(tmp_path / "p.yaml", pipeline_tree(tmp_path / "base", tiny_target, corpus, records, False))
        assert run_job(cl, "pipeline", ["python", "-m", "pipeline", str(cfg)], tmp_path)[0] == "SUCCEEDED", \
            (tmp_path / "pipeline.log").read_text()[-3000:]
        base = shard_digests(tmp_path / "base" / "capture")
        assert base["rows"] == records and len(base["rows_digests"]) == records // 4
        fault = capture_fault(cl, tmp_path, corpus, tiny_target, records, base, regenerate=False)
        log = (tmp_path / "pipeline_fault.log").read_text()[-3000:]
        assert fault["killed"] and fault["job"] == "SUCCEEDED", (fault, log)
        assert 3 <= fault["at_kill"] < records // 4, fault  # the node died mid-capture
        assert fault["rows_found"] == records and fault["duplicates"] == 0, fault
        assert fault["digests_equal"] and fault["tokens_equal"], fault
        # the manifest was written once, after every shard: it names each shard file exactly once
        man = json.loads((tmp_path / "pipeline_fault" / "capture" / "manifest.json").read_text())
        assert sorted(s["file"] for s in man["shards"]) == sorted(base["rows_digests"])
    assert cl.stop() == []  # everything it started is gone
