"""Training benchmark: tokens/s with 1 vs 2 workers (ZeRO-2, one CPU thread each), step time vs TTT length.

    python tools/bench_train.py [--target runs/demo/target] [--shards runs/demo/data/capture] [--steps 12]

All runs share one Ray instance and the same data order; each run's first log window (start-up,
first-touch allocations) is dropped. The last line printed is one JSON object.
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
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        one = measure(base, d / "w1")
        two = measure(base, d / "w2", **{"scaling.num_workers": 2, "scaling.cpus_per_worker": 0.5})
        by_ttt = {str(t): measure(base, d / f"ttt{t}", **{"model.ttt_length": t}) for t in (1, 4, 7)}
    result = {"workers2_vs_1": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
              "tokens_per_s": {"1": one["tokens_per_s"], "2": two["tokens_per_s"]},
              "step_s_by_ttt": {k: v["step_s"] for k, v in by_ttt.items()},
              "step_s_ratio_7_vs_1": round(by_ttt["7"]["step_s"] / by_ttt["1"]["step_s"], 2),
              "steps_per_run": args.steps, "zero_stage": 2, "threads_per_worker": 1}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
