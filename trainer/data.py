"""Training data: the pipeline's shards through Ray Data, checked against the target, bucketed by length.

Each worker streams its split of the rows, gathers a pool of `bucket_pool` rows, sorts the pool by
length into padded micro-batches under a token budget, and orders those batches with a seed derived
from (seed, epoch, pool), the same on every rank (`plan_batches`): the order is a pure function of the
stream, so a resumed run replays it exactly.
"""
from __future__ import annotations

import random
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from pipeline.buckets import length_buckets
from pipeline.codec import from_bytes
from pipeline.shards import first_mismatch, read_manifest
from pipeline.target import TargetSpec
from trainer.cost import StepFlops


def check_manifest(manifest: dict, spec: TargetSpec) -> None:
    """Refuse shards captured from another target: the message names the field that disagrees."""
    expected = spec.identity()
    if "target_weights_id" not in manifest:  # manifests before this field: config and template checks only
        expected.pop("target_weights_id")
    field = first_mismatch(manifest, expected)
    if field is not None:
        raise ValueError(f"shards do not match the target {spec.path}: manifest field {field} is "
                         f"{manifest.get(field)!r}, the target has {expected[field]!r}")
    try:
        spec.aux_layers(manifest.get("aux_layer_ids") or [], "manifest aux_layer_ids")
    except ValueError as e:
        raise ValueError(f"shards do not match the target {spec.path}: {e}") from None


def shard_files(shard_dir: Path, manifest: dict | None = None) -> list[str]:
    man = manifest if manifest is not None else read_manifest(shard_dir)
    return [str(Path(shard_dir) / s["file"]) for s in man["shards"]]


def val_rows(files: list[str], n: int) -> pa.Table:
    """The last n rows of the run's shard files (held out from training)."""
    tables = []
    for f in reversed(files):
        if n <= 0:
            break
        t = pq.read_table(f)
        tables.insert(0, t.slice(max(0, t.num_rows - n)))
        n -= t.num_rows
    return pa.concat_tables(tables) if tables else pq.read_table(files[0]).slice(0, 0)


def drop_ids(batch: pa.Table, ids: list[str]) -> pa.Table:
    """Ray Data UDF: remove held-out rows from the training stream."""
    return batch.filter(pc.invert(pc.is_in(batch["id"], value_set=pa.array(ids, pa.string()))))


ORDER_SEGMENTS = 4


def plan_batches(lengths: list[int], max_tokens: int, max_rows: int, rng: random.Random,
                 cost: Callable[[list[int]], float] | None = None,
                 segments: int = ORDER_SEGMENTS) -> list[list[int]]:
    """Pure: indices of a pool grouped by length into padded batches (<= max_tokens, <= max_rows), in a
    rank-aligned random order. The batches are sorted by `cost` (default: padded size, rows x longest row),
    cut into `segments` runs of equal count, and rng shuffles the runs and flips each one's direction.
    Every rank draws the same rng for the same pool, so at a given step the ranks hold batches from the
    same place in their own cost order: similar work, so neither waits long for the other at the gradient
    all-reduce (a full shuffle paired random sizes: 2 demo workers reached 1.3x one, ARCHITECTURE.md §10)."""
    batches = length_buckets(lengths, max_tokens, max_rows)
    cost = cost or (lambda b: len(b) * max(lengths[i] for i in b))
    batches.sort(key=cost)  # stable: ties keep length order
    n = len(batches)
    runs = [batches[n * k // segments:n * (k + 1) // segments] for k in range(segments)]
    rng.shuffle(runs)
    out = []
    for run in runs:
        out += run[::-1] if rng.random() < 0.5 else run
    return out


def flops_cost(lengths: list[int], loss_tokens: list[int], flops: StepFlops) -> Callable[[list[int]], float]:
    """A batch's estimated FLOPs (trainer/cost.py) from its rows' lengths and loss-mask sums: on a
    SmolLM2-shaped head the vocab-sized work on loss positions outweighs the layer, so padded size alone
    pairs batches whose work differs by 2x."""
    return lambda b: flops.batch(len(b), max(lengths[i] for i in b), sum(loss_tokens[i] for i in b))


def rows_of(batch: dict) -> list[dict]:
    n = len(batch["id"])
    return [{k: batch[k][i] for k in ("id", "input_ids", "loss_mask", "aux_hidden", "last_hidden")}
            for i in range(n)]


def iter_micro_batches(batches: Iterator[dict], max_tokens: int, max_rows: int, pool: int, seed: int,
                       epoch: int, flops: StepFlops | None = None) -> Iterator[list[dict]]:
    """Rows from a Ray Data iterator (numpy batches) -> length-bucketed micro-batches of rows, ordered by
    their estimated FLOPs where `flops` is given, else by padded size."""
    buf: list[dict] = []
    pool_idx = 0

    def flush(rows):
        nonlocal pool_idx
        rng = random.Random(hash((seed, epoch, pool_idx)) & 0xFFFFFFFF)
        pool_idx += 1
        lengths = [len(r["input_ids"]) for r in rows]
        loss = [int(np.asarray(r["loss_mask"]).sum()) for r in rows]
        cost = flops_cost(lengths, loss, flops) if flops else None
        for idx in plan_batches(lengths, max_tokens, max_rows, rng, cost):
            yield [rows[i] for i in idx]

    for b in batches:
        buf += rows_of(b)
        while len(buf) >= pool:
            yield from flush(buf[:pool])
            buf = buf[pool:]
    if buf:
        yield from flush(buf)


def collate(rows: list[dict], dtype: str, target_hidden: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors: input_ids, loss_mask [B,T]; aux [B,T,3Ht]; last [B,T,H] (storage dtype)."""
    t = max(len(r["input_ids"]) for r in rows)
    b = len(rows)
    ids = torch.zeros((b, t), dtype=torch.long)
    mask = torch.zeros((b, t), dtype=torch.long)
    first_aux = from_bytes(rows[0]["aux_hidden"], dtype, 3 * target_hidden, groups=3)
    aux = torch.zeros((b, t, 3 * target_hidden), dtype=first_aux.dtype)
    last = torch.zeros((b, t, target_hidden), dtype=first_aux.dtype)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n] = torch.from_numpy(np.asarray(r["input_ids"], dtype=np.int64))
        mask[i, :n] = torch.from_numpy(np.asarray(r["loss_mask"], dtype=np.int64))
        aux[i, :n] = from_bytes(r["aux_hidden"], dtype, 3 * target_hidden, groups=3)
        last[i, :n] = from_bytes(r["last_hidden"], dtype, target_hidden)
    return {"input_ids": ids, "loss_mask": mask, "aux": aux, "last": last}
