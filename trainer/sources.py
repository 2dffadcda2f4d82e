"""Where training rows come from (`data.source`, docs/ARCHITECTURE.md §7).

- parquet: the pipeline's capture shards (`data.shards`), written beforehand.
- stream: the pipeline YAML (`data.pipeline`) runs its text stages (ingest, regenerate, tokenize, vocab:
  small files), then its capture stage runs as a Ray Data dataset of capture actors whose rows feed the
  trainer workers through `streaming_split`; no hidden state is written. Every epoch captures again.
- hybrid: the first epoch streams like `stream` and writes the shards as it goes; the manifest is written
  when that epoch ends, and later epochs read the shards (a second `fit`, resumed from the checkpoint).

Whatever the source, rows come in the same order (shard ranges in order, `preserve_order`), so a resumed
run replays its epoch deterministically; the held-out rows are the last `data.val_rows` rows of the run.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pyarrow as pa

from pipeline import storage
from pipeline.shards import SIGNATURE_FIELDS, drop_ids, read_manifest, shard_name, shard_ranges, signature_mismatch
from pipeline.vocab import VOCAB_FILE
from trainer.config import TrainConfig
from trainer.data import shard_files, val_rows

FOOTER_READERS_ENV = "RAY_DATA_PARQUET_FOOTER_NUM_ACTORS"
SHARDS_PER_FOOTER_READER = 256


@dataclass
class Phase:
    """One `fit` of the trainer: its dataset and the epoch it stops before (None: the configured epochs)."""
    dataset: Callable[[], object]
    stop_epoch: int | None = None
    live: bool = False                          # rows come from capture actors (stream_buffer_mb applies)
    after: Callable[[], None] | None = None    # run when the fit returns (hybrid: write the manifest)


@dataclass
class TrainingData:
    signature: dict                 # the data signature (manifest fields), checked against the target
    vocab_dir: Path                 # draft_vocab.safetensors
    length_files: list[str]         # parquet files holding id + input_ids of every row, in order
    val: pa.Table                   # held-out rows, hidden states included
    rows: int
    tokens: int
    phases: list[Phase] = field(default_factory=list)


def _without(ds, held_out: list[str]):
    return ds.map_batches(drop_ids, batch_format="pyarrow", fn_kwargs={"ids": held_out}) if held_out else ds


def read_shards(files: list[str]):
    """A Ray Data dataset over shard files (paths or URIs of one filesystem), read on any node.

    Ray Data 2.60 lists parquet files by reading their footers on a pool of actors, 32 by default: 32
    worker processes started for every read, 5-6 s of a 2-CPU node for a run's 8 shards. The pool is sized
    to the files here (one actor per SHARDS_PER_FOOTER_READER), unless the user set its variable."""
    import ray

    fs, _ = storage.filesystem(files[0])
    paths = [storage.filesystem(f)[1] for f in files]
    if FOOTER_READERS_ENV in os.environ:
        return ray.data.read_parquet(paths, filesystem=fs)
    os.environ[FOOTER_READERS_ENV] = str(min(32, math.ceil(len(files) / SHARDS_PER_FOOTER_READER)))
    try:  # Ray reads the variable as it plans the read: here, in the driver
        return ray.data.read_parquet(paths, filesystem=fs)
    finally:
        del os.environ[FOOTER_READERS_ENV]


def check_training_rows(rows: int, n_val: int) -> None:
    """Refuses, in one line, held-out rows that leave none to train on (a run of zero steps has no head)."""
    if rows - n_val < 1:
        raise ValueError(f"data.val_rows: {n_val} held-out rows of {rows} leave none to train on; "
                         f"set it below {rows}")


def parquet_data(shards, n_val: int, replay=None) -> TrainingData:
    manifest = read_manifest(shards)
    files = shard_files(shards, manifest)
    check_training_rows(manifest["rows"], n_val)
    val = val_rows(files, n_val) if n_val else storage.read_table(files[0]).slice(0, 0)
    held = val["id"].to_pylist()
    vocab_dir = storage.Mirror(shards).pull(VOCAB_FILE).parent
    rows, tokens = manifest["rows"], manifest["tokens"]
    if replay is not None and replay.shards is not None:  # first, so the held-out rows stay the new ones
        old = replay_shards(read_manifest(replay.shards), manifest, rows - len(held), replay.share)
        files = [str(storage.join(replay.shards, s["file"])) for s in old] + files
        rows, tokens = rows + sum(s["rows"] for s in old), tokens + sum(s["tokens"] for s in old)
    return TrainingData(manifest, vocab_dir, files, val, rows, tokens,
                        [Phase(lambda: _without(read_shards(files), held))])


def replay_shards(old: dict, new: dict, new_rows: int, share: float) -> list[dict]:
    """The earlier capture's shards to replay (manifest entries): whole shards spread evenly over it, the
    fewest whose rows reach `share` of the mixed training rows. Refuses, in one line, shards of another target,
    other aux layers or another storage dtype (their rows could not share a batch with the new ones)."""
    expected = {k: v for k, v in new.items() if k in SIGNATURE_FIELDS and k != "max_length"}
    why = signature_mismatch(old, expected)
    if why:
        raise ValueError(f"data.replay.shards: {why.replace('shards have', 'they have')} (the new shards')")
    want = round(new_rows * share / (1 - share))
    shards = old["shards"]
    if want <= 0 or not shards:
        return []
    per = max(1, round(sum(s["rows"] for s in shards) / len(shards)))
    k = min(len(shards), max(1, math.ceil(want / per)))
    return [shards[round(i * len(shards) / k)] for i in range(k)]


def stream_data(cfg: TrainConfig, hybrid: bool) -> TrainingData:
    """Run the pipeline's text stages, then describe the capture stream (and, for hybrid, its shards)."""
    import ray

    from pipeline.__main__ import run as run_pipeline
    from pipeline.capture import capture_dataset, make_signature, write_manifest
    from pipeline.config import PipelineConfig
    from pipeline.tokenize import tokens_max_length
    from pipeline.yaml_config import load_config

    pcfg = load_config(PipelineConfig, cfg.data.pipeline)
    if storage.absolute(pcfg.target) != storage.absolute(cfg.target):
        raise ValueError(f"data.pipeline: its target {pcfg.target} is not the trainer's target {cfg.target}")
    run_pipeline(pcfg.model_copy(update={"capture": pcfg.capture.model_copy(update={"enabled": False})}))
    # Paths or URIs: capture's actors read the tokens and (hybrid) write the shards where run_dir is.
    tokens, out_dir = storage.join(pcfg.stage_dir("tokenize"), "tokens.parquet"), pcfg.stage_dir("capture")
    if not storage.is_uri(out_dir):
        out_dir.mkdir(parents=True, exist_ok=True)
    cap = pcfg.capture
    signature = make_signature(pcfg.target, cap, tokens_max_length(tokens))
    n = storage.parquet_file(tokens).metadata.num_rows
    ranges = shard_ranges(n, cap.rows_per_shard)
    check_training_rows(n, cfg.data.val_rows)
    k = min(cfg.data.val_rows, n)
    if k:
        val_ds = capture_dataset(cap, pcfg.target, tokens, [(-1, n - k, n)], signature)
        val = pa.concat_tables(ray.get(val_ds.to_arrow_refs()))
    else:
        val = pa.table({"id": pa.array([], pa.string())})
    held = val["id"].to_pylist()

    def stream():
        mode = "write_rows" if hybrid else "stream"
        return _without(capture_dataset(cap, pcfg.target, tokens, ranges, signature, out_dir, mode), held)

    n_tokens = int(pa.compute.sum(storage.read_table(tokens, columns=["n_tokens"])["n_tokens"]).as_py())
    data = TrainingData(signature, storage.Mirror(out_dir).pull(VOCAB_FILE).parent, [str(tokens)], val, n, n_tokens)
    if not hybrid:
        data.phases.append(Phase(stream, live=True))
        return data
    files = [str(storage.join(out_dir, shard_name(i))) for i, _, _ in ranges]
    manifest = lambda: write_manifest(out_dir, ranges, signature, pcfg.target, pcfg.model_dump(mode="json"))  # noqa: E731
    data.phases.append(Phase(stream, stop_epoch=1, after=manifest, live=True))
    if cfg.epochs > 1:
        data.phases.append(Phase(lambda: _without(read_shards(files), held)))
    return data


def training_data(cfg: TrainConfig) -> TrainingData:
    if cfg.data.source == "parquet":
        return parquet_data(cfg.data.shards, cfg.data.val_rows, cfg.data.replay)
    return stream_data(cfg, hybrid=cfg.data.source == "hybrid")
