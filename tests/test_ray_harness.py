"""The session Ray instance is local (127.0.0.1, 2 CPUs) and Ray Data reads what the tools write."""
import json


def test_ray_is_local_with_two_cpus(ray_cluster):
    import ray

    assert ray.cluster_resources()["CPU"] == 2
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}


def test_ray_data_reads_demo_corpus(ray_cluster, demo_corpus):
    import ray

    lines = (demo_corpus / "train.jsonl").read_text().splitlines()
    ds = ray.data.read_json(str(demo_corpus / "train.jsonl"))
    assert ds.count() == len(lines)
    ids = sorted(r["id"] for r in ds.select_columns(["id"]).take_all())
    assert ids == sorted(json.loads(x)["id"] for x in lines)


def test_shared_data_fixture(shared_data):
    assert sum(1 for _ in (shared_data / "mt_bench" / "question.jsonl").open()) == 80
