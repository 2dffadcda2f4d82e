"""A process of its own for vLLM (its engine owns the process's threads): greedy EAGLE-3 chain decoding of
token-id prompts, one engine per run, every run in this one process. Driven by infer/checks/vllm_interop.py.

    .venv/bin/python -m infer.checks.vllm_runner REQUEST.json RESULT.json

REQUEST: {"target", "k", "max_new_tokens", "prompts": [[ids]], "dtype", "max_model_len", "runs": [{"name",
"head" (null: no speculation)}]}: every run decodes the same prompts with its own head. RESULT: {name:
{"tokens": [[ids]], "drafts", "draft_tokens", "accepted", "accepted_per_pos", "load_s", "generate_s",
"vllm_version"}}. Each run's log starts with the line `MARKER NAME`, so a reader can tell which engine logged
what. The engine runs in this process (no engine-core or worker processes): a process and its vLLM import per
run were ~30 of the ~40 s each run took. A DFlash head (method dflash) runs with infer/checks/vllm_dflash_patch.py
applied. Only vLLM, that patch and the standard library are imported here.
"""
import gc
import json
import os
import sys
import time

MARKER = "vllm_runner: run"


def spec_counters(metrics) -> dict:
    """vLLM's Prometheus-style snapshot -> our counters (summed over engines)."""
    out = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in metrics:
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            prev = out["accepted_per_pos"] or [0] * len(vals)
            out["accepted_per_pos"] = [a + b for a, b in zip(prev, vals)]
    return out


def head_method(head: str) -> str:
    """vLLM's speculative method for a head folder: dflash for a DFlashDraftModel config or a speculators
    DFlash checkpoint, else eagle3."""
    with open(os.path.join(head, "config.json")) as f:
        cfg = json.load(f)
    dflash = cfg.get("architectures") == ["DFlashDraftModel"] or cfg.get("speculators_model_type") == "dflash"
    return "dflash" if dflash else "eagle3"


def run(req: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    import vllm

    spec = None
    if req.get("head"):
        method = head_method(req["head"])
        # vLLM 0.32's CPU build norms every layer's context keys with layer 0's weight;
        # EAGLERAY_DFLASH_PATCH=0 runs it stock (to measure what the patch changes)
        if method == "dflash" and os.environ.get("EAGLERAY_DFLASH_PATCH", "1") != "0":
            import vllm_dflash_patch  # the sibling file: this runner runs as a script in vLLM's interpreter
            print(f"vllm_runner: dflash context-key norm patch applied: {vllm_dflash_patch.apply()}", flush=True)
        spec = {"method": method, "model": req["head"], "num_speculative_tokens": req["k"]}
    t0 = time.perf_counter()
    llm = LLM(model=req["target"], speculative_config=spec, dtype=req.get("dtype", "float32"),
              max_model_len=req.get("max_model_len", 512), enforce_eager=True, disable_log_stats=False,
              distributed_executor_backend="uni", seed=0)
    load_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"])
    t0 = time.perf_counter()
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in req["prompts"]], params, use_tqdm=False)
    generate_s = time.perf_counter() - t0
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
              "finish_reasons": [o.outputs[0].finish_reason for o in outs],
              "load_s": round(load_s, 2), "generate_s": round(generate_s, 2), "vllm_version": vllm.__version__}
    result.update(spec_counters(llm.get_metrics()))
    del llm
    gc.collect()  # the next run's engine gets this one's KV cache memory back
    return result


if __name__ == "__main__":
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process
    request_path, result_path = sys.argv[1], sys.argv[2]
    with open(request_path) as f:
        request = json.load(f)
    results = {}
    for one in request.pop("runs"):
        print(f"{MARKER} {one['name']}", flush=True)
        results[one["name"]] = run({**request, **one})
    with open(result_path, "w") as f:
        json.dump(results, f)
