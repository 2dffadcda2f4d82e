"""Serving benchmark: a speculative and a vanilla deployment of the same target, measured in one run.

    python tools/bench_serve.py [--target runs/demo/target] [--head runs/demo/head/head_sglang]
                                [--requests-per-level 24] [--max-tokens 64]

Both apps run on one local Ray Serve (127.0.0.1), one replica each; at concurrency 1, 4 and 16 the
same chat requests (MT-Bench / GSM8K prompts, T=0) go to the speculative app, then to the vanilla one,
through the real `openai` client. Loopback only, bounded request counts. Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from infer.prompts import default_prompts  # noqa: E402
from infer.serve import ServeConfig, build_application  # noqa: E402
from pipeline.cluster import ensure_ray  # noqa: E402


def level(base_url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    import openai

    c = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)

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


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path("runs/demo/target"))
    ap.add_argument("--head", type=Path, default=Path("runs/demo/head/head_sglang"))
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--requests-per-level", type=int, default=24)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    from ray import serve

    ensure_ray()
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    apps = {}
    for name, head in (("spec", args.head), ("vanilla", None)):
        cfg = ServeConfig(target=args.target, head=head, model_name=name, port=args.port, num_cpus_per_replica=0.5,
                          threads_per_replica=2, max_ongoing_requests=64)
        serve.run(build_application(cfg), name=name, route_prefix=f"/{name}", blocking=False)
        apps[name] = f"http://127.0.0.1:{args.port}/{name}/v1"
    prompts = default_prompts(None, args.requests_per_level)
    for name, url in apps.items():  # warm-up
        level(url, name, prompts[:2], 1, 8)
    result = {"spec": {}, "vanilla": {}, "requests_per_level": len(prompts), "max_tokens": args.max_tokens}
    for conc in (1, 4, 16):
        for name, url in apps.items():
            result[name][f"c{conc}"] = level(url, name, prompts, conc, args.max_tokens)
        result[f"speedup_c{conc}"] = round(result["spec"][f"c{conc}"]["requests_per_s"]
                                           / result["vanilla"][f"c{conc}"]["requests_per_s"], 3)
    serve.shutdown()
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
