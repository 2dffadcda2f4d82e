"""Driver side of training: checks, Ray Train TorchTrainer, progress bar, resume, export.

The run lives in out_dir: ray/ (Ray Train storage with checkpoints), tensorboard/, best/ (the head with
the best simulated tau so far, SGLang format), head_sglang/ and head_speculators/ (exports), report.json.
Rerunning the same config resumes from the latest checkpoint.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pyarrow.parquet as pq

from pipeline.cluster import cpu_worker_env
from pipeline.progress import progress_bar
from pipeline.target import TargetSpec
from pipeline.vocab import load_draft_vocab
from trainer.config import TrainConfig
from trainer.data import check_manifest, min_batches
from trainer.sources import training_data
from trainer.export import FORMATS, check_exportable, convert_head

RUN_NAME = "train"


def estimate_total_steps(cfg: TrainConfig, files: list[str], held_out: set[str]) -> int:
    """Optimizer steps for the LR schedule: the bucketing plan replayed on the shards' lengths."""
    if cfg.max_steps:
        return cfg.max_steps
    lengths = []
    for f in files:
        t = pq.read_table(f, columns=["id", "input_ids"])
        lengths += [len(x) for rid, x in zip(t["id"].to_pylist(), t["input_ids"].to_pylist()) if rid not in held_out]
    workers, pool = cfg.scaling.num_workers, cfg.data.bucket_pool
    per_worker = math.ceil(len(lengths) / workers)
    budgets = (cfg.data.max_tokens_per_batch, cfg.data.max_rows_per_batch)
    if workers > 1 and cfg.data.balance == "steps":  # the ranks' pools planned together (plan_steps)
        pools = [lengths[i:i + pool * workers] for i in range(0, per_worker * workers, pool * workers)]
        batches = sum(math.ceil(min_batches(p, *budgets) / workers) for p in pools)
    else:
        batches = sum(min_batches(lengths[i:min(i + pool, per_worker)], *budgets)
                      for i in range(0, per_worker, pool))
    return max(1, cfg.epochs * batches // cfg.optim.grad_accum)


def latest_checkpoint(storage: Path):
    """The newest checkpoint Ray Train persisted for this run, or None."""
    from ray.train import Checkpoint

    run = storage / RUN_NAME
    best, best_step = None, -1
    for d in run.glob("checkpoint_*"):
        state = d / "trainer_state.json"
        if state.is_file():
            step = json.loads(state.read_text())["global_step"]
            if step > best_step:
                best, best_step = d, step
    return Checkpoint.from_directory(str(best)) if best else None


def train_progress(out_dir: Path):
    """The trainer's progress.json (written by rank 0 at each log) -> (step, postfix) for the bar."""
    path = out_dir / "progress.json"

    def poll():
        if not path.is_file():
            return None
        p = json.loads(path.read_text())
        return p["step"], {"loss0": f"{p['loss'][0]:.3f}", "acc0": f"{p['acc'][0]:.2f}",
                           "tau": f"{p['sim_tau_train']:.2f}", "tok_s": f"{p['tokens_per_s']:.0f}"}
    return poll


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """Workers run elsewhere (another cwd, another node with the same shared paths): absolute paths only."""
    data = {k: getattr(cfg.data, k).resolve() for k in ("shards", "pipeline") if getattr(cfg.data, k)}
    init = cfg.model.init_from.resolve() if cfg.model.init_from else None
    return cfg.model_copy(update={"out_dir": cfg.out_dir.resolve(), "target": cfg.target.resolve(),
                                  "data": cfg.data.model_copy(update=data),
                                  "model": cfg.model.model_copy(update={"init_from": init})})


def run_training(cfg: TrainConfig) -> dict:
    import ray

    from pipeline.cluster import ensure_ray, quiet_ray_data

    cfg = absolute_paths(cfg)
    out_dir = cfg.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "progress.json").unlink(missing_ok=True)
    where = ensure_ray(cfg.ray_address)
    quiet_ray_data()
    data = training_data(cfg)
    spec = TargetSpec.read(cfg.target)
    check_manifest(data.signature, spec)
    check_exportable(data.signature["aux_layer_ids"], spec.num_layers, list(cfg.export_formats),
                     cfg.model.head_options)
    d2t, t2d = load_draft_vocab(data.vocab_dir)
    total = estimate_total_steps(cfg, data.length_files, set(data.val["id"].to_pylist()))
    print(f"trainer: {where}; {data.rows} rows, {data.tokens} tokens ({cfg.data.source}); {total} optimizer "
          f"steps on {cfg.scaling.num_workers} worker(s), ZeRO-{cfg.deepspeed.zero_stage}", flush=True)
    resume = latest_checkpoint(out_dir / "ray")
    if resume:  # Ray Train V2 restores a run of the same name and storage path from its latest checkpoint
        print(f"trainer: resuming from {resume.path}", flush=True)
    loop_config = {"cfg": cfg, "val": ray.put(data.val), "total_steps": total, "d2t": d2t, "t2d": t2d,
                   "aux_layer_ids": data.signature["aux_layer_ids"], "storage_dtype": data.signature["dtype"]}
    t0 = time.time()
    with progress_bar("train", total, train_progress(out_dir), unit="step"):
        for phase in data.phases:
            fit(cfg, phase.dataset(), dict(loop_config, stop_epoch=phase.stop_epoch, cache_rows=not phase.live),
                phase.live)
            if phase.after:
                phase.after()
    return finish(cfg, data.signature, spec, time.time() - t0)


def fit(cfg: TrainConfig, dataset, loop_config: dict, live: bool = False) -> None:
    """One Ray Train run over `dataset` (rows in order), resumed from this out_dir's latest checkpoint.
    `live` (a capture stream): `data.stream_buffer_mb` bounds the captured rows held ahead of the trainer."""
    import ray
    from ray.train import CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from trainer.loop import train_loop_per_worker

    limits = None
    if live and cfg.data.stream_buffer_mb:
        limits = ray.data.ExecutionResources(object_store_memory=cfg.data.stream_buffer_mb * 2 ** 20)
    options = ray.data.ExecutionOptions(preserve_order=True, resource_limits=limits)
    env = {} if cfg.scaling.use_gpu else cpu_worker_env(cfg.scaling.keep_freed_memory)
    TorchTrainer(
        train_loop_per_worker, train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=cfg.scaling.num_workers, use_gpu=cfg.scaling.use_gpu,
                                     resources_per_worker={"CPU": cfg.scaling.cpus_per_worker,
                                                           **cfg.scaling.resources_per_worker},
                                     placement_strategy=cfg.scaling.placement_strategy),
        torch_config=TorchConfig(backend="nccl" if cfg.scaling.use_gpu else "gloo"),
        datasets={"train": dataset},
        dataset_config=DataConfig(execution_options=options),
        run_config=RunConfig(name=RUN_NAME, storage_path=str(cfg.out_dir / "ray"),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
                             failure_config=FailureConfig(max_failures=cfg.scaling.max_failures),
                             worker_runtime_env={"env_vars": env} if env else None)).fit()


def finish(cfg: TrainConfig, manifest: dict, spec: TargetSpec, wall: float) -> dict:
    """Export the best head in every configured format and write report.json."""
    out_dir = cfg.out_dir
    exports = {fmt: str(convert_head(out_dir / "best", spec, out_dir / f"head_{fmt}", fmt,
                                     manifest["aux_layer_ids"])[0]) for fmt in cfg.export_formats}
    history = json.loads((out_dir / "history.json").read_text()) if (out_dir / "history.json").is_file() else []
    train_recs = [h for h in history if "loss" in h]
    evals = [h for h in history if "sim_tau" in h]
    best = json.loads((out_dir / "best" / "metrics.json").read_text())
    report = {"wall_s": round(wall, 1), "steps": train_recs[-1]["step"] if train_recs else 0,
              "first_loss": train_recs[0]["loss"] if train_recs else None,
              "last_loss": train_recs[-1]["loss"] if train_recs else None,
              "last_acc": train_recs[-1]["acc"] if train_recs else None,
              "tokens_per_s": train_recs[-1]["tokens_per_s"] if train_recs else None,
              "best": best, "evals": len(evals), "exports": exports, "formats": list(FORMATS),
              "options": cfg.model.head_options}
    (out_dir / "report.json").write_text(json.dumps(report, indent=2))
    return report
