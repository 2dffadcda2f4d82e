"""Training data sources side by side on the demo target: parquet shards vs a live capture stream, and
fp8 vs bf16 shards, the same rows and the same steps in one run.

    python tools/bench_stream.py [--records 400] [--steps 60] [--prompts 20] [--out runs/bench_stream]

Rows: the demo run's regenerated records (runs/demo/data/regenerate/records.jsonl), regeneration off, so
every mode sees the same conversations. Modes: parquet-bf16 (pipeline capture, then training), stream
(training straight from capture actors), parquet-fp8. Each training run: the demo trainer config, 2
workers, `--steps` optimizer steps, tokens/s from the trainer's history (the first log window dropped).
The capture actor and the two trainer workers share the same 2 cores in stream mode (1 + 2 x 0.5 Ray
CPUs). Heads trained on bf16 and fp8 shards are compared by held-out simulated tau and by measured tau
(tree decoding on `--prompts` MT-Bench / GSM8K prompts). Peak memory: the largest sum of RSS over the
driver and every Ray process, sampled each second during a run. Prints one JSON object last.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import psutil
import yaml

REPO = Path(__file__).resolve().parents[1]


class PeakRss:
    """Largest total RSS of this process and every ray:: / raylet process, sampled once a second."""

    def __init__(self):
        self.peak, self._stop = 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            total = psutil.Process().memory_info().rss
            for p in psutil.process_iter(["name", "cmdline", "memory_info"]):
                cmd = " ".join(p.info["cmdline"] or [])
                if p.pid != psutil.Process().pid and ("ray::" in cmd or "raylet" in cmd or "ray::" in (p.info["name"] or "")):
                    total += p.info["memory_info"].rss if p.info["memory_info"] else 0
            self.peak = max(self.peak, total)
            self._stop.wait(1.0)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(timeout=5)


def pipeline_yaml(out: Path, records: int, dtype: str, name: str) -> Path:
    tree = yaml.safe_load((REPO / "configs/pipeline/demo.yaml").read_text())
    tree["run_dir"] = str(out / f"pipeline_{name}")
    tree["target"] = str(REPO / "runs/demo/target")
    tree["ingest"]["sources"] = [{"path": str(REPO / "runs/demo/data/regenerate/records.jsonl"),
                                  "format": "ultrachat", "max_records": records}]
    tree["regenerate"] = {"enabled": False}
    tree["capture"].update({"dtype": dtype, "rows_per_shard": 50})
    path = out / f"pipeline_{name}.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def train(out: Path, name: str, data: dict, steps: int) -> dict:
    from pipeline.yaml_config import load_config
    from trainer.config import TrainConfig
    from trainer.driver import run_training

    tree = yaml.safe_load((REPO / "configs/trainer/demo.yaml").read_text())
    tree.update({"target": str(REPO / "runs/demo/target"), "out_dir": str(out / f"train_{name}"),
                 "max_steps": steps, "epochs": 100, "eval_every": 10 ** 6, "checkpoint_every": 10 ** 6})
    tree["data"] = {**tree["data"], "shards": None, **data}
    path = out / f"train_{name}.yaml"
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    with PeakRss() as mem:
        t0 = time.perf_counter()
        report = run_training(load_config(TrainConfig, path))
        wall = time.perf_counter() - t0
    hist = json.loads((out / f"train_{name}" / "history.json").read_text())
    windows = [h for h in hist if "tokens_per_s" in h][1:]  # the first window holds start-up
    return {"tokens_per_s": round(sum(h["tokens_per_s"] for h in windows) / max(1, len(windows)), 1),
            "wall_s": round(wall, 1), "peak_rss_gb": round(mem.peak / 2 ** 30, 2),
            "sim_tau": report["best"].get("sim_tau"), "head": str(out / f"train_{name}" / "head_speculators")}


def measured_tau(head: str, n: int) -> float:
    import torch

    from infer.benchmarks import chat_ids, default_prompts
    from infer.generate import EagleGenerator, SpecSettings, SpecStats

    torch.set_num_threads(2)
    gen = EagleGenerator.from_folders(REPO / "runs/demo/target", head)
    s = SpecSettings(mode="tree", top_k=4, depth=5, total_tokens=16, max_new_tokens=64)
    stats = [gen.generate(chat_ids(gen.tokenizer, p), s).stats for p in default_prompts(None, n)[:n]]
    return round(SpecStats.pooled_tau(stats), 4)


def hidden_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("shard-*.parquet")) if folder.is_dir() else 0


def main(argv=None) -> dict:
    from pipeline.__main__ import run as run_pipeline
    from pipeline.config import PipelineConfig
    from pipeline.yaml_config import load_config

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--records", type=int, default=400)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--out", type=Path, default=REPO / "runs/bench_stream")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    res: dict = {"records": args.records, "steps": args.steps}
    for dtype in ("bf16", "fp8"):
        summary = run_pipeline(load_config(PipelineConfig, pipeline_yaml(args.out, args.records, dtype, dtype)))
        res[f"capture_{dtype}"] = {k: summary["capture"][k] for k in ("rows", "tokens", "bytes", "wall_s")}
    b16, f8 = res["capture_bf16"], res["capture_fp8"]
    res["fp8_vs_bf16_bytes"] = round(f8["bytes"] / b16["bytes"], 4)
    res["parquet"] = train(args.out, "parquet_bf16", {"shards": str(args.out / "pipeline_bf16/capture")}, args.steps)
    stream_yaml = pipeline_yaml(args.out, args.records, "bf16", "stream")
    res["stream"] = train(args.out, "stream", {"source": "stream", "pipeline": str(stream_yaml)}, args.steps)
    res["stream_hidden_bytes_written"] = hidden_bytes(args.out / "pipeline_stream/capture")
    res["stream_vs_parquet"] = round(res["stream"]["tokens_per_s"] / res["parquet"]["tokens_per_s"], 3)
    res["fp8"] = train(args.out, "parquet_fp8", {"shards": str(args.out / "pipeline_fp8/capture")}, args.steps)
    res["fp8_sim_tau_vs_bf16"] = round(res["fp8"]["sim_tau"] / res["parquet"]["sim_tau"], 4)
    res["bf16_measured_tau"] = measured_tau(res["parquet"]["head"], args.prompts)
    res["fp8_measured_tau"] = measured_tau(res["fp8"]["head"], args.prompts)
    res["fp8_tau_vs_bf16"] = round(res["fp8_measured_tau"] / res["bf16_measured_tau"], 4)
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
