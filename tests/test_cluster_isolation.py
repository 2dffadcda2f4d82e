"""A local cluster whose worker nodes have disks of their own (`LocalCluster(private_disks=True)`): no file
one node writes is seen by another, the code is there read-only, and a worker node lost and started again
comes back as a replacement machine would, its disks empty."""
import pytest

from infer.cluster.isolation import connected, existing, prove_isolation, run_on, write_files
from infer.cluster.local import LocalCluster

pytestmark = pytest.mark.slow


def test_worker_nodes_share_no_disk_and_a_restarted_node_comes_back_empty(own_driver):
    with LocalCluster(workers=2, private_disks=True) as cl:
        proof = prove_isolation(cl)
        assert proof["private_disks"] and proof["code_read_only"], proof
        assert proof["worker_files_seen_on_head"] == proof["worker_files_seen_on_other_worker"] == 0, proof
        assert proof["head_files_seen_on_workers"] == 0, proof
        with connected(cl):
            before = run_on("worker1", write_files, ["/tmp", str(cl.root)], "before-restart")
            assert run_on("worker1", existing, before) == before
            cl.kill_node("worker1")
            cl.restart_node("worker1")
            cl.wait_alive(3, 60)
            assert run_on("worker1", existing, before) == []  # a new namespace, empty disks
            assert existing(before) == []  # and never on this machine's
    assert cl.stop() == []  # everything it started is gone
