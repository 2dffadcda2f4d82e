"""Training benchmark: tokens/s with 1 vs 2 workers (ZeRO-2, one CPU thread each), step time vs TTT length,
and the share of this machine's fp32 matmul peak the trainer reaches.

    python tools/bench_train.py [--target runs/demo/target] [--shards runs/demo/data/capture] [--steps 12]

All runs share one Ray instance and the same data order; each run's first log window (start-up,
first-touch allocations) is dropped. The peak is a large fp32 GEMM on one thread (a worker's share),
measured in the same run; the trainer's FLOPs per token are counted from the head's shape (forward x 3
for forward + backward, every TTT step, plus the target lm_head for the target distribution). The last
line printed is one JSON object (matmul_peak_gflops, gflops, share_of_peak, tokens_per_s, workers2_vs_1).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from pipeline.cluster import ensure_ray
from trainer.config import TrainConfig
from trainer.driver import run_training


def matmul_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Best of `repeats` n x n x n fp32 GEMMs on one thread."""
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    torch.set_num_threads(threads)
    return 2 * n ** 3 / best / 1e9


def flops_per_token(target: str, draft_vocab: int, ttt_length: int, seq_len: int) -> float:
    """Training FLOPs per token: 3 x the head's forward per TTT step (matmuls of fc, q/k/v/o, MLP, draft
    lm_head, attention over `seq_len`) plus the target lm_head over the full vocabulary (no backward)."""
    from transformers import AutoConfig

    from trainer.head import head_config_from_target

    tcfg = AutoConfig.from_pretrained(target)
    c = head_config_from_target(tcfg, draft_vocab)
    h, hd, nq, nkv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
    per_step = (2 * h * (nq + 2 * nkv) * hd + nq * hd * h + 3 * h * c.intermediate_size + h * draft_vocab
                + 2 * nq * hd * seq_len / 2)  # attention: scores + values over ~T/2 keys on average
    fc = 3 * c.target_hidden_size * h
    return 2 * 3 * (fc + ttt_length * per_step) + 2 * h * c.vocab_size


def measure(base: dict, out: Path, **over) -> dict:
    tree = json.loads(json.dumps(base))
    for key, value in over.items():
        node = tree
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    tree["out_dir"] = str(out)
    run_training(TrainConfig.model_validate(tree))
    recs = [h for h in json.loads((out / "history.json").read_text()) if "tokens_per_s" in h][1:]
    return {"tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in recs), 1),
            "step_s": round(statistics.median(r["step_s"] for r in recs), 4), "windows": len(recs)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="runs/demo/target")
    ap.add_argument("--shards", default="runs/demo/data/capture")
    ap.add_argument("--steps", type=int, default=12)
    args = ap.parse_args(argv)
    ensure_ray()
    base = {"target": args.target, "data": {"shards": args.shards, "max_tokens_per_batch": 2048,
                                            "max_rows_per_batch": 16, "val_rows": 0},
            "model": {"ttt_length": 7}, "optim": {"lr": 1e-3}, "max_steps": args.steps, "epochs": 50,
            "log_every": 2, "eval_every": 10 ** 6, "checkpoint_every": 10 ** 6, "export_formats": [],
            "deepspeed": {"zero_stage": 2, "dtype": "fp32"},
            "scaling": {"num_workers": 1, "cpus_per_worker": 1, "threads_per_worker": 1}}
    peak = matmul_peak_gflops()
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        one = measure(base, d / "w1")
        two = measure(base, d / "w2", **{"scaling.num_workers": 2, "scaling.cpus_per_worker": 0.5})
        by_ttt = {str(t): measure(base, d / f"ttt{t}", **{"model.ttt_length": t}) for t in (1, 4, 7)}
    from pipeline.shards import read_manifest

    man = read_manifest(Path(args.shards))
    vocab = int(man.get("draft_vocab_size") or 0) or _draft_vocab(Path(args.shards))
    seq = man["tokens"] / max(1, man["rows"])
    gflops = {k: round(v["tokens_per_s"] * flops_per_token(args.target, vocab, int(k), seq) / 1e9, 2)
              for k, v in by_ttt.items()}
    result = {"target": args.target, "matmul_peak_gflops": round(peak, 2),
              "gflops_by_ttt": gflops, "share_of_peak": round(gflops["7"] / peak, 3),
              "gflop_per_token_ttt7": round(flops_per_token(args.target, vocab, 7, seq) / 1e9, 3),
              "workers2_vs_1": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
              "tokens_per_s": {"1": one["tokens_per_s"], "2": two["tokens_per_s"]},
              "step_s_by_ttt": {k: v["step_s"] for k, v in by_ttt.items()},
              "step_s_ratio_7_vs_1": round(by_ttt["7"]["step_s"] / by_ttt["1"]["step_s"], 2),
              "steps_per_run": args.steps, "zero_stage": 2, "threads_per_worker": 1}
    print(json.dumps(result))
    return result


def _draft_vocab(shards: Path) -> int:
    from pipeline.vocab import load_draft_vocab

    d2t, _ = load_draft_vocab(shards)
    return len(d2t)


if __name__ == "__main__":
    main()
