"""Storage by URI (pipeline/storage.py) against a real S3-compatible server: moto's, started by
infer/cluster/local.py `S3Server` as its own process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import REPO, pipeline_tree, write_yaml

from infer.cluster.local import S3Server
from pipeline import storage


@pytest.fixture(scope="module")
def s3():
    with S3Server(buckets=("eagleray", "other")) as server:
        yield server


@pytest.mark.parametrize("where", ["local", "s3"])
def test_files_read_write_list_glob_and_mirror(where, tmp_path, s3, monkeypatch):
    monkeypatch.setenv("EAGLERAY_CACHE", str(tmp_path / "cache"))
    base = s3.uri(f"eagleray/ops/{tmp_path.name}") if where == "s3" else tmp_path / "base"
    payload = os.urandom(70_000)
    assert storage.write_bytes(storage.join(base, "a", "x.bin"), payload) == len(payload)
    storage.write_text(storage.join(base, "a", "y.json"), '{"k": 1}')
    storage.write_text(storage.join(base, "b", "z.json"), "[]")
    assert storage.read_bytes(storage.join(base, "a", "x.bin")) == payload
    assert storage.size(storage.join(base, "a", "x.bin")) == 70_000
    assert storage.list_names(storage.join(base, "a")) == ["x.bin", "y.json"]
    assert storage.list_names(storage.join(base, "a"), "*.json") == ["y.json"]
    assert [storage.name(p) for p in storage.expand(storage.join(base, "*", "*.json"))] == ["y.json", "z.json"]
    assert storage.expand(storage.join(base, "nothing-*.json")) == []
    storage.delete(storage.join(base, "a", "y.json"))
    storage.delete(storage.join(base, "a", "y.json"))  # gone already: no error
    assert not storage.exists(storage.join(base, "a", "y.json"))
    # A mirror pulls a folder down, and what is written there goes back up.
    m = storage.Mirror(storage.join(base, "a"))
    assert (m.pull() / "x.bin").read_bytes() == payload
    (m.local / "new.txt").write_text("pushed")
    m.push("new.txt")
    assert storage.read_text(storage.join(base, "a", "new.txt")) == "pushed"
    assert m.remote == (where == "s3")
    if m.remote:  # a local copy of a file the URI does not have (an earlier run's) is dropped at pull
        (m.local / "stale.jsonl").write_text('{"step": 6}\n')
        assert not m.pull("stale.jsonl").exists()


def test_location_types_and_redaction(s3):
    assert storage.location("s3://b/p/") == "s3://b/p"
    assert str(storage.location("file:///tmp/x")) == "/tmp/x"
    uri = "s3://b/run?endpoint_override=h:1&scheme=http&secret_key=hunter2"
    assert storage.join(uri, "capture", "manifest.json").startswith("s3://b/run/capture/manifest.json?")
    assert "hunter2" not in storage.redact(uri) and "secret_key=***" in storage.redact(uri)
    with pytest.raises(storage.StorageError, match="unknown query key"):
        storage.filesystem("s3://b/p?endpoint=h:1")


def test_a_store_named_later_in_the_process_is_the_one_used(s3, monkeypatch):
    """The file system for a URI follows the endpoint and keys in the environment: a second store (another
    endpoint) named later in one process is read and written, not the first one's cached connection."""
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    storage.write_text("s3://eagleray/which.txt", "first")
    with S3Server() as other:
        for k, v in other.env.items():
            monkeypatch.setenv(k, v)
        assert storage.listing("s3://eagleray/") == []  # the new store is empty
        storage.write_text("s3://eagleray/which.txt", "second")
        assert storage.read_text("s3://eagleray/which.txt") == "second"
    for k, v in s3.env.items():
        monkeypatch.setenv(k, v)
    assert storage.read_text("s3://eagleray/which.txt") == "first"


def run_cli(args, env_extra=None, timeout=120):
    env = dict(os.environ, **(env_extra or {}))
    t0 = time.time()
    res = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    return res, time.time() - t0


def test_unreachable_missing_or_refused_storage_stops_before_any_work(tmp_path, s3, tiny_target, demo_corpus):
    """Each bad URI: exit 1 within seconds, one stderr line naming the key and the URI, nothing written."""
    cache = tmp_path / "cache"
    cfg = write_yaml(tmp_path / "p.yaml", pipeline_tree(tmp_path / "run", tiny_target, demo_corpus / "train.jsonl"))
    with S3Server(auth=True) as locked:
        cases = {
            "unreachable": ("run_dir", "s3://eagleray/r?endpoint_override=127.0.0.1:1&scheme=http", "NETWORK_CONNECTION"),
            "no bucket": ("run_dir", s3.uri("no-such-bucket/r"), "bucket 'no-such-bucket' not found"),
            "refused": ("run_dir", locked.uri("eagleray/r"), "ACCESS_DENIED"),
            "source": ("ingest.sources.0.path", s3.uri("eagleray/corpus/missing-*.jsonl"), "no file matches"),
        }
        for name, (key, uri, why) in cases.items():
            res, took = run_cli(["-m", "pipeline", str(cfg), f"{key}={uri}"], {"EAGLERAY_CACHE": str(cache)})
            lines = res.stderr.strip().splitlines()
            assert res.returncode == 1, (name, res.stderr[-2000:])
            assert len(lines) == 1 and lines[0].startswith(f"pipeline error: {key}: {uri.split('?')[0]}"), (name, lines)
            assert why in lines[0], (name, lines)
            assert took < 60, (name, took)
        res, _ = run_cli(["-m", "trainer", str(write_yaml(tmp_path / "t.yaml", {
            "target": str(tiny_target), "out_dir": locked.uri("eagleray/t"), "data": {"shards": str(tmp_path)}}))])
        assert res.returncode == 1 and res.stderr.strip().splitlines()[-1].startswith("trainer error: out_dir: s3://eagleray/t")
    assert not cache.exists() and not (tmp_path / "run").exists()  # no stage started, no mirror made
    assert storage.list_names(s3.uri("eagleray/r")) == []


def test_pipeline_on_s3_writes_what_a_local_run_writes(tmp_path, ray_cluster, s3, pipeline_run, tiny_target,
                                                     demo_corpus, monkeypatch):
    """The same config with run_dir on S3: the same manifest (rows, tokens, per-shard row digests and
    bytes), every stage's folder at the URI, the local and remote records byte-identical."""
    from pipeline.__main__ import run
    from pipeline.config import PipelineConfig
    from pipeline.shards import read_manifest
    from pipeline.yaml_config import load_config

    monkeypatch.setenv("EAGLERAY_CACHE", str(tmp_path / "cache"))
    uri = s3.uri("eagleray/pipeline")
    run(load_config(PipelineConfig, write_yaml(tmp_path / "p.yaml",
                                               pipeline_tree(uri, tiny_target, demo_corpus / "train.jsonl"))))
    remote, local = read_manifest(storage.join(uri, "capture")), read_manifest(pipeline_run / "capture")
    assert remote["rows"] == local["rows"] == 64 and remote["tokens"] == local["tokens"]
    assert [(s["file"], s["rows"], s["rows_digest"], s["bytes"]) for s in remote["shards"]] == \
        [(s["file"], s["rows"], s["rows_digest"], s["bytes"]) for s in local["shards"]]
    names = storage.list_names(storage.join(uri, "capture"))
    assert names == sorted(["draft_vocab.safetensors", "manifest.json", "vocab_stats.json",
                            *[s["file"] for s in local["shards"]]])
    assert storage.read_bytes(storage.join(uri, "ingest", "records.jsonl")) == \
        (pipeline_run / "ingest" / "records.jsonl").read_bytes()
    assert set(json.loads(storage.read_text(storage.join(uri, "summary.json")))) == {"ingest", "tokenize", "capture", "vocab"}


def ultrachat_rows(start: int, n: int) -> list[dict]:
    return [{"prompt": f"question {i}", "prompt_id": f"u{i}",
             "messages": [{"content": f"question {i}", "role": "user"}, {"content": f"answer {i}", "role": "assistant"}]}
            for i in range(start, start + n)]


def test_ingest_reads_parquet_exports_through_globs_locally_and_on_s3(tmp_path, ray_cluster, s3):
    """A Hugging Face dataset's Parquet export (UltraChat's columns), two files and a broken one, matched
    by one glob: every row is a record or a counted reject, the same from a folder and from S3."""
    from pipeline.config import Ingest
    from pipeline.ingest import run_ingest

    folder = tmp_path / "ultrachat"
    folder.mkdir()
    bad = ultrachat_rows(100, 1)
    bad[0]["messages"] = bad[0]["messages"][::-1]  # assistant first
    pq.write_table(pa.Table.from_pylist(ultrachat_rows(0, 5) + bad), folder / "train_sft-00000.parquet")
    pq.write_table(pa.Table.from_pylist(ultrachat_rows(5, 4) + ultrachat_rows(0, 1)), folder / "train_sft-00001.parquet")
    (folder / "train_sft-00002.parquet").write_bytes(b"PAR1 not really")
    (folder / "README.md").write_text("not matched by the glob")
    storage.upload(folder, s3.uri("eagleray/ultrachat"))
    out = {}
    for where, pattern in (("local", str(folder / "train_sft-*.parquet")),
                           ("s3", s3.uri("eagleray/ultrachat/train_sft-*.parquet"))):
        cfg = Ingest(sources=[{"path": pattern, "name": "ultrachat"}])
        stats = run_ingest(cfg, tmp_path / where)
        assert stats["records"] == 9 and stats["read"] == 12, stats
        assert stats["rejected_by_reason"] == {"assistant_first": 1, "duplicate": 1, "broken_parquet": 1}
        assert stats["sources"]["ultrachat"]["files"] == 3
        out[where] = (tmp_path / where / "records.jsonl").read_text()
    assert out["local"] == out["s3"]
    ids = sorted(json.loads(line)["id"] for line in out["s3"].splitlines())
    assert ids == sorted(f"u{i}" for i in range(9))


@pytest.mark.slow
def test_trainer_reads_shards_and_keeps_checkpoints_on_s3(tmp_path, ray_cluster, s3, pipeline_run, tiny_target,
                                                          monkeypatch):
    """Shards and out_dir on S3: Ray Train's checkpoints land at the URI, a rerun resumes from them (not
    from any local file: the mirrors are wiped between runs), and the exported heads and report are there."""
    from pipeline.yaml_config import load_config
    from trainer.config import TrainConfig
    from trainer.driver import run_training
    from trainer.export import import_head

    monkeypatch.setenv("EAGLERAY_CACHE", str(tmp_path / "cache"))
    shards, out = s3.uri("eagleray/train/capture"), s3.uri("eagleray/train/out")
    storage.upload(pipeline_run / "capture", shards)
    tree = {"target": str(tiny_target), "out_dir": out,
            "data": {"shards": shards, "max_rows_per_batch": 4, "val_rows": 8},
            "model": {"ttt_length": 2}, "optim": {"lr": 5e-3}, "max_steps": 6, "epochs": 4, "log_every": 2,
            "checkpoint_every": 3, "eval_every": 3, "scaling": {"num_workers": 1, "cpus_per_worker": 1}}
    first = run_training(load_config(TrainConfig, write_yaml(tmp_path / "t.yaml", tree)))
    assert first["steps"] == 6
    fs, path = storage.filesystem(storage.join(out, "ray", "train"))
    ckpts = [i.base_name for i in fs.get_file_info(pafs.FileSelector(path)) if i.base_name.startswith("checkpoint_")]
    assert ckpts, "no checkpoint at the URI"
    import shutil
    shutil.rmtree(tmp_path / "cache")
    second = run_training(load_config(TrainConfig, write_yaml(tmp_path / "t.yaml", tree | {"max_steps": 8})))
    assert second["steps"] == 8
    resumes = [json.loads(line) for line in storage.read_text(storage.join(out, "resumes.jsonl")).splitlines()]
    assert [r["step"] for r in resumes] == [6]
    report = json.loads(storage.read_text(storage.join(out, "report.json")))
    assert report["steps"] == 8 and report["exports"]["sglang"].startswith("s3://eagleray/train/out/head_sglang")
    head = storage.Mirror(storage.join(out, "head_sglang"), "check").pull()
    state, _, aux = import_head(head, yaml.safe_load((tiny_target / "config.json").read_text())["num_hidden_layers"])
    assert aux == json.loads(storage.read_text(storage.join(shards, "manifest.json")))["aux_layer_ids"]
    assert state["fc.weight"].shape[1] == 3 * state["fc.weight"].shape[0]


@pytest.mark.slow
def test_eval_reads_a_head_from_s3_and_writes_its_report_there(tmp_path, ray_cluster, s3, data_dir, tiny_target,
                                                                 tiny_head, monkeypatch):
    """The eval actor pulls the head from the URI on its node; report.json, report.md and the plots land
    at the URI; decoding stays lossless."""
    from infer.eval import main

    monkeypatch.setenv("EAGLERAY_CACHE", str(tmp_path / "cache"))
    head, out = s3.uri("eagleray/eval/head"), s3.uri("eagleray/eval/report")
    storage.upload(tiny_head, head)
    report = main([str(write_yaml(tmp_path / "eval.yaml", {
        "target": str(tiny_target), "head": head, "out_dir": out,
        "benchmarks": [{"name": "gsm8k", "kind": "gsm8k", "path": str(data_dir / "gsm8k/test.jsonl"), "limit": 2}],
        "decode": {"top_k": 3, "depth": 3, "total_tokens": 8, "max_new_tokens": 16}}))])
    assert report["benchmarks"]["gsm8k"]["match_rate"] == 1.0 and report["benchmarks"]["gsm8k"]["prompts"] == 2
    names = storage.list_names(out)
    assert {"report.json", "report.md"} <= set(names) and any(n.endswith(".png") for n in names), names
    remote = json.loads(storage.read_text(storage.join(out, "report.json")))
    assert remote["benchmarks"] == report["benchmarks"] and remote["head"].startswith("s3://eagleray/eval/head")
