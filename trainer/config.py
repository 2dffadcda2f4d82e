"""The trainer's config (python -m trainer CONFIG.yaml key=value ...)."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline.yaml_config import ExistingPath, InputLocation, Location, ModelDtype, StrictModel, TrainDtype


class Replay(StrictModel):
    """Earlier shards mixed into a run (a flywheel round's warm start), so the head keeps what it knew."""
    shards: InputLocation | None = Field(None, description="an earlier capture folder (same target and layers)")
    share: float = Field(0.5, ge=0, lt=1, description="the replayed rows' share of the training rows, in "
                                                       "whole shards spread over that capture")


class Data(StrictModel):
    source: Literal["parquet", "stream", "hybrid"] = Field(
        "parquet", description="parquet: read shards; stream: capture into training; hybrid: both, in turn")
    shards: InputLocation | None = Field(
        None, description="parquet: the capture folder or URI (shards, manifest, draft vocab)")
    pipeline: ExistingPath | None = Field(
        None, description="stream / hybrid: the pipeline YAML that feeds training")
    max_tokens_per_batch: int = Field(4096, gt=0, description="padded tokens per micro-batch")
    max_rows_per_batch: int = Field(16, gt=0, description="rows per micro-batch")
    bucket_pool: int = Field(
        256, gt=0, description="rows grouped by length into batches; = max_rows_per_batch: rows at random")
    val_rows: int = Field(32, ge=0, description="the run's last rows, held out for evaluation")
    stream_buffer_mb: int | None = Field(
        None, gt=0, description="stream / hybrid: object-store budget of the rows in flight")
    cache_mb: int = Field(
        2048, ge=0, description="per worker: memory that replays an epoch's rows (parquet; 0: reread them)")
    seed: int = Field(0, description="the batches' order")
    replay: Replay = Replay()

    @model_validator(mode="after")
    def _source_has_its_input(self):
        if self.replay.shards is not None and self.source != "parquet":
            raise ValueError("replay.shards: needs source: parquet")
        if self.source == "parquet" and self.shards is None:
            raise ValueError("shards: required when source is parquet (a capture folder)")
        if self.source != "parquet" and self.pipeline is None:
            raise ValueError(f"pipeline: required when source is {self.source} (the pipeline YAML)")
        return self


class Optim(StrictModel):
    name: Literal["adamw", "muon"] = Field(
        "adamw", description="muon: DeepSpeed's Muon for the matrices, AdamW for the rest")
    lr: float = Field(1e-4, gt=0, description="AdamW's peak learning rate")
    muon_lr: float = Field(0.02, gt=0, description="muon: the matrices' peak learning rate")
    momentum: float = Field(0.95, ge=0, lt=1, description="muon: its momentum")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW's betas")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay")
    warmup_ratio: float = Field(0.015, ge=0, lt=1, description="share of the steps warming up linearly")
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="the learning rate at the end, relative to the peak")
    schedule: Literal["cosine", "linear"] = Field("cosine", description="decay after warm-up")
    grad_clip: float = Field(0.5, gt=0, description="gradient norm clip")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")


class Model(StrictModel):
    kind: Literal["eagle3", "dflash"] = Field(
        "eagle3", description="eagle3: one layer trained with TTT; dflash: experimental, trails eagle3 at "
                              "equal data")
    ttt_length: int = Field(7, ge=1, description="eagle3: training-time-test steps")
    decay: float = Field(0.8, gt=0, le=1, description="eagle3: step s's loss weighs decay ** s")
    intermediate_size: int | None = Field(None, description="the head's MLP width; null: the target's")
    init_from: InputLocation | None = Field(
        None, description="an exported head to start from, folder or URI (same kind, EAGLE 3.1 options)")
    attention: Literal["auto", "flash", "blocked"] = Field(
        "auto", description="eagle3: TTT attention kernel; auto: PyTorch's flash where it runs, else blocked")
    compile: bool = Field(False, description="eagle3: torch.compile the step around the attention")
    # EAGLE 3.1 options (trainer/head.py HeadConfig): a head with any exports as speculators only.
    norm_before_fc: bool = Field(False, description="eagle3: one RMSNorm over the concatenated aux states")
    fc_norm: bool = Field(False, description="eagle3: an RMSNorm per aux state (instead of norm_before_fc)")
    norm_before_residual: bool = Field(False, description="eagle3: the residual is the normed hidden state")
    norm_output: bool = Field(False, description="eagle3: the next step reads the final-normed state")
    lm_head_init: Literal["random", "target"] = Field(
        "random", description="target: the draft lm_head starts from the target's rows of the draft vocab")
    freeze_lm_head: bool = Field(
        False, description="keep the draft lm_head fixed (with lm_head_init: target)")
    off_vocab: Literal["drop", "keep"] = Field(
        "drop", description="positions whose target argmax is outside the draft vocab: dropped or kept")
    labels: Literal["soft", "hard"] | None = Field(
        None, description="learn the target's distribution or argmax; null: soft (eagle3), hard (dflash)")
    position_weight: Literal["decay", "dpace"] | None = Field(
        None, description="step or slot weights, fixed decay or D-PACE; null: decay (eagle3), dpace (dflash)")
    loss: Literal["kl", "lk_hybrid", "lk_alpha"] = Field(
        "kl", description="kl; lk_hybrid / lk_alpha: the LK losses, which target acceptance (soft labels, decay)")
    init_std: float | None = Field(
        None, gt=0, description="a fresh head's linear weights drawn from N(0, init_std^2); null: PyTorch's default")
    loss_norm: Literal["positions", "tokens"] = Field(
        "positions", description="eagle3: a step's loss sum over every position of the batch, or over the rows "
                                 "it counts")
    rejection_boost: float = Field(
        0.0, ge=0, description="eagle3: rows where the head's chain decode of the row would be rejected weigh "
                               "1 + this (0: off)")
    align_topk: int = Field(
        0, ge=0, description="eagle3: step s counts a position only where steps < s had the target token "
                             "in their top k (0: off)")
    dpace_alpha: float = Field(
        0.5, gt=0, le=1, description="D-PACE's confidence smoothing: (1 - alpha) p + alpha")
    num_layers: int | None = Field(
        None, ge=1, description="draft layers; null: 1 for eagle3, 2 for dflash")
    block_size: int = Field(
        8, ge=2, description="dflash: anchor + masks, block_size - 1 tokens drafted a forward")
    mask_token_id: int | None = Field(
        None, ge=0, description="dflash: the mask slots' token id; null: trainer/dflash.py's choice")
    anchors: int = Field(32, ge=1, description="dflash: blocks drawn per row and step")
    decay_gamma: float | None = Field(
        4.0, gt=0, description="dflash, position_weight decay: slot k weighs exp(-(k - 1) / gamma)")
    layers_init: Literal["random", "target"] = Field(
        "random", description="target: the layers start as the target's last layers (Llama/Qwen-style)")
    fc_init: Literal["random", "high"] = Field(
        "random", description="high: the fc starts passing the high aux state through ([0 | 0 | I])")
    block_causal: bool = Field(False, description="dflash: slot k attends to block slots <= k only")

    @property
    def layers(self) -> int:
        return self.num_layers or (2 if self.kind == "dflash" else 1)

    @property
    def head_options(self) -> dict[str, bool]:
        from trainer.head import HEAD_OPTIONS
        return {k: getattr(self, k) for k in HEAD_OPTIONS}

    @model_validator(mode="after")
    def _loss_of_kind(self):
        dflash = self.kind == "dflash"
        self.labels = self.labels or ("hard" if dflash else "soft")
        self.position_weight = self.position_weight or ("dpace" if dflash else "decay")
        return self

    @model_validator(mode="after")
    def _one_aux_norm(self):
        if self.norm_before_fc and self.fc_norm:
            raise ValueError("norm_before_fc and fc_norm: one or the other (both norm the aux states)")
        if self.freeze_lm_head and self.lm_head_init == "random" and self.init_from is None:
            raise ValueError("freeze_lm_head: a random lm_head would stay random (set lm_head_init: target)")
        if self.loss != "kl" and (self.labels != "soft" or self.position_weight != "decay"):
            raise ValueError(f"loss: {self.loss} needs labels: soft and position_weight: decay")
        if self.loss_norm == "tokens" and (self.kind != "eagle3" or self.position_weight != "decay"):
            raise ValueError("loss_norm: tokens is for an eagle3 head with position_weight: decay")
        if self.align_topk and self.kind != "eagle3":
            raise ValueError("align_topk: an eagle3 head (TTT steps)")
        if self.rejection_boost and (self.kind != "eagle3" or self.position_weight != "decay"):
            raise ValueError("rejection_boost: an eagle3 head with position_weight: decay")
        if self.kind == "eagle3" and self.block_causal:
            raise ValueError("block_causal: an EAGLE-3 head drafts no block (kind: dflash)")
        if self.kind == "eagle3" and self.layers != 1:
            raise ValueError(f"num_layers: an EAGLE-3 head has one layer, not {self.layers}")
        if self.kind == "dflash":
            on = [k for k, v in self.head_options.items() if v] + ["compile"] * self.compile
            if on:
                raise ValueError(f"kind: dflash reads none of {', '.join(on)} (EAGLE-3 options)")
        return self


class Scaling(StrictModel):
    num_workers: int = Field(1, ge=1, description="Ray Train workers (data-parallel ranks)")
    use_gpu: bool = Field(False, description="one GPU per worker")
    cpus_per_worker: float = Field(1, gt=0, description="Ray CPUs per worker")
    threads_per_worker: int | None = Field(None, description="torch threads of a worker; null: its Ray CPUs")
    keep_freed_memory: bool = Field(True, description="CPU workers keep freed memory for the next step")
    resources_per_worker: dict[str, float] = Field(
        {}, description="custom Ray resources, e.g. {eagleray_worker: 1}: one worker per node offering one")
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK", description="Ray Train's placement of the workers (STRICT_SPREAD: one per node)")
    max_failures: int = Field(
        0, ge=-1, description="restarts from the latest checkpoint after a lost worker or node (-1: always)")


class DeepSpeedCfg(StrictModel):
    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="DeepSpeed ZeRO stage")
    dtype: TrainDtype = Field("fp32", description="compute dtype; bf16 on a CPU without native bf16 is slow")


class OnPolicy(StrictModel):
    """On-policy rounds after the offline run (`eagleray train`, infer/onpolicy.py): the head decodes fresh
    training prompts with our engine, the target's answers and the head's acceptance become shards, and a warm
    start trains on them beside the offline shards (docs/ARCHITECTURE.md §6, "On-policy rounds")."""
    rounds: int = Field(0, ge=0, description="rounds after the offline run (0: off)")
    pipeline: ExistingPath | None = Field(
        None, description="pipeline YAML: its ingest sources give the prompts, tokenize/capture/vocab the shards")
    start_head: InputLocation | None = Field(
        None, description="an exported head the rounds start from, in place of an offline run of this config")
    records_per_round: int = Field(256, gt=0, description="fresh prompts decoded per round")
    mode: Literal["tree", "chain"] = Field("tree", description="the rounds' decode: a tree or a chain")
    top_k: int = Field(4, gt=0, description="tree: children kept per node")
    depth: int = Field(4, gt=0, description="draft levels per round")
    total_tokens: int = Field(16, gt=1, description="tree: nodes verified per round, the root included")
    max_new_tokens: int | None = Field(None, gt=0, description="null: the pipeline's regenerate.max_new_tokens")
    dtype: ModelDtype = Field("auto", description="target and head of the decode")
    num_actors: int = Field(1, gt=0, description="Ray Data actors decoding, each with the target and the head")
    cpus_per_actor: float = Field(1, gt=0, description="Ray CPUs per actor")
    threads_per_actor: int | None = Field(None, description="torch threads of an actor; null: its Ray CPUs")
    resources_per_actor: dict[str, float] = Field({}, description="custom Ray resources per actor")
    replay_share: float = Field(0.5, ge=0, lt=1, description="the offline shards' share of a round's rows")
    epochs: int | None = Field(None, gt=0, description="a round's epochs; null: epochs")
    lr: float | None = Field(None, gt=0, description="a round's peak learning rate; null: optim.lr")

    @model_validator(mode="after")
    def _has_prompts(self):
        if self.rounds and self.pipeline is None:
            raise ValueError("pipeline: required when rounds > 0 (the prompts and the rounds' capture)")
        return self


class TrainConfig(StrictModel):
    target: InputLocation = Field(
        description="the target's Hugging Face folder or a URI (the one the shards came from)")
    out_dir: Location = Field(Path("runs/train"), description="a folder or a URI: checkpoints, best, exports")
    data: Data
    model: Model = Model()
    optim: Optim = Optim()
    scaling: Scaling = Scaling()
    deepspeed: DeepSpeedCfg = DeepSpeedCfg()
    epochs: int = Field(1, ge=1, description="passes over the training rows")
    max_steps: int | None = Field(None, gt=0, description="optimizer steps; null: epochs over the data")
    run_steps: int | None = Field(
        None, gt=0, description="stop with a checkpoint after this many steps in this run (rerun to go on)")
    checkpoint_every: int = Field(50, gt=0, description="optimizer steps between checkpoints")
    eval_every: int = Field(25, gt=0, description="optimizer steps between held-out evaluations")
    log_every: int = Field(5, gt=0, description="optimizer steps between log records")
    keep_checkpoints: int = Field(2, ge=1, description="checkpoints kept")
    seed: int = Field(0, description="the head's initialisation (and DFlash's held-out anchors)")
    ray_address: str | None = Field(None, description="null: join $RAY_ADDRESS if set, else a local Ray")
    export_formats: list[Literal["sglang", "speculators", "dflash"]] | None = Field(
        None, description="null: [sglang, speculators] for eagle3, [dflash] (vLLM's DFlash) for dflash")
    onpolicy: OnPolicy = OnPolicy()

    @model_validator(mode="after")
    def _formats_of_kind(self):
        if self.export_formats is None:
            self.export_formats = ["dflash"] if self.model.kind == "dflash" else ["sglang", "speculators"]
        return self
