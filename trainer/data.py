"""Training data: the pipeline's shards through Ray Data, checked against the target, bucketed by length.

Each worker streams its split of the rows, gathers a pool of `bucket_pool` rows, sorts the pool by
length into as many cost-balanced micro-batches as every rank agrees on (`MicroBatches`), and orders
those batches at random with a seed derived from (seed, epoch, pool), the same on every rank
(`plan_batches`): the order is a pure function of the stream, so a resumed run replays it exactly.
"""
from __future__ import annotations

import random
from typing import Iterator

import numpy as np
import pyarrow as pa
import torch

from pipeline import storage
from pipeline.codec import from_bytes
from pipeline.shards import first_mismatch, read_manifest
from pipeline.target import TargetSpec
from trainer.batching import flops_cost, padded_cost, plan_batches, plan_steps
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


def shard_files(shard_dir, manifest: dict | None = None) -> list:
    """The run's shard files in order: paths, or URIs when `shard_dir` is one."""
    man = manifest if manifest is not None else read_manifest(shard_dir)
    return [str(storage.join(shard_dir, s["file"])) for s in man["shards"]]


def val_rows(files: list[str], n: int) -> pa.Table:
    """The last n rows of the run's shard files (held out from training)."""
    tables = []
    for f in reversed(files):
        if n <= 0:
            break
        t = storage.read_table(f)
        tables.insert(0, t.slice(max(0, t.num_rows - n)))
        n -= t.num_rows
    return pa.concat_tables(tables) if tables else storage.read_table(files[0]).slice(0, 0)


def rows_of(batch: dict) -> list[dict]:
    n = len(batch["id"])
    return [{k: batch[k][i] for k in ("id", "input_ids", "loss_mask", "aux_hidden", "last_hidden")}
            for i in range(n)]


class Alone:
    """The peers of a single worker: its own answers (the trainer's `RankPeers` is the process group)."""
    rank, world = 0, 1

    def agree(self, dry: bool, need: int) -> tuple[bool, int]:
        return dry, need

    def gather(self, obj) -> list:
        return [obj]


class RowTally:
    """Rows an epoch consumed and an order-free sum of their id hashes: summed over ranks, it shows every
    row was seen exactly once (a lost or doubled row changes the count or the sum)."""

    def __init__(self):
        self.rows, self.hash = 0, 0

    def add(self, rows: list[dict]) -> None:
        self.rows += len(rows)
        self.hash += sum(id_hash(r["id"]) for r in rows)

    def total(self, world: int) -> dict:
        import torch.distributed as dist

        t = torch.tensor([self.rows, self.hash], dtype=torch.int64)
        if world > 1:
            dist.all_reduce(t)
        return {"rows": int(t[0]), "ids_hash": int(t[1])}


class RankPeers:
    """The ranks of the process group as MicroBatches' peers (the trainer's workers)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def agree(self, dry: bool, need: int) -> tuple[bool, int]:
        """Any rank dry, the largest `need`: one all-reduce MAX."""
        import torch.distributed as dist

        t = torch.tensor([int(dry), need], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t[0]), int(t[1])

    def gather(self, obj) -> list:
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def id_hash(row_id) -> int:
    """40 bits of the id's SHA-1: sums of a million rows stay far inside int64."""
    import hashlib

    return int(hashlib.sha1(str(row_id).encode()).hexdigest()[:10], 16)


class MicroBatches:
    """One rank's micro-batches for an epoch: rows from a Ray Data iterator (numpy batches) gathered into
    pools of `pool` rows, planned into batches balanced by estimated FLOPs (`flops`) or padded size.

    A step makes one collective, `peers.agree` (an all-reduce MAX): whether any rank ran dry, whether the
    ranks start new pools. Ray Data's equal split gives every rank the same number of rows, not the same
    work. So with 2+ ranks, at a new pool the ranks gather each row's length and loss tokens, plan their
    pools together (`plan_steps`: at every step the ranks hold batches of nearly the same work) and move
    the rows the plan puts on another rank through `peers.gather`. The epoch ends when any rank is dry."""

    def __init__(self, batches: Iterator[dict], max_tokens: int, max_rows: int, pool: int, seed: int,
                 epoch: int, flops: StepFlops | None = None, peers=None):
        self.batches, self.pool, self.seed, self.epoch = batches, pool, seed, epoch
        self.peers = peers or Alone()
        self.max_tokens, self.max_rows = max_tokens, max_rows
        self.cost = flops_cost(flops) if flops else padded_cost
        self.buf: list[dict] = []
        self.queue: list[list[dict]] = []
        self.pools = 0

    def _gather(self) -> list[dict]:
        while len(self.buf) < self.pool:
            b = next(self.batches, None)
            if b is None:
                break
            self.buf += rows_of(b)
        rows, self.buf = self.buf[:self.pool], self.buf[self.pool:]
        return rows

    def _moved(self, rows: list[dict], place: list[list[tuple[int, int]]]) -> list[list[dict]]:
        """Rows by placement (place[r]: what rank r holds, as (source rank, index)); this rank's rows that
        another rank holds travel through the process group."""
        me = self.peers.rank
        leaving = {k: rows[k] for r, held in enumerate(place) if r != me for src, k in held if src == me}
        arrived = self.peers.gather(leaving)
        return [rows[k] if src == me else arrived[src][k] for src, k in place[me]]

    def _plan_pool(self, rows: list[dict], rng: random.Random) -> list[list[dict]]:
        """One rank: its pool planned alone."""
        lengths, loss = [len(r["input_ids"]) for r in rows], [loss_tokens(r) for r in rows]
        plan = plan_batches(lengths, self.max_tokens, self.max_rows, rng, loss, self.cost)
        return [[rows[i] for i in idx] for idx in plan]

    def _plan_steps(self, rows: list[dict], rng: random.Random) -> list[list[dict]]:
        """2+ ranks: the pools planned together, each step's batches of matched work."""
        shapes = self.peers.gather(([len(r["input_ids"]) for r in rows], [loss_tokens(r) for r in rows]))
        plan = plan_steps([s[0] for s in shapes], [s[1] for s in shapes], self.max_tokens, self.max_rows, rng,
                          self.cost)
        held = iter(self._moved(rows, [[x for batch in batches for x in batch] for batches in plan]))
        return [[next(held) for _ in batch] for batch in plan[self.peers.rank]]

    def next_batch(self) -> list[dict] | None:
        rows = self._gather() if not self.queue else []
        any_dry, new_pool = self.peers.agree(not self.queue and not rows, int(bool(rows)))
        if any_dry:
            return None
        if new_pool:
            if self.queue:
                raise RuntimeError(f"rank out of step: another rank starts pool {self.pools} of epoch "
                                   f"{self.epoch} while this one has {len(self.queue)} batches left")
            rng = random.Random(hash((self.seed, self.epoch, self.pools)) & 0xFFFFFFFF)
            self.pools += 1
            self.queue = self._plan_steps(rows, rng) if self.peers.world > 1 else self._plan_pool(rows, rng)
        return self.queue.pop(0)


def loss_tokens(row: dict) -> int:
    return int(np.asarray(row["loss_mask"]).sum())


class EpochCache:
    """A rank's rows of an epoch, as Ray Data gave them, kept in memory under a byte budget so later epochs
    replay them instead of streaming the split again: a new epoch of the split re-reads and re-decodes
    every shard, and on a 2-core box its first pool arrives seconds after the last step (ARCHITECTURE.md
    §7). Only complete epochs within the budget are replayed, in the order they came."""

    def __init__(self, budget_mb: int):
        self.budget = budget_mb * 2 ** 20
        self.batches: list[dict] = []
        self.complete = False

    def record(self, batches: Iterator[dict]) -> Iterator[dict]:
        self.batches, self.complete, size = [], False, 0
        for b in batches:
            if size <= self.budget:
                size += batch_bytes(b)
                if size <= self.budget:
                    self.batches.append(b)
                else:
                    self.batches = []
            yield b
        self.complete = 0 < size <= self.budget

    def replay(self) -> Iterator[dict]:
        return iter(self.batches)


def batch_bytes(batch: dict) -> int:
    """Bytes a numpy batch of shard rows holds: hidden states, ids and masks."""
    return sum(len(x) for k in ("aux_hidden", "last_hidden") for x in batch[k]) + sum(
        np.asarray(x).nbytes for k in ("input_ids", "loss_mask") for x in batch[k])


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
