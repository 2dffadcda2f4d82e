"""The endpoint's traffic log (`traffic_log:` in the serve config; docs/USAGE.md "Learning from traffic").

A replica hands every finished decode to `TrafficLog.record`, which only samples and queues it: a bounded
queue, never a wait, never an exception into the request. A writer thread batches the rows into Parquet
files (pipeline/served.py's schema, zstd) at the configured folder or URI, one file per batch, named by
the replica's tag and a sequence number; each file appears whole (pipeline/storage.py `write_bytes`).
Rows that cannot be kept are counted by cause (`stats`), never lost silently: a full queue, the `max_mb`
cap reached, a failed write.
"""
from __future__ import annotations

import io
import logging
import queue
import random
import threading
import time
import uuid

from pydantic import Field

from pipeline import storage
from pipeline.yaml_config import Location, StrictModel

log = logging.getLogger(__name__)
MB = 1 << 20


class TrafficLogConfig(StrictModel):
    path: Location | None = Field(None, description="folder or URI of the log's Parquet files; null: no log")
    sample_rate: float = Field(1.0, gt=0, le=1, description="share of finished requests logged")
    max_mb: float = Field(1024, gt=0, description="a replica stops logging past this many MB written")
    flush_rows: int = Field(64, gt=0, description="rows per Parquet file")
    flush_s: float = Field(10.0, gt=0, description="a batch is written at least this often")
    queue_rows: int = Field(4096, gt=0, description="rows waiting for the writer; past it they are dropped")


class TrafficLog:
    def __init__(self, cfg: TrafficLogConfig, seed: int | None = None):
        self.cfg, self.tag = cfg, uuid.uuid4().hex[:8]
        self.rng = random.Random(seed)
        self.queue: queue.Queue = queue.Queue(cfg.queue_rows)
        self.counts = {"logged": 0, "files": 0, "bytes": 0, "not_sampled": 0, "dropped_queue_full": 0,
                       "dropped_over_cap": 0, "dropped_write_failed": 0}
        self.lock = threading.Lock()
        self.closed = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="eagleray-traffic-log", daemon=True)
        self.thread.start()

    def record(self, row: dict) -> None:
        """Queue one served row (pipeline/served.py `served_row`). Never blocks, never raises."""
        try:
            if self.rng.random() >= self.cfg.sample_rate:
                self._count("not_sampled")
            elif self.counts["bytes"] >= self.cfg.max_mb * MB:
                self._count("dropped_over_cap")
            else:
                self.queue.put_nowait(row)
        except queue.Full:
            self._count("dropped_queue_full")
        except Exception:  # noqa: BLE001 - the log must never fail a request
            log.exception("traffic log: a row could not be queued")

    def stats(self) -> dict:
        with self.lock:
            return dict(self.counts, waiting=self.queue.qsize())

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what is queued, then stop the writer."""
        self.closed.set()
        self.thread.join(timeout_s)

    def _count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def _loop(self) -> None:
        batch, since = [], time.monotonic()
        while True:
            try:
                batch.append(self.queue.get(timeout=0.2))
            except queue.Empty:
                pass
            done = self.closed.is_set() and self.queue.empty()
            due = time.monotonic() - since >= self.cfg.flush_s
            if batch and (len(batch) >= self.cfg.flush_rows or due or done):
                self._write(batch)
                batch, since = [], time.monotonic()
            elif due:
                since = time.monotonic()
            if done:
                return

    def _write(self, rows: list[dict]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        from pipeline.served import SERVED_SCHEMA

        if self.counts["bytes"] >= self.cfg.max_mb * MB:
            self._count("dropped_over_cap", len(rows))
            return
        try:
            buf = io.BytesIO()
            pq.write_table(pa.Table.from_pylist(rows, SERVED_SCHEMA), buf, compression="zstd")
            name = f"traffic-{self.tag}-{self.counts['files']:06d}.parquet"
            size = storage.write_bytes(storage.join(self.cfg.path, name), buf.getvalue())
        except Exception as e:  # noqa: BLE001 - a storage outage costs log rows, counted, not requests
            log.warning("traffic log: %d rows not written (%s)", len(rows), storage.short_reason(e))
            self._count("dropped_write_failed", len(rows))
            return
        with self.lock:
            self.counts["logged"] += len(rows)
            self.counts["files"] += 1
            self.counts["bytes"] += size
