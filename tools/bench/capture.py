"""Capture benchmark: capture throughput vs a bare target forward, disk vs raw bytes, planner error.

    python -m tools.bench.capture [--target runs/demo/target] [--data runs/demo/data] [--rows 400]

Both throughputs are measured in this process on the same micro-batches, alternating, best of
--repeats. disk_vs_raw and planner_error come from the pipeline run in --data (its manifest and its
saved config). The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

from pipeline.buckets import length_buckets
from pipeline.capture import capture_rows, make_signature
from pipeline.target import load_model
from pipeline.plan import estimate_storage
from pipeline.config import PipelineConfig
from pipeline.shards import read_manifest, write_shard
from pipeline.tokenize import tokens_max_length


def bare_forward(model, rows, batch_tokens: int, pad_id: int) -> float:
    lengths = [len(r["input_ids"]) for r in rows]
    t = 0.0
    for group in length_buckets(lengths, batch_tokens, longest_first=True):
        width = lengths[group[0]]
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        att = torch.zeros_like(ids)
        for j, i in enumerate(group):
            ids[j, : lengths[i]] = torch.tensor(rows[i]["input_ids"])
            att[j, : lengths[i]] = 1
        t0 = time.perf_counter()
        with torch.no_grad():
            model(input_ids=ids, attention_mask=att, use_cache=False)
        t += time.perf_counter() - t0
    return t


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="runs/demo/target")
    ap.add_argument("--data", default="runs/demo/data", help="a pipeline run_dir (tokenize/ and capture/)")
    ap.add_argument("--rows", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    data = Path(args.data)
    cfg = PipelineConfig.model_validate(json.loads((data / "pipeline_config.json").read_text()) | {
        "target": args.target})
    rows = pq.read_table(data / "tokenize/tokens.parquet").slice(0, args.rows).to_pylist()
    tokens = sum(len(r["input_ids"]) for r in rows)
    model, device = load_model(args.target, cfg.capture.model_dtype, False)
    pad = model.config.pad_token_id or 0
    sig = make_signature(Path(args.target), cfg.capture, tokens_max_length(data / "tokenize/tokens.parquet"))
    fwd, cap = [], []
    with tempfile.TemporaryDirectory() as d:
        for rep in range(args.repeats + 1):  # first round warms up
            f = bare_forward(model, rows, cfg.capture.batch_tokens, pad)
            t0 = time.perf_counter()
            table, _ = capture_rows(model, device, rows, sig["aux_layer_ids"], cfg.capture.dtype,
                                    cfg.capture.batch_tokens, pad)
            write_shard(table, Path(d) / f"s{rep}.parquet", sig, cfg.capture.compression_level)
            c = time.perf_counter() - t0
            if rep:
                fwd.append(f)
                cap.append(c)
    man = read_manifest(data / "capture")
    plan = estimate_storage(cfg, data / "tokenize/tokens.parquet")
    result = {
        "rows": len(rows), "tokens": tokens,
        "forward_tokens_per_s": round(tokens / min(fwd), 1), "capture_tokens_per_s": round(tokens / min(cap), 1),
        "capture_vs_forward": round(min(fwd) / min(cap), 3),
        "disk_bytes_per_token": round(man["bytes"] / man["tokens"], 1),
        "raw_bytes_per_token": man["raw_hidden_bytes"] / man["tokens"],
        "disk_vs_raw": round(man["bytes"] / man["raw_hidden_bytes"], 4),
        "planner_estimate_bytes": plan["est_disk_total_bytes"], "actual_bytes": man["bytes"],
        "planner_error": round(abs(plan["est_disk_total_bytes"] - man["bytes"]) / man["bytes"], 4),
        "dtype": cfg.capture.dtype, "hidden_size": man["hidden_size"], "zstd_level": cfg.capture.compression_level,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
