"""Storage planner: bytes per token and total bytes of a capture run, before running it.

Raw size is exact arithmetic ((3H + H) x bytes per value per token, fp8 scales included; ARCHITECTURE.md §3). The on-disk estimate
captures an evenly spread sample of the real sequences in this process, writes it as a shard with the
run's own settings, and scales its measured bytes per token to the whole token count.
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.capture import capture_rows, make_signature
from pipeline.codec import bytes_per_token
from pipeline.target import load_model
from pipeline.shards import write_shard
from pipeline.tokenize import tokens_max_length



def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return ""


def estimate_storage(cfg, tokens_path: Path, sample_rows: int = 32) -> dict:
    table = pq.read_table(tokens_path, columns=["id", "input_ids", "loss_mask", "n_tokens"])
    tokens = int(sum(table.column("n_tokens").to_pylist()))
    sig = make_signature(cfg.target, cfg.capture, tokens_max_length(tokens_path))
    h = sig["hidden_size"]
    per_token_raw = bytes_per_token(cfg.capture.dtype, 3 * h, 3) + bytes_per_token(cfg.capture.dtype, h)
    step = max(1, table.num_rows // sample_rows)
    rows = table.take(list(range(0, table.num_rows, step))[:sample_rows]).to_pylist()
    model, device = load_model(str(cfg.target), cfg.capture.model_dtype, cfg.capture.num_gpus_per_actor > 0)
    sample, _ = capture_rows(model, device, rows, sig["aux_layer_ids"], cfg.capture.dtype,
                             cfg.capture.batch_tokens, model.config.pad_token_id or 0)
    # Scale the sample to full-size shards so the fixed per-file overhead is counted once per shard.
    with tempfile.TemporaryDirectory() as d:
        nbytes = write_shard(sample, Path(d) / "sample.parquet", dict(sig), cfg.capture.compression_level)
    sample_tokens = sum(r["n_tokens"] for r in rows)
    per_token_disk = nbytes / sample_tokens
    est = per_token_disk * tokens
    return {"rows": table.num_rows, "tokens": tokens, "hidden_size": sig["hidden_size"],
            "dtype": cfg.capture.dtype, "raw_bytes_per_token": per_token_raw, "raw_total_bytes": per_token_raw * tokens,
            "est_disk_bytes_per_token": round(per_token_disk, 1), "est_disk_total_bytes": int(est),
            "est_disk_total": human(est), "raw_total": human(per_token_raw * tokens),
            "sample_rows": len(rows), "sample_tokens": sample_tokens}
