"""Serving benchmark: each backend (eagleray, vllm) deployed speculative and vanilla, measured in one run.

    python -m tools.bench.serve [--backends eagleray,vllm] [--target runs/demo/target]
        [--head-dir runs/demo/head] [--requests-per-level 24] [--waves 4] [--max-tokens 64] [--levels 1,4,16]

One deployment at a time on a local Ray Serve (127.0.0.1), so idle replicas take no cores from the one
measured: `eagleray` (our tree decoder, batch 1 per replica, head_speculators/) and `vllm` (Ray Serve LLM +
vLLM's CPU build, continuous batching, head_speculators/ as an EAGLE-3 chain of `--k` tokens; eagleray's
tree 4/5/16 is sized per round by default, `--eagleray-sizing fixed` takes it as given), each with
its head and without. At every concurrency level the same chat requests (MT-Bench / GSM8K prompts, T=0)
go through the real `openai` client, at least `--waves` x the concurrency of them (64 at 16). Last line: one JSON object with requests/s, tokens/s, p50/p99 per
deployment and level, and the ratios vllm_vs_eagleray_c16 (throughput, both speculative) and
<backend>_spec_vs_vanilla_c<level>.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from infer.benchmarks import default_prompts
from infer.serve import ServeConfig, start

HEADS = {"eagleray": "head_speculators", "vllm": "head_speculators"}


def level(base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    import openai

    c = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900)

    def one(p):
        t0 = time.perf_counter()
        r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], max_tokens=max_tokens,
                                      temperature=0)
        return time.perf_counter() - t0, r.usage.completion_tokens

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        res = list(pool.map(one, prompts))
    wall = time.perf_counter() - t0
    lat = sorted(x[0] for x in res)
    return {"requests_per_s": round(len(res) / wall, 3), "tokens_per_s": round(sum(x[1] for x in res) / wall, 1),
            "p50_s": round(statistics.median(lat), 3), "p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3)}


def mixed_prompts(n: int) -> list[str]:
    """n prompts, MT-Bench and GSM8K alternating, so any first m of them hold both kinds alike."""
    both = default_prompts(None, n)
    mt, gsm = both[: n // 2], both[n // 2:]
    return [p for pair in zip(mt, gsm) for p in pair] + mt[len(gsm):] + gsm[len(mt):]


def deployment(backend: str, target: Path, head: Path | None, port: int, k: int, threads: int,
               vllm_dtype: str = "auto", vllm_bind: str = "auto", vllm_eager: bool = True,
               vllm_draft_up_to: int | None = None, sizing: str = "adaptive") -> ServeConfig:
    name = f"{backend}-{'spec' if head else 'vanilla'}"
    common = dict(backend=backend, target=target, head=head, model_name=name, app_name=name, port=port,
                  max_ongoing_requests=64, max_tokens_limit=2048)
    if backend == "vllm":
        return ServeConfig(**common, num_cpus_per_replica=1, speculative={"mode": "chain", "depth": k},
                           vllm={"max_model_len": 2048, "dtype": vllm_dtype, "max_num_seqs": 64,
                                 "cpu_threads_bind": vllm_bind, "cpu_reserved": None if vllm_bind == "auto" else 0,
                                 "enforce_eager": vllm_eager, "draft_up_to_batch": vllm_draft_up_to})
    return ServeConfig(**common, num_cpus_per_replica=0.5, threads_per_replica=threads,
                       speculative={"sizing": sizing})  # tree 4/5/16 as caps (cost) or as given (fixed)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="eagleray,vllm")
    ap.add_argument("--target", type=Path, default=Path("runs/demo/target"))
    ap.add_argument("--head-dir", type=Path, default=Path("runs/demo/head"))
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--requests-per-level", type=int, default=24)
    ap.add_argument("--waves", type=int, default=4,
                    help="at least waves x concurrency requests a level, so a level measures that many in "
                         "flight, not the ramp-down of a half-filled batch")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--k", type=int, default=3, help="vLLM draft tokens per step (a chain)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of an eagleray replica")
    ap.add_argument("--vllm-dtype", default="auto", choices=["auto", "fp32", "bf16"],
                    help="vLLM weights (auto: fp32 on CPU, the model the eagleray backend serves)")
    ap.add_argument("--vllm-bind", default="auto",
                    help='vLLM engine cores (VLLM_CPU_OMP_THREADS_BIND): "auto" keeps one for its scheduler, '
                         '"0-1" gives the engine both cores of a 2-core box')
    ap.add_argument("--vllm-compile", action="store_true", help="let vLLM compile its model (enforce_eager off)")
    ap.add_argument("--vllm-draft-up-to", type=int, default=None,
                    help="vllm.draft_up_to_batch: vLLM drafts nothing with more running sequences than this")
    ap.add_argument("--eagleray-sizing", default="adaptive", choices=["adaptive", "fixed"],
                    help="speculative.sizing of the eagleray backend (configs/serve/demo.yaml: cost)")
    args = ap.parse_args(argv)
    from ray import serve

    levels = [int(x) for x in args.levels.split(",")]
    n_req = {c: max(args.requests_per_level, args.waves * c) for c in levels}
    prompts = mixed_prompts(max(n_req.values()))
    result: dict = {"requests_per_level": {f"c{c}": n for c, n in n_req.items()}, "max_tokens": args.max_tokens, "k_vllm": args.k,
                    "vllm_dtype": args.vllm_dtype, "vllm_bind": args.vllm_bind, "vllm_compile": args.vllm_compile,
                    "vllm_draft_up_to": args.vllm_draft_up_to, "eagleray_sizing": args.eagleray_sizing}
    for backend in args.backends.split(","):
        for head in (args.head_dir / HEADS[backend], None):
            cfg = deployment(backend, args.target, head, args.port, args.k, args.threads, args.vllm_dtype,
                             args.vllm_bind, not args.vllm_compile, args.vllm_draft_up_to, args.eagleray_sizing)
            t0 = time.perf_counter()
            url = start(cfg) + "/v1"
            level(url, cfg.model_name, prompts[:2], 1, 8)  # warm-up
            rec = {"startup_s": round(time.perf_counter() - t0, 1)}
            for conc in levels:
                rec[f"c{conc}"] = level(url, cfg.model_name, prompts[:n_req[conc]], conc, args.max_tokens)
            result[cfg.model_name] = rec
            serve.shutdown()
        for conc in levels:
            spec, van = result[f"{backend}-spec"][f"c{conc}"], result[f"{backend}-vanilla"][f"c{conc}"]
            result[f"{backend}_spec_vs_vanilla_c{conc}"] = round(spec["tokens_per_s"] / van["tokens_per_s"], 3)
    top = max(levels)
    if "vllm-spec" in result and "eagleray-spec" in result:
        result[f"vllm_vs_eagleray_c{top}"] = round(result["vllm-spec"][f"c{top}"]["tokens_per_s"]
                                                   / result["eagleray-spec"][f"c{top}"]["tokens_per_s"], 3)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
