"""Training from a live capture stream (`data.source: stream | hybrid`) against training from shards."""
import json
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import pipeline_tree, write_yaml
from pipeline.yaml_config import load_config
from trainer.config import TrainConfig
from trainer.data import id_hash

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stream_pipeline(tmp_path_factory, ray_cluster, tiny_target, demo_corpus) -> Path:
    """A pipeline YAML (48 records, 6-row shards) whose full run is the parquet reference."""
    from pipeline.__main__ import run
    from pipeline.config import PipelineConfig

    d = tmp_path_factory.mktemp("stream_pipeline")
    tree = pipeline_tree(d / "parquet_run", tiny_target, demo_corpus / "train.jsonl", records=48,
                         capture={"rows_per_shard": 6})
    run(load_config(PipelineConfig, write_yaml(d / "parquet.yaml", tree)))
    tree["run_dir"] = str(d / "stream_run")
    write_yaml(d / "stream.yaml", tree)
    return d


def train(tmp: Path, tiny_target: Path, data: dict, **over) -> tuple[TrainConfig, dict]:
    from trainer.driver import run_training

    tree = {"target": str(tiny_target), "out_dir": str(tmp / "out"),
            "data": {"max_tokens_per_batch": 1024, "max_rows_per_batch": 4, "bucket_pool": 16, "val_rows": 6,
                     **data},
            "model": {"ttt_length": 2}, "optim": {"lr": 3e-3, "warmup_ratio": 0.1},
            "scaling": {"num_workers": 1, "cpus_per_worker": 0.5, "threads_per_worker": 1},
            "epochs": 2, "checkpoint_every": 1000, "eval_every": 1000, "log_every": 1, **over}
    tmp.mkdir(parents=True, exist_ok=True)
    cfg = load_config(TrainConfig, write_yaml(tmp / "train.yaml", tree))
    return cfg, run_training(cfg)


def history(cfg: TrainConfig) -> list[dict]:
    return json.loads((cfg.out_dir / "history.json").read_text())


def expected_tally(tokens: Path, val_rows: int) -> dict:
    ids = pq.read_table(tokens, columns=["id"])["id"].to_pylist()
    ids = ids[: len(ids) - val_rows]
    return {"rows": len(ids), "ids_hash": sum(id_hash(i) for i in ids)}


def test_stream_and_hybrid_train_exactly_like_parquet(tmp_path, stream_pipeline, tiny_target):
    parquet_cfg, _ = train(tmp_path / "parquet", tiny_target, {"shards": str(stream_pipeline / "parquet_run/capture")})
    stream_cfg, _ = train(tmp_path / "stream", tiny_target,
                          {"source": "stream", "pipeline": str(stream_pipeline / "stream.yaml")})
    capture_dir = stream_pipeline / "stream_run" / "capture"
    assert not list(capture_dir.glob("*shard*")), "stream mode wrote hidden states"
    assert (capture_dir / "draft_vocab.safetensors").is_file()
    want = expected_tally(stream_pipeline / "stream_run/tokenize/tokens.parquet", 6)
    ends = [h for h in history(stream_cfg) if "epoch_end" in h]
    assert [e["epoch_end"] for e in ends] == [0, 1]
    assert all({"rows": e["rows"], "ids_hash": e["ids_hash"]} == want for e in ends), (ends, want)
    ref = [h["loss"] for h in history(parquet_cfg) if "loss" in h]
    got = [h["loss"] for h in history(stream_cfg) if "loss" in h]
    assert len(ref) == len(got) > 4 and max(abs(a - b) for x, y in zip(ref, got) for a, b in zip(x, y)) <= 1e-6
    evals = [h["val_loss"][0] for h in history(stream_cfg) if "val_loss" in h]
    assert len(evals) == 2 and evals[-1] < 0.9 * evals[0], evals  # held-out loss falls (2.74 -> 2.21 seen)

    hybrid_cfg, _ = train(tmp_path / "hybrid", tiny_target,
                          {"source": "hybrid", "pipeline": str(stream_pipeline / "stream.yaml")})
    shards = sorted(capture_dir.glob("shard-*.parquet"))
    man = json.loads((capture_dir / "manifest.json").read_text())
    assert len(shards) == len(man["shards"]) == 8 and man["rows"] == 48
    for mine, theirs in zip(shards, sorted((stream_pipeline / "parquet_run/capture").glob("shard-*.parquet"))):
        assert pq.read_table(mine).equals(pq.read_table(theirs)), mine.name  # same bytes of hidden states
    hyb = [h["loss"] for h in history(hybrid_cfg) if "loss" in h]
    assert len(hyb) == len(ref) and max(abs(a - b) for x, y in zip(ref, hyb) for a, b in zip(x, y)) <= 1e-6
    assert [e["epoch_end"] for e in history(hybrid_cfg) if "epoch_end" in e] == [0, 1]


def test_killed_capture_actor_is_restarted_and_rows_seen_once(tmp_path, ray_cluster, stream_pipeline, tiny_target):
    """SIGKILL the capture actor while the epoch streams: Ray Data restarts it and retries its shard."""
    import os
    import signal

    from conftest import actor_processes

    killed: list[int] = []

    def kill_first_capture_actor():
        deadline = time.time() + 240
        while time.time() < deadline:
            for p in actor_processes("CaptureWorker", markers=ray_cluster["markers"]):
                time.sleep(0.5)  # let it take a shard or two first
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                killed.append(p.pid)
                return
            time.sleep(0.1)

    tree = load_config_dict(stream_pipeline / "stream.yaml")
    tree["run_dir"] = str(tmp_path / "killed_run")
    tree["capture"]["rows_per_shard"] = 2  # 48 shards, held back by a 1 MB buffer: the kill lands mid-stream
    tree["ingest"]["sources"][0]["max_records"] = 96
    write_yaml(tmp_path / "killed.yaml", tree)
    killer = threading.Thread(target=kill_first_capture_actor, daemon=True)
    killer.start()
    cfg, _ = train(tmp_path / "k", tiny_target, {"source": "stream", "pipeline": str(tmp_path / "killed.yaml"),
                                                  "val_rows": 0, "stream_buffer_mb": 1}, epochs=1)
    killer.join(timeout=5)
    assert killed, "no capture actor was found to kill"
    ends = [h for h in history(cfg) if "epoch_end" in h]
    want = expected_tally(tmp_path / "killed_run/tokenize/tokens.parquet", 0)
    assert [{"rows": e["rows"], "ids_hash": e["ids_hash"]} for e in ends] == [want]


def load_config_dict(path: Path) -> dict:
    import yaml

    return yaml.safe_load(Path(path).read_text())


def test_shards_are_read_with_a_footer_pool_sized_to_the_files(stream_pipeline, monkeypatch):
    """Ray Data plans a parquet read on a pool of footer-reading actors, 32 unless told: read_shards sizes
    it to the files (1 for 8 shards) for that read only, and keeps a size the user set."""
    import os

    import ray

    from trainer.data import shard_files
    from trainer.sources import FOOTER_READERS_ENV, read_shards

    seen, real = [], ray.data.read_parquet
    monkeypatch.setattr(ray.data, "read_parquet", lambda *a, **k: (seen.append(os.environ.get(FOOTER_READERS_ENV)),
                                                                   real(*a, **k))[1])
    monkeypatch.delenv(FOOTER_READERS_ENV, raising=False)
    files = shard_files(stream_pipeline / "parquet_run/capture")
    assert len(files) == 8 and read_shards(files).count() == 48
    assert seen == ["1"] and FOOTER_READERS_ENV not in os.environ
    monkeypatch.setenv(FOOTER_READERS_ENV, "3")
    read_shards(files)
    assert seen == ["1", "3"] and os.environ[FOOTER_READERS_ENV] == "3"
