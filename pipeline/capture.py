"""Stage 4, capture: target forwards in a Ray Data actor pool -> hidden-state Parquet shards.

The token table is cut into fixed row ranges; range k becomes `shard-0000k.parquet`, written under a
temp name and renamed when complete (to an object store: one upload), so a killed run rerun skips finished shards (their bytes are not
touched) and redoes only the rest. Each shard carries the run's signature in its schema metadata; a
rerun with a different target, dtype or layer set refuses to mix shards. A manifest closes the run.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import ray
import torch

from pipeline import storage
from pipeline.buckets import length_buckets
from pipeline.cluster import check_actor_cpus
from pipeline.codec import StorageOverflow, bytes_per_token, to_bytes
from pipeline.progress import progress_bar
from pipeline.hidden import capture_hidden, check_logit_rule, to_host
from pipeline.target import TargetSpec, load_model
from pipeline.config import Capture
from pipeline.tokenize import tokens_max_length
from pipeline.shards import (MANIFEST, rows_digest, shard_meta, shard_name, shard_ranges, signature_mismatch,
                             data_signature, write_shard)


def capture_rows(model, device: str, rows: list[dict], layer_ids: list[int], dtype: str,
                 batch_tokens: int, pad_id: int = 0) -> tuple[pa.Table, float]:
    """Token rows -> shard table (input order kept); also the seconds spent in target forwards."""
    aux_b: list[bytes] = [b""] * len(rows)
    last_b: list[bytes] = [b""] * len(rows)
    lengths = [len(r["input_ids"]) for r in rows]
    fwd_s = 0.0
    for group in length_buckets(lengths, batch_tokens, longest_first=True):
        width = lengths[group[0]]
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        att = torch.zeros((len(group), width), dtype=torch.long)
        for j, i in enumerate(group):
            ids[j, : lengths[i]] = torch.as_tensor(np.asarray(rows[i]["input_ids"], dtype=np.int64))
            att[j, : lengths[i]] = 1
        t0 = time.perf_counter()
        aux, last = capture_hidden(model, ids.to(device), att.to(device), layer_ids)
        if device == "cuda":
            torch.cuda.synchronize()
        fwd_s += time.perf_counter() - t0
        aux, last = to_host(aux), to_host(last)  # one pinned transfer each, then rows are cut on the host
        for j, i in enumerate(group):
            try:
                aux_b[i] = to_bytes(aux[j, : lengths[i]], dtype, groups=3)
                last_b[i] = to_bytes(last[j, : lengths[i]], dtype)
            except StorageOverflow as e:
                raise StorageOverflow(f"capture row {rows[i]['id']}: {e}") from None
    table = pa.table({
        "id": pa.array([r["id"] for r in rows], pa.string()),
        "input_ids": pa.array([np.asarray(r["input_ids"], np.int32) for r in rows], pa.list_(pa.int32())),
        "loss_mask": pa.array([np.asarray(r["loss_mask"], np.uint8) for r in rows], pa.list_(pa.uint8())),
        "aux_hidden": pa.array(aux_b, pa.binary()), "last_hidden": pa.array(last_b, pa.binary())})
    return table, fwd_s


class CaptureWorker:
    """Ray Data actor: one target copy; each input row names a shard (index, start, end) of the tokens.
    mode "write": write the shard, return its counts (the pipeline's capture stage); "stream": return the
    shard's rows, hidden states included, writing nothing (streamed training); "write_rows": both
    (hybrid training's first epoch)."""

    def __init__(self, target: str, cfg: Capture, tokens_path: str, out_dir: str | None, signature: dict,
                 mode: str = "write"):
        self.cfg, self.mode = cfg, mode
        if self.cfg.threads_per_actor:
            torch.set_num_threads(self.cfg.threads_per_actor)
        self.model, self.device = load_model(target, self.cfg.model_dtype, self.cfg.num_gpus_per_actor > 0)
        check_logit_rule(self.model, signature["aux_layer_ids"])
        self.pad_id = self.model.config.pad_token_id or 0
        self.tokens = storage.read_table(tokens_path, columns=["id", "input_ids", "loss_mask", "n_tokens"])
        self.out_dir, self.signature = (storage.location(out_dir) if out_dir else None), signature

    def __call__(self, batch: dict):
        if self.mode != "write":
            tables = [self.shard(int(i), int(s), int(e))[0] for i, s, e in zip(batch["index"], batch["start"], batch["end"])]
            return pa.concat_tables(tables)
        out = {k: [] for k in ("shard", "rows", "tokens", "bytes", "forward_s", "total_s")}
        for index, start, end in zip(batch["index"], batch["start"], batch["end"]):
            t0 = time.perf_counter()
            table, fwd, nbytes = self.shard(int(index), int(start), int(end))
            for k, v in (("shard", int(index)), ("rows", table.num_rows), ("bytes", nbytes), ("forward_s", fwd),
                         ("tokens", int(pa.compute.sum(pa.compute.list_value_length(table["input_ids"])).as_py())),
                         ("total_s", time.perf_counter() - t0)):
                out[k].append(v)
        return out

    def shard(self, index: int, start: int, end: int) -> tuple[pa.Table, float, int]:
        """Capture token rows [start, end) -> (shard table, forward seconds, bytes written or 0)."""
        rows = self.tokens.slice(start, end - start).to_pylist()
        table, fwd = capture_rows(self.model, self.device, rows, self.signature["aux_layer_ids"],
                                  self.cfg.dtype, self.cfg.batch_tokens, self.pad_id)
        nbytes = 0
        if self.mode != "stream":
            meta = dict(self.signature, shard=index, rows=len(rows), tokens=int(sum(r["n_tokens"] for r in rows)),
                        input_digest=rows_digest([r["id"] for r in rows], [r["n_tokens"] for r in rows]))
            nbytes = write_shard(table, storage.join(self.out_dir, shard_name(index)), meta, self.cfg.compression_level)
        return table, fwd, nbytes


def make_signature(target: Path, cfg: Capture, max_length: int) -> dict:
    """The data signature of this capture (pipeline/shards.py `data_signature`)."""
    spec = TargetSpec.read(target)
    return data_signature(spec, spec.aux_layers(cfg.layer_ids), cfg.dtype, max_length)


def pending_shards(out_dir, tokens: pa.Table, ranges, signature: dict) -> tuple[list, list]:
    """Split ranges into (to do, already complete); refuse shards captured with another signature.
    `out_dir`: a path or URI."""
    todo, done = [], []
    ids, lens = tokens.column("id").to_pylist(), tokens.column("n_tokens").to_pylist()
    for stale in storage.list_names(out_dir, ".shard-*.tmp"):
        storage.delete(storage.join(out_dir, stale))  # a killed writer's leftovers; the shard is redone below
    names = {shard_name(i) for i, _, _ in ranges}
    present = set(storage.list_names(out_dir, "shard-*.parquet"))
    for extra in present - names:  # from an earlier run over more rows
        storage.delete(storage.join(out_dir, extra))
    for index, start, end in ranges:
        path = storage.join(out_dir, shard_name(index))
        if shard_name(index) in present:
            meta = shard_meta(path)
            if meta.get("target_weights_id") != signature["target_weights_id"]:
                storage.delete(path)  # the target was retrained in place: its states are stale, recapture
                todo.append((index, start, end))
                continue
            why = signature_mismatch(meta, signature)
            if why:
                raise ValueError(f"{storage.redact(path)}: captured with different settings ({why}); "
                                 f"use a new run_dir or delete {storage.redact(out_dir)}")
            if meta.get("input_digest") == rows_digest(ids[start:end], lens[start:end]):
                done.append(index)
                continue
            storage.delete(path)  # its input rows changed: recapture
        todo.append((index, start, end))
    return todo, done


def run_capture(cfg: Capture, target: Path, tokens_path, out_dir, provenance: dict | None = None) -> dict:
    """Capture every pending shard; `provenance` (the pipeline config) is recorded in the manifest.
    `tokens_path` and `out_dir` are paths or URIs: the actors, on any node, read and write there."""
    if not storage.is_uri(out_dir):
        Path(out_dir).mkdir(parents=True, exist_ok=True)
    signature = make_signature(target, cfg, tokens_max_length(tokens_path))
    tokens = storage.read_table(tokens_path, columns=["id", "n_tokens"])
    ranges = shard_ranges(tokens.num_rows, cfg.rows_per_shard)
    todo, done = pending_shards(out_dir, tokens, ranges, signature)
    t0 = time.perf_counter()
    results = []  # a lost actor is restarted by Ray and its shard retried in place (docs/ARCHITECTURE.md §12)

    if todo:
        names = {shard_name(i) for i, _, _ in ranges}
        written = lambda: len(names.intersection(storage.list_names(out_dir, "shard-*.parquet")))  # noqa: E731
        with progress_bar("capture", len(ranges), written, unit="shard"):
            results = capture_dataset(cfg, target, tokens_path, todo, signature, out_dir, "write").take_all()
    wall = time.perf_counter() - t0
    manifest = write_manifest(out_dir, ranges, signature, target, provenance)
    fwd = sum(r["forward_s"] for r in results)
    total = sum(r["total_s"] for r in results)
    return {"shards": len(ranges), "captured": len(todo), "skipped_complete": len(done), "rows": manifest["rows"],
            "tokens": manifest["tokens"], "bytes": manifest["bytes"],
            "disk_vs_raw": round(manifest["bytes"] / max(1, manifest["raw_hidden_bytes"]), 4),
            "wall_s": round(wall, 2), "forward_share": round(fwd / total, 3) if total else None}


def write_manifest(out_dir, ranges, signature: dict, target: Path, provenance: dict | None) -> dict:
    """manifest.json over the complete shards of `ranges` (written last: a manifest means a complete run)."""
    shards = []
    for index, _, _ in ranges:
        path = storage.join(out_dir, shard_name(index))
        meta = shard_meta(path)
        shards.append({"file": shard_name(index), "rows": meta["rows"], "tokens": meta["tokens"],
                       "bytes": storage.size(path), "rows_digest": meta.get("input_digest")})
    toks = sum(s["tokens"] for s in shards)
    h, dtype = signature["hidden_size"], signature["dtype"]
    width = bytes_per_token(dtype, 3 * h, 3) + bytes_per_token(dtype, h)
    manifest = dict(signature, target=storage.redact(storage.absolute(target)), rows=sum(s["rows"] for s in shards),
                    tokens=toks,
                    bytes=sum(s["bytes"] for s in shards), raw_hidden_bytes=toks * width, shards=shards,
                    pipeline_config=provenance or {})
    storage.write_text(storage.join(out_dir, MANIFEST), json.dumps(manifest, indent=2))
    return manifest


def capture_dataset(cfg: Capture, target: Path, tokens_path, ranges, signature: dict,
                    out_dir=None, mode: str = "stream"):
    """A Ray Data dataset over shard `ranges` from a pool of capture actors (`CaptureWorker` modes):
    "stream" yields the rows with hidden states (SHARD_SCHEMA) in `ranges` order and writes nothing,
    "write_rows" also writes each shard to out_dir, "write" writes and yields counts only.
    Ray Data restarts an actor lost with its node and retries its shard on it (a rewritten shard has the
    same bytes)."""
    check_actor_cpus("capture.num_cpus_per_actor", min(cfg.num_actors, len(ranges)), cfg.num_cpus_per_actor)
    items = [{"index": i, "start": s, "end": e} for i, s, e in ranges]
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    kwargs = dict(batch_size=1, batch_format="numpy",
                  compute=ray.data.ActorPoolStrategy(size=min(cfg.num_actors, len(items))),
                  num_cpus=cfg.num_cpus_per_actor, num_gpus=cfg.num_gpus_per_actor,
                  resources=cfg.resources_per_actor or None,
                  fn_constructor_kwargs=dict(target=str(target), cfg=cfg, tokens_path=str(tokens_path),
                                             out_dir=str(out_dir) if out_dir else None, signature=signature,
                                             mode=mode))
    return ds.map_batches(CaptureWorker, **kwargs)
