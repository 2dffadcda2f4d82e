"""The per-worker training loop: DeepSpeed ZeRO engine over the head, TTT loss, eval, checkpoints.

Runs inside Ray Train workers (`train_loop_per_worker`). State that makes a resume exact lives in the
checkpoint: DeepSpeed's model/optimizer/scheduler state plus trainer_state.json (global step, epoch,
micro-batches consumed in that epoch, best simulated tau).
"""
from __future__ import annotations

import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

from pipeline.storage import Mirror
from trainer.config import TrainConfig
from trainer.cost import step_flops
from trainer.data import Alone, EpochCache, MicroBatches, RankPeers, RowTally, collate
from trainer.export import export_head, head_state
from pipeline.target import TargetSpec, cpu_has_native_bf16
from trainer.dflash_objective import DFlashObjective
from trainer.warm_start import run_head_config, starting_head
from trainer.target_parts import load_target_parts
from trainer.ttt import StepSums, TTTObjective, target_distribution, target_rows

STATE_FILE = "trainer_state.json"


def run_files(cfg: TrainConfig) -> Mirror:
    """Rank 0's files of the run (best/, progress, history, tensorboard, resumes): out_dir itself, or the
    local mirror of a URI out_dir that each write is pushed from (pipeline/storage.py)."""
    files = Mirror(cfg.out_dir, "rank0")
    files.local.mkdir(parents=True, exist_ok=True)
    return files
CKPT_TAG = "ckpt"


def lr_lambda(total: int, warmup_ratio: float, min_ratio: float, shape: str = "cosine"):
    """LR multiplier at each step: linear warm-up, then cosine or linear decay to min_ratio at `total`."""
    warm = max(1, int(math.ceil(total * warmup_ratio)))

    def f(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        prog = min(1.0, (step - warm) / max(1, total - warm))
        decay = 1 - prog if shape == "linear" else 0.5 * (1 + math.cos(math.pi * prog))
        return min_ratio + (1 - min_ratio) * decay
    return f


def skip_shm_build() -> None:
    """DeepSpeed compiles a C++ shared-memory op on first init on CPU (ARCHITECTURE.md §13); gloo suffices."""
    import deepspeed.comm.torch  # noqa: F401

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None


class HeadTrainer:
    """One worker's head, DeepSpeed engine and target parts: forward, evaluate, export the best."""
    def __init__(self, cfg: TrainConfig, total_steps: int, d2t: torch.Tensor, t2d: torch.Tensor,
                 aux_layer_ids: list[int], storage_dtype: str):
        import ray.train

        self.cfg, self.total_steps, self.storage_dtype = cfg, total_steps, storage_dtype
        ctx = ray.train.get_context()
        self.rank, self.world = ctx.get_world_rank(), ctx.get_world_size()
        self.device = torch.device("cuda", ctx.get_local_rank()) if cfg.scaling.use_gpu else torch.device("cpu")
        if cfg.scaling.threads_per_worker:
            torch.set_num_threads(cfg.scaling.threads_per_worker)
        torch.manual_seed(cfg.seed)
        parts = load_target_parts(cfg.target)
        self.spec = TargetSpec.read(cfg.target)
        self.aux_layer_ids = aux_layer_ids
        hcfg = run_head_config(cfg.model, self.spec.config, len(d2t), parts.embedding)
        head = starting_head(cfg.model, hcfg, d2t, t2d, parts.lm_weight, self.spec.num_layers, cfg.target)
        self.hcfg = hcfg
        self.compute_dtype = torch.bfloat16 if cfg.deepspeed.dtype == "bf16" else torch.float32
        if (self.compute_dtype == torch.bfloat16 and not cfg.scaling.use_gpu and self.rank == 0
                and not cpu_has_native_bf16()):
            print("trainer: deepspeed.dtype: bf16 on a CPU without native bf16 (no AVX512-BF16 / AMX): "
                  "oneDNN emulates it, ~100x slower than fp32 here; use deepspeed.dtype: fp32", flush=True)
        self.target = parts.to(self.device, self.compute_dtype, bf16_hidden=storage_dtype == "bf16")
        self.t2d = t2d.to(self.device)
        objective = self._objective(head)
        self.steps = objective.steps  # metric steps: TTT steps, or a DFlash block's drafted slots
        self.flops = step_flops(hcfg, self.steps)
        self.engine = self._engine(objective)
        self.head = self.engine.module.head
        # DeepSpeed's Muon compiles its Newton-Schulz step; on CPU eager is cheaper (ARCHITECTURE.md §13)
        eager = cfg.optim.name == "muon" and not cfg.scaling.use_gpu
        self.update_ctx = (lambda: torch._dynamo.config.patch(disable=True)) if eager else contextlib.nullcontext
        inv = self.head.rotary.inv_freq
        assert inv.dtype == torch.float32, f"head RoPE inv_freq is {inv.dtype} after engine init, must stay fp32"

    def _objective(self, head):
        m = self.cfg.model
        dpace = m.dpace_alpha if m.position_weight == "dpace" else None
        if m.kind == "dflash":
            mask = self.target.embed(torch.tensor([head.config.mask_token_id], device=self.device))[0]
            return DFlashObjective(head, mask, m.anchors, m.decay_gamma, m.off_vocab, self.cfg.seed, m.labels, dpace,
                                  m.loss)
        return TTTObjective(head, m.ttt_length, m.decay, m.attention, m.compile, m.off_vocab, m.labels, dpace,
                             m.loss, m.rejection_boost, m.loss_norm, m.align_topk)

    def _engine(self, objective):
        import deepspeed

        if not self.cfg.scaling.use_gpu:
            skip_shm_build()
        o = self.cfg.optim
        trainable = [p for p in objective.parameters() if p.requires_grad]
        lr_at = lr_lambda(self.total_steps, o.warmup_ratio, o.min_lr_ratio, o.schedule)
        ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": o.grad_accum,
                  "gradient_clipping": o.grad_clip, "steps_per_print": 10 ** 9,
                  "zero_optimization": {"stage": self.cfg.deepspeed.zero_stage},
                  "bf16": {"enabled": self.cfg.deepspeed.dtype == "bf16"}, "zero_allow_untested_optimizer": True}
        if o.name == "muon":
            # DeepSpeed's own Muon (ARCHITECTURE.md §6): Muon for the matrices, AdamW for the rest, both
            # scheduled alike. ZeRO-3 refuses it beside its gradient reduce-scatter, so there gradients are
            # all-reduced. On CPU the AdamW half is torch's: DeepSpeed's FusedAdam is a C++ op built per
            # install (~50 s; §13).
            if self.cfg.deepspeed.zero_stage == 3:
                ds_cfg["zero_optimization"]["reduce_scatter"] = False
            ds_cfg["optimizer"] = {"type": "Muon", "params": {
                "muon_lr": o.muon_lr, "adam_lr": o.lr, "momentum": o.momentum, "betas": list(o.betas),
                "weight_decay": o.weight_decay, "torch_adam": not self.cfg.scaling.use_gpu}}
            opt = None
        else:
            opt = torch.optim.AdamW(trainable, lr=o.lr, betas=o.betas, weight_decay=o.weight_decay)
        # The schedule as a callable: DeepSpeed builds it on the optimizer it ends up holding (its Muon's).
        engine, _, _, _ = deepspeed.initialize(
            model=objective.to(self.device), model_parameters=trainable, optimizer=opt, config=ds_cfg,
            lr_scheduler=lambda built: torch.optim.lr_scheduler.LambdaLR(built, lr_at))
        return engine

    def forward(self, rows: list[dict]) -> tuple[dict, int]:
        b = collate(rows, self.storage_dtype, self.spec.hidden_size)
        ids, mask = b["input_ids"].to(self.device), b["loss_mask"].to(self.device)
        with torch.no_grad():
            emb = self.target.embed(ids)
            need, row = target_rows(mask)  # the target lm_head runs only where a step reads it
            p, am = target_distribution(self.target.logits(b["last"].to(self.device)[need]), self.t2d)
        out = self.engine(b["aux"].to(self.device, self.compute_dtype), emb, p, am, row, mask)
        return out, sum(len(r["input_ids"]) for r in rows)

    def all_sum(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.detach().float().clone()
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def evaluate(self, rows: list[dict]) -> dict:
        mine = rows[self.rank::self.world]
        sums = StepSums(self.steps)
        self.engine.eval()
        with torch.no_grad():
            for i in range(0, len(mine), 8):
                out, _ = self.forward(mine[i:i + 8])
                sums.add(out, weight=len(mine[i:i + 8]))
        self.engine.train()
        m = sums.metrics(self.all_sum(sums.t))
        return {"val_loss": m["loss"], "val_acc": m["acc"], "sim_tau": m["sim_tau"]}

    def gathered_state(self) -> dict:
        import deepspeed

        params = list(self.head.parameters())
        with deepspeed.zero.GatheredParameters(params, enabled=self.cfg.deepspeed.zero_stage == 3):
            return {k: v.detach().float().cpu().clone() if v.is_floating_point() else v.detach().cpu().clone()
                    for k, v in head_state(self.head).items()}

    def save_best(self, metrics: dict) -> None:
        state = self.gathered_state()  # every rank joins the gather under ZeRO-3
        if self.rank != 0:
            return
        files = run_files(self.cfg)
        out = files.local / "best"
        export_head(state, self.hcfg, self.aux_layer_ids, self.spec, out, self.cfg.export_formats[0])
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
        files.push("best")


class MetricWindow:
    """Sums between two log lines, per TTT step: loss, correct, counted; plus micro-batches and tokens."""

    def __init__(self, ttt_length: int):
        self.L = ttt_length
        self.sums = StepSums(ttt_length)
        self.t0, self.steps = time.time(), 0

    def add(self, out: dict, tokens: int) -> None:
        self.sums.add(out, tokens=tokens)

    def record(self, run: HeadTrainer, step: int, epoch: int) -> dict:
        """All ranks' sums -> one log record; the window starts over."""
        m = self.sums.metrics(run.all_sum(self.sums.t))
        secs = max(time.time() - self.t0, 1e-9)
        rec = {"step": step, "epoch": epoch, "loss": m["loss"], "acc": m["acc"],
               "lr": run.engine.get_lr()[0], "grad_norm": float(run.engine.get_global_grad_norm() or 0.0),
               "tokens_per_s": m["tokens"] / secs, "step_s": secs / max(1, self.steps),
               "sim_tau_train": m["sim_tau"]}
        self.sums = StepSums(self.L)
        self.t0, self.steps = time.time(), 0
        return rec


class TrainLoop:
    """One worker's run: state restored from the latest checkpoint, epochs replayed in the same order up to
    where it stopped, then step / log / evaluate / checkpoint (torchtitan's shape, on Ray Train)."""

    def __init__(self, config: dict):
        import ray
        import ray.train
        from torch.utils.tensorboard import SummaryWriter

        self.cfg = cfg = TrainConfig.model_validate(config["cfg"])
        self.total = config["total_steps"]
        self.run = HeadTrainer(cfg, self.total, config["d2t"], config["t2d"], config["aux_layer_ids"],
                               config["storage_dtype"])
        self.val = ray.get(config["val"]).to_pylist()
        self.last_epoch = min(cfg.epochs, config.get("stop_epoch") or cfg.epochs)  # hybrid: the streamed epoch
        self.seen = RowTally()
        self.cache = EpochCache(cfg.data.cache_mb if config.get("cache_rows", True) else 0)
        self.state = {"global_step": 0, "epoch": 0, "batches_in_epoch": 0, "best_tau": -1.0, "history": []}
        ckpt = ray.train.get_checkpoint()
        if ckpt:
            with ckpt.as_directory() as d:
                self.run.engine.load_checkpoint(d, tag=CKPT_TAG)
                self.state = json.loads((Path(d) / STATE_FILE).read_text())
            if self.run.rank == 0:  # a record of every restore (a worker or node lost, a rerun)
                files = run_files(cfg)
                with open(files.pull("resumes.jsonl"), "a") as f:
                    f.write(json.dumps({"step": self.state["global_step"], "time": round(time.time(), 1)}) + "\n")
                files.push("resumes.jsonl")
        self.writer = SummaryWriter(str(run_files(cfg).local / "tensorboard")) if self.run.rank == 0 else None
        self.shard = ray.train.get_dataset_shard("train")
        self.window = MetricWindow(self.run.steps)
        start = self.state["global_step"]
        self.stop_at = min(self.total, start + (cfg.run_steps or self.total))

    def checkpoint(self, metrics: dict) -> None:
        import ray.train
        from ray.train import Checkpoint

        with tempfile.TemporaryDirectory() as d:
            self.run.engine.save_checkpoint(d, tag=CKPT_TAG)
            if self.run.rank == 0:
                (Path(d) / STATE_FILE).write_text(json.dumps(self.state))
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(d))

    def epoch_rows(self):
        """This epoch's numpy batches: replayed from the cache when every rank holds a complete one, else
        the split streamed again (and recorded)."""
        import torch.distributed as dist

        cached = torch.tensor(int(self.cache.complete))
        if self.run.world > 1:
            dist.all_reduce(cached, op=dist.ReduceOp.MIN)
        if cached.item():
            return self.cache.replay()
        return self.cache.record(self.shard.iter_batches(batch_size=64, batch_format="numpy"))

    def micro_batches(self) -> MicroBatches:
        cfg, st = self.cfg, self.state
        stream = MicroBatches(self.epoch_rows(), cfg.data.max_tokens_per_batch, cfg.data.max_rows_per_batch,
                              cfg.data.bucket_pool, cfg.data.seed, st["epoch"],
                              self.run.flops,
                              RankPeers(self.run.rank, self.run.world) if self.run.world > 1 else Alone())
        if st["batches_in_epoch"]:  # replay the epoch's order up to where we stopped
            replayed = 0
            for _ in range(st["batches_in_epoch"]):
                rows = stream.next_batch() or []
                self.seen.add(rows)
                replayed += len(rows)
            if self.run.rank == 0:
                how = "captured again (stream), not trained" if cfg.data.source != "parquet" else "not trained"
                print(f"trainer: resume re-reads {st['batches_in_epoch']} micro-batches ({replayed} rows on rank 0) "
                      f"of epoch {st['epoch']}: {how}", flush=True)
        return stream

    def train_micro_batch(self, rows: list[dict]) -> None:
        run, st = self.run, self.state
        out, ntok = run.forward(rows)
        with run.update_ctx():
            run.engine.backward(out["loss"])
            # Checked after backward, whose gradient all-reduce has just lined the ranks up (a sync between
            # forward and backward made the ranks wait for each other twice a step); step() has not run, so
            # a non-finite loss on any rank leaves the weights of the last step.
            bad = run.all_sum(torch.tensor(float(not torch.isfinite(out["loss"]).item()))).item()
            if bad:
                raise FloatingPointError(
                    f"non-finite loss at step {st['global_step']} (epoch {st['epoch']}); training stopped, "
                    f"the last good checkpoint is the latest one reported before this step")
            run.engine.step()
        st["batches_in_epoch"] += 1
        self.seen.add(rows)
        self.window.add(out, ntok)

    def log(self, step: int) -> None:
        rec = self.window.record(self.run, step, self.state["epoch"])
        self.state["history"].append(rec)
        if self.writer:
            for s in range(self.run.steps):
                self.writer.add_scalar(f"loss/step{s}", rec["loss"][s], step)
                self.writer.add_scalar(f"acc/step{s}", rec["acc"][s], step)
            for k in ("lr", "grad_norm", "tokens_per_s", "sim_tau_train"):
                self.writer.add_scalar(f"train/{k}", rec[k], step)
            run_files(self.cfg).write_text("progress.json", json.dumps(rec | {"total_steps": self.total}))

    def evaluate(self, step: int) -> None:
        ev = self.run.evaluate(self.val) | {"step": step}
        self.state["history"].append(ev)
        if self.writer:
            self.writer.add_scalar("eval/sim_tau", ev["sim_tau"], step)
            for s in range(self.run.steps):
                self.writer.add_scalar(f"eval/acc_step{s}", ev["val_acc"][s], step)
        if ev["sim_tau"] > self.state["best_tau"]:
            self.state["best_tau"] = ev["sim_tau"]
            self.run.save_best(ev)

    def after_step(self) -> bool:
        """Log, evaluate, checkpoint as due after an optimizer step; True when the run is done."""
        cfg, st = self.cfg, self.state
        st["global_step"] += 1
        self.window.steps += 1
        step = st["global_step"]
        if step % cfg.log_every == 0 or step == self.total:
            self.log(step)
        t0 = time.perf_counter()  # evaluations and checkpoints are left out of the epoch's training seconds
        if self.val and (step % cfg.eval_every == 0 or step == self.stop_at):
            self.evaluate(step)
        if step % cfg.checkpoint_every == 0 or step == self.stop_at:
            self.checkpoint({"step": step, "best_tau": st["best_tau"]})
        self.aside_s += time.perf_counter() - t0
        return step >= self.stop_at

    def run_epoch(self) -> bool:
        """One epoch (or its rest after a resume); True when the run is done. Every rank takes the same
        number of steps: the epoch stops when any rank runs dry (MicroBatches)."""
        self.seen = RowTally()
        self.epoch_t0, self.aside_s = time.perf_counter(), 0.0
        stream = self.micro_batches()
        while True:
            rows = stream.next_batch()
            if rows is None:
                self.end_epoch()
                return False
            self.train_micro_batch(rows)
            if self.state["batches_in_epoch"] % self.cfg.optim.grad_accum == 0 and self.after_step():
                # The last step may also end the epoch: record its tally when nothing is left on any rank.
                if stream.next_batch() is None:
                    self.end_epoch()
                return True

    def end_epoch(self) -> None:
        """The epoch's row tally and its training seconds: reading and steps, without its evaluations and
        checkpoints (what a peer's epoch progress bar times; the first epoch also waits for the data pipeline
        to start)."""
        st = self.state
        train_s = round(time.perf_counter() - self.epoch_t0 - self.aside_s, 2)
        st["history"].append({"epoch_end": st["epoch"], **self.seen.total(self.run.world), "train_s": train_s})

    def __call__(self) -> None:
        st = self.state
        if self.val and st["global_step"] == 0 and not st["history"]:  # the baseline every curve starts from
            st["history"].append(self.run.evaluate(self.val) | {"step": 0})
        done = st["global_step"] >= self.stop_at
        while not done and st["epoch"] < self.last_epoch:
            done = self.run_epoch()
            if not done:
                st["epoch"] += 1
                st["batches_in_epoch"] = 0
        if not self.val:  # nothing to choose by: the final head is the best one
            self.run.save_best({"step": st["global_step"], "note": "no validation rows; final weights"})
        elif not any(h.get("step") == st["global_step"] and "sim_tau" in h for h in st["history"]):
            self.evaluate(st["global_step"])  # the epochs ran out before max_steps: judge the final weights
        if st["global_step"] % self.cfg.checkpoint_every and st["global_step"] != self.stop_at:
            self.checkpoint({"step": st["global_step"], "best_tau": st["best_tau"]})
        if self.writer:
            self.writer.close()
            files = run_files(self.cfg)
            files.write_text("history.json", json.dumps(st["history"], indent=1))
            files.push("tensorboard")


def train_loop_per_worker(config: dict) -> None:
    TrainLoop(config)()
