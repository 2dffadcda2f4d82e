"""The `vllm` serve backend: the target with our exported head as its EAGLE-3 speculator, deployed through
Ray Serve LLM (`LLMConfig` + `build_openai_app`), which runs vLLM with continuous batching behind its own
OpenAI-compatible ingress. Same YAML as the `eagleray` backend where the meaning is the same (target, head,
model_name, host, port, num_replicas, max_ongoing_requests, CPUs/GPUs per replica, speculative depth).

On a CPU-only cluster Ray Serve LLM's default placement asks for a GPU and waits forever; a CPU bundle makes
it pick vLLM's CPU platform. Its ingress deployment also wants a CPU, which a 2-core box does not have
beside the engine: `vllm.ingress_num_cpus` (default 0) sets it.

The target and the head may be URIs: each replica copies their files into its own node's cache before its
engine starts (`NodeCopies`, a Ray Serve LLM callback run in the replica), since a vLLM engine reads local
folders and a replica may run on any node.
"""
from __future__ import annotations

import json


def speculative_config(head, depth: int, up_to_batch: int | None = None,
                       max_num_seqs: int = 1) -> dict | None:
    """vLLM's EAGLE-3 settings for an exported head: a chain of `depth` draft tokens (vLLM drafts chains;
    `method` must be given, vLLM only guesses it from a path containing 'eagle3'). `up_to_batch`: vLLM's
    batch-size schedule drafts `depth` tokens up to that many running sequences and none above
    (`num_speculative_tokens_per_batch_size`, inclusive ranges from 1)."""
    from pipeline import storage

    if head is None:
        return None
    head = storage.absolute(head)
    if not storage.is_file(storage.join(head, "config.json")):
        raise ValueError(f"head: {storage.redact(head)} has no config.json (an exported head folder: head_sglang/ "
                         f"or head_speculators/)")
    json.loads(storage.read_text(storage.join(head, "config.json")))  # unreadable: fail here, not in the engine
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": int(depth)}
    if up_to_batch is not None and up_to_batch < max_num_seqs:
        spec["num_speculative_tokens_per_batch_size"] = [[1, up_to_batch, int(depth)],
                                                         [up_to_batch + 1, max_num_seqs, 0]]
    return spec


def llm_config(cfg) -> "object":
    """ServeConfig -> ray.serve.llm.LLMConfig."""
    from ray.serve.llm import LLMConfig

    v = cfg.vllm
    engine = {"dtype": v.engine_dtype(cfg.num_gpus_per_replica > 0), "enforce_eager": v.enforce_eager,
              "max_num_seqs": v.max_num_seqs, "seed": 0,
              "speculative_config": speculative_config(cfg.head, cfg.speculative.depth, v.draft_up_to_batch,
                                                       v.max_num_seqs)}
    if v.max_model_len:
        engine["max_model_len"] = v.max_model_len
    # the replica's custom resources too: `{eagleray_worker: 1}` puts one replica on each such node
    bundle = {"CPU": max(1.0, cfg.num_cpus_per_replica), **cfg.resources_per_replica}
    if cfg.num_gpus_per_replica > 0:
        bundle["GPU"] = cfg.num_gpus_per_replica
    else:
        engine["gpu_memory_utilization"] = v.gpu_memory_utilization
    env = v.cpu_env() if cfg.num_gpus_per_replica == 0 else {}
    return LLMConfig(model_loading_config={"model_id": cfg.model_name, "model_source": str(cfg.target)},
                     callback_config={"callback_class": NodeCopies},
                     engine_kwargs=engine, placement_group_config={"bundles": [bundle]},
                     deployment_config={"num_replicas": cfg.num_replicas,
                                        "max_ongoing_requests": cfg.max_ongoing_requests},
                     runtime_env={"env_vars": env} if env else None)


def _node_copies(llm_config) -> None:
    from pipeline import storage

    loading = llm_config.model_loading_config
    loading.model_source = str(storage.node_copy(loading.model_source))
    spec = llm_config.engine_kwargs.get("speculative_config")
    if spec:
        spec["model"] = str(storage.node_copy(spec["model"]))
    llm_config._engine_config = None  # built from the driver's locations: build it again from the copies


def _callback_base():
    from ray.llm._internal.common.callbacks.base import CallbackBase

    return CallbackBase


class NodeCopies(_callback_base()):
    """Before the replica's engine starts, on the replica's node: the target and the head copied there from
    their URIs (`storage.node_copy`; a local path stays as it is) and the engine pointed at the copies."""

    async def on_before_node_init(self) -> None:
        import asyncio

        await asyncio.to_thread(_node_copies, self.llm_config)


def build_vllm_application(cfg):
    from ray.serve.llm import build_openai_app

    return build_openai_app({"llm_configs": [llm_config(cfg)],
                             "ingress_deployment_config": {"ray_actor_options": {"num_cpus": cfg.vllm.ingress_num_cpus}}})


def engine_spec_counters(model_name: str | None = None) -> dict:
    """vLLM's speculative counters as Ray Serve LLM exports them on every node's Prometheus port (it logs
    engine metrics through Ray): drafts, draft tokens, accepted tokens, summed over replicas (of one model
    when model_name is given) -> also tau = 1 + accepted / drafts. Zeros before the first report (~5 s)."""
    import re
    import urllib.request

    import ray

    names = {"spec_decode_num_drafts": "drafts", "spec_decode_num_draft_tokens": "draft_tokens",
             "spec_decode_num_accepted_tokens": "accepted"}
    out = {v: 0.0 for v in names.values()}
    for node in ray.nodes():
        port = node.get("MetricsExportPort")
        if not node.get("Alive") or not port:
            continue
        with urllib.request.urlopen(f"http://{node['NodeManagerAddress']}:{port}/metrics", timeout=10) as r:
            text = r.read().decode()
        for line in text.splitlines():
            m = re.match(r"^\w*vllm[:_](spec_decode_num_[a-z_]+?)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$", line)
            if m and m.group(1) in names and (model_name is None or f'"{model_name}"' in (m.group(2) or "")):
                out[names[m.group(1)]] += float(m.group(3))
    out["tau"] = round(1 + out["accepted"] / out["drafts"], 4) if out["drafts"] else None
    return out
