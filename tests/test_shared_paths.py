"""A cluster whose nodes share no disk: a local path that work on other nodes reads or writes is refused in
one line naming its key, by every entry, once it has joined Ray and before any work (pipeline/storage.py
check_shared); a folder at a URI is copied once per node and content (storage.node_copy)."""
import os

import pytest

import pipeline.cluster as cluster
from infer.cluster.local import S3Server
from pipeline import storage


@pytest.fixture(scope="module")
def s3():
    with S3Server(buckets=("eagleray",)) as server:
        old = {k: os.environ.get(k) for k in server.env}
        os.environ.update(server.env)
        yield server
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def test_a_local_path_is_refused_only_on_several_nodes_and_outside_declared_mounts(tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLERAY_SHARED_PATHS", raising=False)
    storage.check_shared("target", tmp_path / "t", 1)  # one node: every path is on it
    storage.check_shared("target", "s3://bucket/t", 3)
    storage.check_shared("head", None, 3)
    with pytest.raises(storage.StorageError) as e:
        storage.check_shared("ingest.sources.0.path", f"{tmp_path}/chats/*.jsonl", 3)
    msg = str(e.value)
    assert msg.startswith(f"ingest.sources.0.path: {tmp_path}/chats/*.jsonl is a local path") and "3 nodes" in msg
    assert "\n" not in msg and "EAGLERAY_SHARED_PATHS" in msg
    monkeypatch.setenv("EAGLERAY_SHARED_PATHS", f"/nonexistent{os.pathsep}{tmp_path}")
    storage.check_shared("ingest.sources.0.path", f"{tmp_path}/chats/*.jsonl", 3)  # under an NFS mount, say
    with pytest.raises(storage.StorageError, match="^out_dir: "):
        storage.check_shared("out_dir", str(tmp_path) + "-other", 3)  # a sibling is not under the mount
    monkeypatch.setattr(cluster, "node_count", lambda: 3)
    with pytest.raises(storage.StorageError, match=r"^ingest\.sources\.1: "):
        cluster.check_shared({"run_dir": "s3://b/run", "ingest.sources": ["s3://b/a.jsonl", "/data/b.jsonl"]})


@pytest.fixture()
def three_nodes(monkeypatch):
    """Every entry's `ensure_ray` joined to a pretend cluster of three nodes (nothing started)."""
    import infer.eval
    import infer.serve
    import pipeline.__main__

    joined = []
    fake = lambda address=None: joined.append(address) or "joined a 3-node cluster"  # noqa: E731
    for mod in (cluster, pipeline.__main__, infer.eval, infer.serve):
        monkeypatch.setattr(mod, "ensure_ray", fake)
    monkeypatch.setattr(cluster, "node_count", lambda: 3)
    monkeypatch.delenv("EAGLERAY_SHARED_PATHS", raising=False)
    return joined


def refused(call) -> str:
    with pytest.raises(storage.StorageError) as e:
        call()
    assert "\n" not in str(e.value) and "is a local path, and this Ray cluster has 3 nodes" in str(e.value)
    return str(e.value).split(":")[0]


def test_every_entry_refuses_its_local_paths_on_three_nodes_before_any_work(tmp_path, tiny_target, three_nodes):
    from infer.eval import EvalConfig, evaluate
    from infer.serve import start
    from infer.serve_config import ServeConfig
    from pipeline.__main__ import run
    from pipeline.config import PipelineConfig
    from trainer.config import TrainConfig
    from trainer.driver import run_training

    head, shards = tmp_path / "head", tmp_path / "shards"
    head.mkdir()
    shards.mkdir()
    (shards / "manifest.json").write_text("{}")
    (tmp_path / "c.jsonl").write_text("")
    (tmp_path / "p.jsonl").write_text("")
    pipe = PipelineConfig.model_validate({"run_dir": str(tmp_path / "run"), "target": str(tiny_target),
                                          "ingest": {"sources": [{"path": str(tmp_path / "c.jsonl")}]}})
    assert refused(lambda: run(pipe)) == "run_dir"
    assert not (tmp_path / "run").exists()
    train = TrainConfig.model_validate({"target": str(tiny_target), "out_dir": "s3://eagleray/out",
                                        "data": {"shards": str(shards)}})
    assert refused(lambda: run_training(train.model_copy(update={"out_dir": tmp_path / "out"}))) == "out_dir"
    ev = EvalConfig.model_validate({"target": str(tiny_target), "head": str(head), "out_dir": str(tmp_path / "ev"),
                                    "benchmarks": [{"name": "p", "kind": "jsonl", "path": str(tmp_path / "p.jsonl")}]})
    assert refused(lambda: evaluate(ev)) == "target"
    serve = ServeConfig.model_validate({"target": str(tiny_target), "head": str(head)})
    assert refused(lambda: start(serve)) == "target"
    assert len(three_nodes) == 4  # each joined Ray first: a local Ray is one node, and every path is on it


def test_a_folder_at_a_uri_is_copied_once_per_node_and_again_when_rewritten(tmp_path, s3, monkeypatch):
    monkeypatch.setenv("EAGLERAY_CACHE", str(tmp_path / "cache"))
    src = tmp_path / "head"
    (src / "sub").mkdir(parents=True)
    (src / "config.json").write_text('{"a": 1}')
    (src / "sub" / "w.bin").write_bytes(b"\x00" * 1000)
    assert storage.upload(src, "s3://eagleray/heads/h1") == 2
    assert storage.node_copy(src) == src.resolve()  # a local folder as it is
    first = storage.node_copy("s3://eagleray/heads/h1")
    assert first.parent == tmp_path / "cache" / "nodes" and (first / ".complete").is_file()
    assert (first / "config.json").read_text() == '{"a": 1}' and (first / "sub" / "w.bin").stat().st_size == 1000
    (first / "config.json").write_text('{"a": "edited here"}')  # a second call reuses the copy as it finds it
    assert storage.node_copy("s3://eagleray/heads/h1") == first
    assert (first / "config.json").read_text() == '{"a": "edited here"}'
    storage.write_text("s3://eagleray/heads/h1/config.json", '{"a": 22}')  # rewritten at the same URI
    second = storage.node_copy("s3://eagleray/heads/h1")
    assert second != first and (second / "config.json").read_text() == '{"a": 22}'
    (second / ".complete").unlink()  # a copy cut short is made again
    assert storage.node_copy("s3://eagleray/heads/h1") == second and (second / ".complete").is_file()
    with pytest.raises(storage.StorageError, match="no files there"):
        storage.node_copy("s3://eagleray/heads/none")
