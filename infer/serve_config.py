"""The serve stage's config (`python -m infer.serve CONFIG.yaml`): the endpoint, its replicas, the
speculative tree, the traffic log, and the key rules of `with_api_key`."""
import os
from typing import Literal

from pydantic import Field, model_validator

from infer.generate import TreeShape
from infer.traffic_log import TrafficLogConfig
from pipeline.config import VllmEngine
from pipeline.yaml_config import ExistingPath, InputLocation, ModelDtype, StrictModel


class VllmServe(VllmEngine):
    """Options of the `vllm` backend only (Ray Serve LLM running vLLM): the engine options regeneration
    uses (`max_num_seqs` is the continuous batching width) plus the ingress."""
    ingress_num_cpus: float = Field(0, ge=0, description="Ray CPUs of the OpenAI ingress actor")
    # vLLM's dynamic speculative decoding: past this many running sequences continuous batching already
    # fills the machine and verifying drafts costs throughput.
    draft_up_to_batch: int | None = Field(
        None, gt=0, description="draft only while at most this many sequences run; null: always")


class ServeConfig(StrictModel):
    backend: Literal["eagleray", "vllm"] = Field(
        "eagleray", description="eagleray: our tree decoder, batch 1 a replica; vllm: Ray Serve LLM, chains")
    target: InputLocation = Field(description="the target's Hugging Face folder or a URI")
    head: InputLocation | None = Field(None, description="a head folder or URI; null: the target alone")
    model_name: str = Field("eagleray", description="the model name clients send")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, gt=0, lt=65536, description="port to listen on")
    # The vllm backend's ingress (Ray Serve LLM) checks no key: it is refused off loopback.
    api_key: str | None = Field(None, description="Bearer key of every /v1 request (or $EAGLERAY_API_KEY); "
                                                   "required off loopback")
    app_name: str = Field("eagleray", description="the Ray Serve application's name")
    route_prefix: str = Field("/", description="HTTP route prefix of the application")
    num_replicas: int = Field(1, gt=0, description="model replicas")
    max_ongoing_requests: int = Field(
        32, gt=0, description="requests in flight per replica (Serve queues the rest)")
    num_cpus_per_replica: float = Field(1, ge=0, description="Ray CPUs per replica")
    num_gpus_per_replica: float = Field(0, ge=0, description="Ray GPUs per replica")
    resources_per_replica: dict[str, float] = Field(
        {}, description="custom Ray resources, e.g. {eagleray_worker: 1}")
    proxy_location: Literal["EveryNode", "HeadOnly"] = Field(
        "EveryNode", description="Serve's HTTP proxies: on every node (behind a load balancer) or the head's")
    threads_per_replica: int | None = Field(
        None, description="torch threads of a replica; null: its Ray CPUs")
    dtype: ModelDtype = Field(
        "auto", description="eagleray backend: target and head")
    max_tokens_limit: int = Field(512, gt=0, description="the largest max_tokens a request may ask")
    default_max_tokens: int = Field(128, gt=0, description="max_tokens of a request that names none")
    request_timeout_s: float = Field(120, gt=0, description="a request still running after this fails (504)")
    speculative: TreeShape = TreeShape()
    vllm: VllmServe = VllmServe()
    ray_address: str | None = Field(None, description="null: join $RAY_ADDRESS if set, else a local Ray")
    traffic_log: TrafficLogConfig = TrafficLogConfig()
    swap_poll_s: float = Field(2.0, gt=0, description="how often a replica looks for a head promoted elsewhere")

    @property
    def adaptive_top_k(self) -> int | None:
        """The top_k whose round costs adaptive sizing measures when a head loads; None: fixed sizing."""
        spec = self.speculative
        return None if spec.sizing != "adaptive" else 1 if spec.mode == "chain" else spec.top_k

    @model_validator(mode="after")
    def _dtype_of_backend(self):
        if self.backend == "vllm" and self.traffic_log.path is not None:
            raise ValueError("traffic_log: the eagleray backend's; the vllm backend logs no traffic")
        if self.backend == "vllm" and self.dtype != "auto":
            raise ValueError("dtype applies to the eagleray backend; the vllm backend reads vllm.dtype")
        if self.backend == "vllm" and self.speculative.cpu_path != "auto":
            raise ValueError("speculative.cpu_path applies to the eagleray backend")
        if self.backend == "vllm" and "sizing" in self.speculative.model_fields_set \
                and self.speculative.sizing != "fixed":
            raise ValueError("speculative.sizing applies to the eagleray backend; vllm drafts a fixed chain "
                             "of speculative.depth tokens")
        return self


class HeadRequest(StrictModel):
    """POST /v1/admin/head's body (infer/head_swap.py)."""
    head: str = Field(min_length=1, description="a head folder (as the replicas see it) or URI")


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def with_api_key(cfg: ServeConfig) -> ServeConfig:
    """The config with its key resolved (the YAML's, else $EAGLERAY_API_KEY) on the driver, so replicas on
    other nodes get it; refuses an endpoint off loopback that nobody's key guards."""
    key = cfg.api_key or os.environ.get("EAGLERAY_API_KEY") or None
    if not is_loopback(cfg.host):
        if cfg.backend == "vllm":
            raise ValueError(f"host: {cfg.host} is not a loopback address and the vllm backend's ingress checks no "
                             f"API key; serve it on 127.0.0.1 behind your own gateway, or use backend: eagleray")
        if not key:
            raise ValueError(f"api_key: required when host is {cfg.host} (not a loopback address); set api_key "
                             f"or EAGLERAY_API_KEY")
    if key and cfg.backend == "vllm":
        raise ValueError("api_key: the vllm backend's ingress (Ray Serve LLM) checks no API key")
    return cfg.model_copy(update={"api_key": key})
