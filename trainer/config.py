"""The trainer's config (python -m trainer CONFIG.yaml key=value ...)."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline.yaml_config import ExistingPath, InputLocation, Location, StrictModel


class Data(StrictModel):
    source: Literal["parquet", "stream", "hybrid"] = "parquet"  # trainer/sources.py; docs/USAGE.md "Trainer"
    shards: InputLocation | None = None       # parquet: a capture folder or URI (shard-*.parquet, manifest, draft_vocab)
    pipeline: ExistingPath | None = None      # stream / hybrid: the pipeline YAML whose stages feed training
    max_tokens_per_batch: int = Field(4096, gt=0)  # padded tokens per micro-batch (length-bucketed)
    max_rows_per_batch: int = Field(16, gt=0)
    bucket_pool: int = Field(256, gt=0)       # rows gathered before bucketing by length
    # The order of a pool's batches (trainer/batching.py segment_order), the same on every rank: "shuffled"
    # draws every step's place at random; "runs" (the old default) keeps 4 cost-sorted runs, so dozens of
    # steps in a row train rows of similar length: on the demo target 5% lower vLLM tau over three seeds
    # (docs/MEASUREMENTS.md "The order of the batches").
    order: Literal["shuffled", "runs"] = "shuffled"
    # 2+ workers: "steps" plans the ranks' pools together so every step's batches match in work (~40% of
    # the rows move between workers); "pools" trades a few rows so each pool's total matches (fewer moves,
    # more waiting at each step's all-reduce). trainer/data.py MicroBatches; ARCHITECTURE.md §10.
    balance: Literal["steps", "pools"] = "steps"
    # "steps" with 2+ workers: "measured" gives a rank that runs faster (its forwards' work per second)
    # more work at each step, for nodes or cores of unequal speed; the speeds are checkpointed, so a
    # resume is exact, but two fresh runs may plan differently. "equal": every run of a seed trains the
    # same batches (on 2 equal cores measured plans gained nothing: docs/MEASUREMENTS.md, "Training
    # throughput").
    rank_speeds: Literal["measured", "equal"] = "equal"
    # The positions a training step supervises with the target's distribution: "assistant" (the answers'
    # loss mask, what decoding drafts) or "all" (every real token, prompts and template too: more signal
    # from the same rows; held-out evaluation always scores the answers).
    loss_on: Literal["assistant", "all"] = "assistant"
    val_rows: int = Field(32, ge=0)           # held out (the last rows of the run) for eval metrics
    stream_buffer_mb: int | None = Field(None, gt=0)  # stream / hybrid: object-store budget of the data in
    #                                                   flight; capture waits for the trainer past it
    cache_mb: int = Field(2048, ge=0)         # per worker: an epoch's rows kept in memory and replayed by
    #                                           later epochs when they fit (shards only; 0: stream every epoch)
    seed: int = 0

    @model_validator(mode="after")
    def _source_has_its_input(self):
        if self.source == "parquet" and self.shards is None:
            raise ValueError("shards: required when source is parquet (a capture folder)")
        if self.source != "parquet" and self.pipeline is None:
            raise ValueError(f"pipeline: required when source is {self.source} (the pipeline YAML)")
        return self


class Optim(StrictModel):
    # "adamw" for every weight, or "muon": DeepSpeed's Muon (momentum, Newton-Schulz orthogonalised updates)
    # for the head's matrices at muon_lr, with AdamW at lr for the norms and the lm_head (speculators'
    # default optimizer; trainer/loop.py _engine).
    name: Literal["adamw", "muon"] = "adamw"
    lr: float = Field(1e-4, gt=0)
    muon_lr: float = Field(0.02, gt=0)
    momentum: float = Field(0.95, ge=0, lt=1)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.015, ge=0, lt=1)
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    schedule: Literal["cosine", "linear"] = "cosine"  # decay after warm-up (speculators' default: linear)
    grad_clip: float = Field(0.5, gt=0)
    grad_accum: int = Field(1, ge=1)


class Model(StrictModel):
    # The draft kind (trainer/head.py build_head): "eagle3", one layer trained with TTT (the fields below up
    # to off_vocab), or "dflash", a block drafter (trainer/dflash.py; ARCHITECTURE.md §12) whose own fields
    # follow the EAGLE ones.
    kind: Literal["eagle3", "dflash"] = "eagle3"
    ttt_length: int = Field(7, ge=1)
    decay: float = Field(0.8, gt=0, le=1)
    intermediate_size: int | None = None      # default: the target's
    init_from: ExistingPath | None = None     # an exported head (SGLang or speculators) to start from
    attention: Literal["auto", "flash", "blocked"] = "auto"  # TTT attention kernel (ARCHITECTURE.md §5):
    #                                           auto = PyTorch's flash kernel (CPU, CUDA) where it runs, else blocked
    compile: bool = False  # torch.compile the step's pieces around the attention (ARCHITECTURE.md §5)
    # EAGLE 3.1 (trainer/head.py HeadConfig; ARCHITECTURE.md §4 "Head options"). A head with any of them
    # exports as speculators only (SGLang's head reads none of them).
    norm_before_fc: bool = False
    fc_norm: bool = False
    norm_before_residual: bool = False
    norm_output: bool = False
    # The draft lm_head's start: "random", or "target": the target's lm_head rows of the draft vocabulary
    # (speculators' recipe, which also freezes them: freeze_lm_head).
    lm_head_init: Literal["random", "target"] = "random"
    freeze_lm_head: bool = False
    # Every Linear weight's start: None keeps PyTorch's (Kaiming-uniform), a number draws N(0, std) with
    # zero biases, as Hugging Face's `initializer_range` (0.02) does for speculators' heads.
    init_std: float | None = Field(None, gt=0)
    # The loss (trainer/ttt.py TTTObjective): each step's sum over every padded position of the batch, or
    # the mean over the positions it counts; positions whose target argmax is outside the draft vocab
    # dropped, or kept with the target's distribution over the draft vocab.
    loss_mean: Literal["padded", "counted"] = "padded"
    off_vocab: Literal["drop", "keep"] = "drop"
    # Gaussian noise on the aux states while training (not in evaluation): std relative to each state's RMS
    # per position (EAGLE's feature noise, for a head that must read states of prompts it never saw).
    aux_noise: float = Field(0.0, ge=0, le=1)
    # Both kinds: what each step or slot learns ("soft": the target's distribution over the draft vocab;
    # "hard": its argmax, speculators' DFlash `ce`), and how steps or slots weigh ("decay": decay ** s for
    # EAGLE-3, exp(-(k - 1) / decay_gamma) for DFlash; "dpace": D-PACE, each chain's steps weighed by how
    # much they move its expected accepted length; trainer/ttt.py dpace_weights). Defaults: soft and decay
    # for eagle3 (neither switch gained on the demo target), hard and dpace for dflash (speculators' DFlash
    # default; SmolLM2 vLLM tau +5%, the demo's held-out prompts +4-10% at two seeds: docs/MEASUREMENTS.md
    # "speculators' DFlash loss").
    labels: Literal["soft", "hard"] | None = None
    position_weight: Literal["decay", "dpace"] | None = None
    dpace_alpha: float = Field(0.5, gt=0, le=1)  # D-PACE's confidence smoothing: (1 - alpha) * p + alpha
    # DFlash: draft layers, block size (anchor + masks: block_size - 1 tokens drafted per forward), the
    # mask slots' token (None: trainer/dflash.py default_mask_token), anchor blocks drawn per row, and
    # the slots' loss decay exp(-(k - 1) / gamma) (None: no decay).
    num_layers: int | None = Field(None, ge=1)  # default: 1 for eagle3, 2 for dflash
    block_size: int = Field(8, ge=2)
    mask_token_id: int | None = Field(None, ge=0)
    anchors: int = Field(32, ge=1)
    decay_gamma: float | None = Field(4.0, gt=0)
    # The layers' start: "random", or "target": DFlash, copies of the target's last num_layers decoder layers
    # (q/k norms at the target's q/k size where it has none); EAGLE-3, its one layer from the target's last,
    # q/k/v's embedding half at zero (trainer/warm_start.py eagle3_layer_state). Llama/Qwen-style layers only.
    layers_init: Literal["random", "target"] = "random"
    # The fc start: "random" (PyTorch's), or "high": [0 | 0 | I], the high aux state passed through, so a layer
    # from the target (layers_init: target) first reads the state nearest its own input (DFlash: as its context
    # keys and values, hidden_norm then the first copied layer's input norm).
    fc_init: Literal["random", "high"] = "random"
    # Causal attention inside the block (slot k sees slots <= k; speculators' DFlash and vLLM's
    # `dflash_config.causal`), against DFlash's original non-causal block.
    block_causal: bool = False

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
        if self.kind == "eagle3" and self.block_causal:
            raise ValueError("block_causal: an EAGLE-3 head drafts no block (kind: dflash)")
        if self.kind == "eagle3" and self.layers != 1:
            raise ValueError(f"num_layers: an EAGLE-3 head has one layer, not {self.layers}")
        if self.kind == "dflash":
            on = [k for k, v in self.head_options.items() if v] + ["compile"] * self.compile + \
                ["aux_noise"] * bool(self.aux_noise)
            if on:
                raise ValueError(f"kind: dflash reads none of {', '.join(on)} (EAGLE-3 options)")
        return self


class Scaling(StrictModel):
    num_workers: int = Field(1, ge=1)
    use_gpu: bool = False
    cpus_per_worker: float = Field(1, gt=0)
    threads_per_worker: int | None = None
    keep_freed_memory: bool = True  # CPU workers keep freed memory for the next step (pipeline/cluster.py)
    # custom Ray resources per worker (e.g. {eagleray_worker: 1}: one worker per node that offers one) and
    # Ray Train's placement of the workers (PACK, SPREAD over nodes, STRICT_SPREAD: one per node)
    resources_per_worker: dict[str, float] = {}
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    # a worker or node lost: restart the worker group from the latest checkpoint this many times
    max_failures: int = Field(0, ge=-1)


class DeepSpeedCfg(StrictModel):
    zero_stage: Literal[0, 1, 2, 3] = 2
    dtype: Literal["fp32", "bf16"] = "fp32"


class TrainConfig(StrictModel):
    target: ExistingPath
    out_dir: Location = Path("runs/train")     # a folder or a URI (checkpoints, best, exports): pipeline/storage.py
    data: Data
    model: Model = Model()
    optim: Optim = Optim()
    scaling: Scaling = Scaling()
    deepspeed: DeepSpeedCfg = DeepSpeedCfg()
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, gt=0)  # optimizer steps; default: epochs over the data
    run_steps: int | None = Field(None, gt=0)  # stop (with a checkpoint) after this many steps in this
    #                                            invocation, e.g. a time-limited allocation; rerun to go on
    checkpoint_every: int = Field(50, gt=0)
    eval_every: int = Field(25, gt=0)
    log_every: int = Field(5, gt=0)
    keep_checkpoints: int = Field(2, ge=1)
    seed: int = 0
    ray_address: str | None = None
    # default: ["sglang", "speculators"] for an EAGLE-3 head, ["dflash"] (vLLM's DFlashDraftModel) for DFlash
    export_formats: list[Literal["sglang", "speculators", "dflash"]] | None = None

    @model_validator(mode="after")
    def _formats_of_kind(self):
        if self.export_formats is None:
            self.export_formats = ["dflash"] if self.model.kind == "dflash" else ["sglang", "speculators"]
        return self
