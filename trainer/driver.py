"""Driver side of training: checks, Ray Train TorchTrainer, progress bar, resume, export.

The run lives in out_dir: ray/ (Ray Train storage with checkpoints), tensorboard/, best/ (the head with
the best simulated tau so far, SGLang format), head_sglang/ and head_speculators/ (exports), report.json.
Rerunning the same config resumes from the latest checkpoint. out_dir may be a URI: Ray Train keeps its
checkpoints there (every rank on any node reports its part), rank 0 pushes best/, progress and history from
its mirror, and this driver exports from its own (pipeline/storage.py Mirror).
"""
from __future__ import annotations

import json
import math
import time

import pyarrow.fs as pafs

from pipeline import storage

from pipeline.cluster import cpu_worker_env
from pipeline.progress import progress_bar
from pipeline.target import TargetSpec
from pipeline.vocab import load_draft_vocab
from trainer.config import TrainConfig
from trainer.batching import min_batches
from trainer.data import check_manifest
from trainer.sources import training_data
from trainer.warm_start import check_init_from
from trainer.export import FORMATS, check_exportable, convert_head

RUN_NAME = "train"


def estimate_total_steps(cfg: TrainConfig, files: list[str], held_out: set[str]) -> int:
    """Optimizer steps for the LR schedule: the bucketing plan replayed on the shards' lengths."""
    if cfg.max_steps:
        return cfg.max_steps
    lengths = []
    for f in files:
        t = storage.read_table(f, columns=["id", "input_ids"])
        lengths += [len(x) for rid, x in zip(t["id"].to_pylist(), t["input_ids"].to_pylist()) if rid not in held_out]
    workers, pool = cfg.scaling.num_workers, cfg.data.bucket_pool
    per_worker = math.ceil(len(lengths) / workers)
    budgets = (cfg.data.max_tokens_per_batch, cfg.data.max_rows_per_batch)
    if workers > 1:  # the ranks' pools planned together (plan_steps)
        pools = [lengths[i:i + pool * workers] for i in range(0, per_worker * workers, pool * workers)]
        batches = sum(math.ceil(min_batches(p, *budgets) / workers) for p in pools)
    else:
        batches = sum(min_batches(lengths[i:min(i + pool, per_worker)], *budgets)
                      for i in range(0, per_worker, pool))
    return max(1, cfg.epochs * batches // cfg.optim.grad_accum)


def ray_storage(out_dir) -> dict:
    """RunConfig's storage_path (and storage_filesystem for a URI): out_dir/ray."""
    loc = storage.join(out_dir, "ray")
    if not storage.is_uri(loc):
        return {"storage_path": str(loc)}
    fs, path = storage.filesystem(loc)
    return {"storage_path": path, "storage_filesystem": fs}


def latest_checkpoint(out_dir) -> tuple[int, str] | None:
    """(step, location) of the newest checkpoint Ray Train persisted for this run, or None."""
    run = storage.join(out_dir, "ray", RUN_NAME)
    fs, path = storage.filesystem(run)
    found = []
    for d in fs.get_file_info(pafs.FileSelector(path, allow_not_found=True)):
        state = storage.join(run, d.base_name, "trainer_state.json")
        if d.base_name.startswith("checkpoint_") and storage.is_file(state):
            found.append((json.loads(storage.read_text(state))["global_step"], storage.redact(d.path)))
    return max(found) if found else None


def train_progress(files: storage.Mirror):
    """The trainer's progress.json (written by rank 0 at each log) -> (step, postfix) for the bar."""
    def poll():
        path = files.pull("progress.json")
        if not path.is_file():
            return None
        try:
            p = json.loads(path.read_text())
        except json.JSONDecodeError:  # caught mid-write on a shared disk: the next poll reads it
            return None
        return p["step"], {"loss0": f"{p['loss'][0]:.3f}", "acc0": f"{p['acc'][0]:.2f}",
                           "tau": f"{p['sim_tau_train']:.2f}", "tok_s": f"{p['tokens_per_s']:.0f}"}
    return poll


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """Workers run elsewhere (another cwd, another node with the same shared paths): absolute paths or URIs."""
    absolute = storage.absolute
    data = {k: absolute(getattr(cfg.data, k)) for k in ("shards", "pipeline") if getattr(cfg.data, k)}
    init = absolute(cfg.model.init_from)
    return cfg.model_copy(update={"out_dir": absolute(cfg.out_dir), "target": absolute(cfg.target),
                                  "data": cfg.data.model_copy(update=data),
                                  "model": cfg.model.model_copy(update={"init_from": init})})


def run_training(cfg: TrainConfig) -> dict:
    import ray

    from pipeline.cluster import check_shared, ensure_ray, ray_data_settings

    cfg = absolute_paths(cfg)
    storage.check("out_dir", cfg.out_dir, writable=True)  # before any work: one line naming the key
    storage.check("target", cfg.target, must_exist=True)
    if cfg.data.source == "parquet":
        storage.check("data.shards", cfg.data.shards, must_exist=True)
    files = storage.Mirror(cfg.out_dir, "driver")
    files.local.mkdir(parents=True, exist_ok=True)
    files.forget("progress.json")
    where = ensure_ray(cfg.ray_address)
    # what the workers read and write: URIs on a cluster that shares no disk
    check_shared({"out_dir": cfg.out_dir, "target": cfg.target, "data.shards": cfg.data.shards,
                  "model.init_from": cfg.model.init_from})
    ray_data_settings()
    data = training_data(cfg)
    spec = TargetSpec.read(cfg.target)
    check_manifest(data.signature, spec)
    if cfg.model.init_from is not None:
        check_init_from(cfg.model.init_from, data.signature, spec)
    check_exportable(data.signature["aux_layer_ids"], spec.num_layers, list(cfg.export_formats),
                     cfg.model.head_options, cfg.model.kind)
    d2t, t2d = load_draft_vocab(data.vocab_dir)
    total = estimate_total_steps(cfg, data.length_files, set(data.val["id"].to_pylist()))
    print(f"trainer: {where}; {data.rows} rows, {data.tokens} tokens ({cfg.data.source}); {total} optimizer "
          f"steps on {cfg.scaling.num_workers} worker(s), ZeRO-{cfg.deepspeed.zero_stage}", flush=True)
    if cfg.model.kind == "dflash":
        print("trainer: model.kind dflash is experimental: it trails an EAGLE-3 head trained on the same data",
              flush=True)
    resume = latest_checkpoint(cfg.out_dir)
    if resume:  # Ray Train V2 restores a run of the same name and storage path from its latest checkpoint
        print(f"trainer: resuming from {resume[1]} (step {resume[0]})", flush=True)
    loop_config = {"cfg": cfg, "val": ray.put(data.val), "total_steps": total, "d2t": d2t, "t2d": t2d,
                   "aux_layer_ids": data.signature["aux_layer_ids"], "storage_dtype": data.signature["dtype"]}
    t0 = time.time()
    with progress_bar("train", total, train_progress(files), unit="step"):
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
        run_config=RunConfig(name=RUN_NAME, **ray_storage(cfg.out_dir),
                             checkpoint_config=CheckpointConfig(num_to_keep=cfg.keep_checkpoints),
                             failure_config=FailureConfig(max_failures=cfg.scaling.max_failures),
                             worker_runtime_env={"env_vars": env} if env else None)).fit()


def finish(cfg: TrainConfig, manifest: dict, spec: TargetSpec, wall: float) -> dict:
    """Export the best head in every configured format and write report.json (pushed to a URI out_dir)."""
    files = storage.Mirror(cfg.out_dir, "driver")
    out_dir = files.local
    for rel in ("best", "history.json"):
        files.pull(rel)
    exports = {}
    for fmt in cfg.export_formats:
        convert_head(out_dir / "best", spec, out_dir / f"head_{fmt}", fmt, manifest["aux_layer_ids"])
        files.push(f"head_{fmt}")
        exports[fmt] = str(storage.join(cfg.out_dir, f"head_{fmt}"))
    history = json.loads((out_dir / "history.json").read_text()) if (out_dir / "history.json").is_file() else []
    train_recs = [h for h in history if "loss" in h]
    evals = [h for h in history if "sim_tau" in h]
    best = json.loads((out_dir / "best" / "metrics.json").read_text())
    epoch_s = [h["train_s"] for h in history if "epoch_end" in h and "train_s" in h]
    report = {"wall_s": round(wall, 1), "steps": train_recs[-1]["step"] if train_recs else 0,
              "epoch_train_s": epoch_s, "train_loop_s": round(sum(epoch_s), 1) if epoch_s else None,
              "first_loss": train_recs[0]["loss"] if train_recs else None,
              "last_loss": train_recs[-1]["loss"] if train_recs else None,
              "last_acc": train_recs[-1]["acc"] if train_recs else None,
              "tokens_per_s": train_recs[-1]["tokens_per_s"] if train_recs else None,
              "best": best, "evals": len(evals), "exports": exports, "formats": list(FORMATS),
              "options": cfg.model.head_options, "kind": cfg.model.kind}
    files.write_text("report.json", json.dumps(report, indent=2))
    return report
