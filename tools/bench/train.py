"""Training benchmark: tokens/s with 1 vs 2 workers (ZeRO-2 unless --zero-stage, one CPU thread each), step
time vs TTT length, the share of this machine's fp32 matmul peak the trainer reaches, and what Ray's own
processes take.

    python -m tools.bench.train [--shape demo=runs/demo/target,runs/demo/data/capture]
                                [--shape smollm2=runs/smollm2/target,runs/smollm2/data/capture] [--steps 12]
                                [--epochs 2] [--compare-blocked]
                                [--zero-stage 0|1|2|3] [--compare-system-malloc]

All runs share one Ray instance and the same data order. The 1- and 2-worker runs train `--epochs` whole
epochs and are measured over the last one: both then process the same rows, so their ratio compares equal
work (the median of a few log windows, also reported, compares whatever batches fell in them). The TTT
sweep runs `--steps` steps and drops its first log window (start-up, first-touch allocations); its TTT 7
entry is the 1-worker run. The peak is a large fp32 GEMM on one thread (a worker's share), measured in the
same run, alone and in two processes at once (what two workers can get from this box at
most). FLOPs per token count what the trainer executes for useful tokens: the head's body on every token
and TTT step, the draft lm_head and loss on the positions a step counts, the target lm_head (forward only)
where a step reads it, x 3 for forward + backward on the head; padding is not counted, so it shows as a
lower share. Ray's own processes (GCS, raylet, dashboard, Ray Train's and Ray Data's actors and tasks, the
driver) are sampled by CPU time every 2 s through the 2-worker run: over all of it (start-up and the first
epoch's reads included) and over its last 40% (the measured epoch). The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

from pipeline.cluster import cpu_worker_env, ensure_ray
from trainer.config import TrainConfig
from trainer.driver import run_training

DEFAULT_SHAPE = "demo=runs/demo/target,runs/demo/data/capture"


def matmul_peak_gflops(n: int = 2048, repeats: int = 5) -> float:
    """Best of `repeats` n x n x n fp32 GEMMs on one thread."""
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


def _peak_worker(queue) -> None:
    queue.put(matmul_peak_gflops(repeats=8))


def concurrent_peak_gflops(processes: int = 2) -> float:
    """Sum of single-thread GEMM peaks measured in `processes` processes at once: the most that as many
    one-thread workers can reach together on this machine (shared cores, caches, memory, turbo)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_peak_worker, args=(queue,)) for _ in range(processes)]
    for p in procs:
        p.start()
    got = [queue.get() for _ in procs]
    for p in procs:
        p.join()
    return sum(got)


def loss_token_shares(shards: Path, ttt_length: int) -> dict:
    """From the shards' loss masks: share of tokens whose target a step reads (loss_mask[j+1]) and the
    mean share that TTT steps count (loss_mask[i+2+s]); what the trainer's vocab-sized work runs on."""
    import numpy as np
    import pyarrow.parquet as pq

    tokens = need = counted = 0
    for f in sorted(shards.glob("*.parquet")):
        for m in pq.read_table(f, columns=["loss_mask"]).column("loss_mask").to_pylist():
            m = np.asarray(m)
            tokens += len(m)
            need += int(m[1:].sum())
            counted += sum(int(m[2 + s:].sum()) for s in range(ttt_length))
    return {"target_rows": need / tokens, "counted": counted / (tokens * ttt_length), "tokens": tokens}


def flops_per_token(target: str, draft_vocab: int, ttt_length: int, seq_len: float, shares: dict) -> float:
    """Executed training FLOPs per useful token (module docstring; the model is trainer/cost.py's)."""
    from transformers import AutoConfig

    from trainer.cost import step_flops
    from trainer.head import head_config_from_target

    c = head_config_from_target(AutoConfig.from_pretrained(target), draft_vocab)
    return step_flops(c, ttt_length).per_useful_token(seq_len, shares["counted"], shares["target_rows"])


class RayCpu:
    """CPU of every process on this machine that is not a training worker (Ray's GCS, raylet, dashboard and
    agents, Ray Train's and Ray Data's actors, the driver: this process), in cores, over a `with` block.
    Sampled every `every` seconds while the block runs: the actors a training run starts are gone when it
    returns, so two snapshots around it would miss them (they read ~0.07 of a core low on 2 cores)."""

    def __init__(self, every: float = 2.0):
        import threading

        import psutil

        self.psutil, self.every = psutil, every
        self.start: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self.series: list[tuple[float, float]] = [(0.0, 0.0)]  # (seconds since start, CPU seconds since)
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def sample(self) -> dict[int, float]:
        """pid -> CPU seconds so far, of the processes counted."""
        out, me = {}, os.getpid()
        for p in self.psutil.process_iter(["name", "cmdline", "cpu_times"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if "TrainWorker" in cmd or p.info["cpu_times"] is None:
                continue
            if "ray" in cmd or "gcs_server" in (p.info["name"] or "") or p.pid == me:
                out[p.pid] = p.info["cpu_times"].user + p.info["cpu_times"].system
        return out

    def _poll(self) -> None:
        while True:
            stop = self.done.wait(self.every)
            self.last.update(self.sample())
            used = sum(c - self.start.get(pid, 0.0) for pid, c in self.last.items())
            self.series.append((time.perf_counter() - self.t0, used))
            if stop:
                return

    def __enter__(self) -> "RayCpu":
        self.start = self.sample()
        self.t0 = time.perf_counter()
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def cores(self, tail: float = 1.0) -> float:
        """Cores used over the last `tail` share of the block (1: all of it, start-up included). Processes
        alive at the start count from their CPU then; those started inside, their whole life (up to the
        last sample that saw them)."""
        end, used = self.series[-1]
        t, before = next((t, u) for t, u in self.series if t >= end * (1 - tail))
        return (used - before) / max(end - t, 1e-9)


def measure(base: dict, out: Path, epoch: int | None = None, **over) -> dict:
    """One training run. Without `epoch`: the median window rate after the first window (start-up). With
    `epoch`: tokens / seconds over that whole epoch, every step logged (the same rows in every worker
    count, so 1 vs 2 workers compare equal work: a window's rate moves with its batches' lengths and loss
    shares, and a few windows of a rank-aligned order hold batches of one size class)."""
    tree = json.loads(json.dumps(base))
    for key, value in over.items():
        node = tree
        *path, last = key.split(".")
        for p in path:
            node = node.setdefault(p, {})
        node[last] = value
    tree["out_dir"] = str(out)
    run_training(TrainConfig.model_validate(tree))
    history = json.loads((out / "history.json").read_text())
    recs = [h for h in history if "tokens_per_s" in h]
    median = round(statistics.median(r["tokens_per_s"] for r in recs[1:]), 1)
    res = {"tokens_per_s": median, "step_s": round(statistics.median(r["step_s"] for r in recs[1:]), 4),
           "windows": len(recs) - 1}
    if epoch is not None:
        ep = [r for r in recs if r["epoch"] == epoch]
        secs = sum(r["step_s"] for r in ep)  # log_every 1: a window is one step
        res = {"tokens_per_s": round(sum(r["tokens_per_s"] * r["step_s"] for r in ep) / secs, 1),
               "median_window_tokens_per_s": median, "step_s": round(secs / len(ep), 4), "steps": len(ep),
               "epoch_s": round(secs, 1)}
    return res


def bench_shape(target: str, shards: str, steps: int, ttts: list[int], work: Path, blocked: bool,
                zero_stage: int = 2, epochs: int = 2, cache_mb: int | None = None,
                system_malloc: bool = False) -> dict:
    from pipeline.shards import read_manifest

    base = {"target": target, "data": {"shards": shards, "max_tokens_per_batch": 2048,
                                       "max_rows_per_batch": 16, "val_rows": 0,
                                       **({} if cache_mb is None else {"cache_mb": cache_mb})},
            "model": {"ttt_length": 7}, "optim": {"lr": 1e-3}, "max_steps": steps, "epochs": 50,
            "log_every": 2, "eval_every": 10 ** 6, "checkpoint_every": 10 ** 6, "export_formats": [],
            "deepspeed": {"zero_stage": zero_stage, "dtype": "fp32"},
            "scaling": {"num_workers": 1, "cpus_per_worker": 1, "threads_per_worker": 1}}
    # 1 vs 2 workers: whole epochs, the last one measured (the first holds start-up and first touches)
    by_epoch = {"max_steps": 10 ** 6, "epochs": epochs, "log_every": 1}
    two_workers = {"scaling.num_workers": 2, "scaling.cpus_per_worker": 0.5}
    one = measure(base, work / "w1", epochs - 1, **by_epoch)
    with RayCpu() as ray_cpu:
        two = measure(base, work / "w2", epochs - 1, **by_epoch, **two_workers)
    ray_share, ray_tail = ray_cpu.cores(), ray_cpu.cores(tail=0.4)
    by_ttt = {str(t): one if t == 7 else measure(base, work / f"ttt{t}", **{"model.ttt_length": t}) for t in ttts}
    extra = {}
    if blocked:  # the materialised TTT attention (trainer/ttt.py) against the default kernel, 1 worker
        ref = measure(base, work / "blocked", **{"model.attention": "blocked"})
        extra = {"tokens_per_s_blocked_1w": ref["tokens_per_s"],
                 "default_vs_blocked_1w": round(one["tokens_per_s"] / ref["tokens_per_s"], 3)}
    if system_malloc:  # the same runs with freed memory handed back to the kernel (glibc's default)
        sys_one = measure(base, work / "w1_system_malloc", epochs - 1, **by_epoch,
                          **{"scaling.keep_freed_memory": False})
        sys_two = measure(base, work / "w2_system_malloc", epochs - 1, **by_epoch, **two_workers,
                          **{"scaling.keep_freed_memory": False})
        extra |= {"tokens_per_s_system_malloc": {"1": sys_one["tokens_per_s"], "2": sys_two["tokens_per_s"]},
                  "keep_vs_system_malloc": {"1": round(one["tokens_per_s"] / sys_one["tokens_per_s"], 3),
                                            "2": round(two["tokens_per_s"] / sys_two["tokens_per_s"], 3)},
                  "workers2_vs_1_system_malloc": round(sys_two["tokens_per_s"] / sys_one["tokens_per_s"], 3)}
    man = read_manifest(Path(shards))
    vocab = int(man.get("draft_vocab_size") or 0) or _draft_vocab(Path(shards))
    seq = man["tokens"] / max(1, man["rows"])
    gflops = {}
    for k, v in by_ttt.items():
        shares = loss_token_shares(Path(shards), int(k))
        gflops[k] = round(v["tokens_per_s"] * flops_per_token(target, vocab, int(k), seq, shares) / 1e9, 2)
    shares7 = loss_token_shares(Path(shards), 7)
    return {"target": target, "gflops_by_ttt": gflops,
            "gflop_per_token_ttt7": round(flops_per_token(target, vocab, 7, seq, shares7) / 1e9, 4),
            "loss_token_share": round(shares7["counted"], 3),
            "tokens_per_s": {"1": one["tokens_per_s"], "2": two["tokens_per_s"]},
            "workers2_vs_1": round(two["tokens_per_s"] / one["tokens_per_s"], 3),
            "workers2_vs_1_median_windows": round(two["median_window_tokens_per_s"]
                                                  / one["median_window_tokens_per_s"], 3),
            "epoch_s": {"1": one["epoch_s"], "2": two["epoch_s"]},
            "ray_processes_cpu_during_2_workers": round(ray_share, 3),
            "ray_processes_cpu_2_workers_last_40pct": round(ray_tail, 3),  # the measured epoch's share
            "step_s_by_ttt": {k: v["step_s"] for k, v in by_ttt.items()}, **extra}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", help=f"NAME=TARGET,SHARDS (repeatable; default {DEFAULT_SHAPE})")
    ap.add_argument("--steps", type=int, default=12, help="steps of each TTT-sweep run")
    ap.add_argument("--epochs", type=int, default=2,
                    help="epochs of the 1- and 2-worker runs; the last is measured (same rows in both)")
    ap.add_argument("--ttt", default="1,4,7", help="TTT lengths for the step-time sweep (7 is the main run)")
    ap.add_argument("--compare-blocked", action="store_true",
                    help="also run 1 worker on the blocked TTT attention (model.attention=blocked)")
    ap.add_argument("--zero-stage", type=int, default=2, choices=[0, 1, 2, 3], help="DeepSpeed ZeRO stage")
    ap.add_argument("--compare-system-malloc", action="store_true",
                    help="also run 1 and 2 workers with scaling.keep_freed_memory=false (glibc's default)")
    ap.add_argument("--cache-mb", type=int, default=None,
                    help="data.cache_mb of every run (default: the trainer's; 0 streams every epoch again)")
    args = ap.parse_args(argv)
    shapes = {}
    for spec in args.shape or [DEFAULT_SHAPE]:
        name, _, paths = spec.partition("=")
        target, _, shards = paths.partition(",")
        if not (name and target and shards):
            raise SystemExit(f"--shape {spec!r}: expected NAME=TARGET,SHARDS")
        shapes[name] = (target, shards)
    ttts = sorted({int(t) for t in args.ttt.split(",")} | {7})
    peak = matmul_peak_gflops()
    peak2 = concurrent_peak_gflops(2)
    ensure_ray()
    with tempfile.TemporaryDirectory() as d:
        per = {name: bench_shape(t, s, args.steps, ttts, Path(d) / name, args.compare_blocked,
                                 args.zero_stage, args.epochs, args.cache_mb,
                                 args.compare_system_malloc)
               for name, (t, s) in shapes.items()}
    for r in per.values():
        r["share_of_peak"] = round(r["gflops_by_ttt"]["7"] / peak, 3)
    result = {"matmul_peak_gflops": round(peak, 2), "matmul_peak_2proc_gflops": round(peak2, 2),
              "hardware_2proc_vs_1": round(peak2 / peak, 3),
              "share_of_peak": {k: v["share_of_peak"] for k, v in per.items()},
              "tokens_per_s": {k: v["tokens_per_s"] for k, v in per.items()},
              "workers2_vs_1": {k: v["workers2_vs_1"] for k, v in per.items()},
              "shapes": per, "steps_per_sweep_run": args.steps, "epochs_1_vs_2": args.epochs, "zero_stage": args.zero_stage,
              "cache_mb": args.cache_mb, "worker_env": cpu_worker_env(True),
              "threads_per_worker": 1}
    print(json.dumps(result))
    return result


def _draft_vocab(shards: Path) -> int:
    from pipeline.vocab import load_draft_vocab

    d2t, _ = load_draft_vocab(shards)
    return len(d2t)


if __name__ == "__main__":
    main()
