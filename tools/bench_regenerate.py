"""Regeneration engines side by side: HF `generate` (left-padded batches) vs vLLM (continuous batching),
the same prompts, the same chat template, T=0, one process. The pipeline's own engine classes are used
(pipeline/regenerate.py), so this measures what `regenerate.engine` switches between.

    python tools/bench_regenerate.py --target runs/demo/target [--prompts FILE] [--n 64]
        [--max-new-tokens 128] [--hf-batch 16] [--threads 2]

Prompts: the first user turn of the first n records of FILE (any corpus the ingest stage reads;
the recorded figures used LIMA, data/README.md "Larger corpora"). Prints one JSON object last: hf_tokens_per_s, vllm_tokens_per_s,
vllm_vs_hf, same_tokens_rate (share of prompts with identical answer token ids), token counts and load times,
and where the answers part: `hf_batched_vs_single_rate` (HF left-padded batches vs HF one prompt at a time)
and, at each first differing token, the target's own top-2 logit margin there (batch 1, fp32):
`tie_margins` quantiles. Margins near float rounding mean the engines split a near-tie, not a bug.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pipeline.formats import load_conversations



def first_turns(path: Path, n: int) -> list[list[dict]]:
    convs, _ = load_conversations(path)
    out = []
    for c in convs:
        user = next((m for m in c if m["role"] == "user"), None)
        if user is not None:
            out.append([{"role": "user", "content": user["content"]}])
        if len(out) == n:
            break
    return out


def timed(engine, prompts: list[list[int]], batch: int) -> tuple[list[list[int]], float]:
    t0 = time.perf_counter()
    out = []
    for s in range(0, len(prompts), batch):
        out += engine.generate(prompts[s: s + batch], seed=0)
    return out, time.perf_counter() - t0


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def tie_margins(model, prompts, outs_a, outs_b) -> list[float]:
    """At the first token where two answers differ: the target's top-1 minus top-2 logit (batch 1, fp32)."""
    margins = []
    with torch.no_grad():
        for p, a, b in zip(prompts, outs_a, outs_b):
            k = first_difference(a, b)
            if k is None or k >= min(len(a), len(b)):
                continue  # identical, or one stopped early: no competing token to measure
            logits = model(torch.tensor([p + a[:k]])).logits[0, -1].float()
            top = logits.topk(2).values
            margins.append(float(top[0] - top[1]))
    return margins


def quantiles(xs: list[float]) -> dict:
    if not xs:
        return {}
    xs = sorted(xs)
    return {q: round(xs[min(len(xs) - 1, int(f * len(xs)))], 6) for q, f in (("p10", .1), ("p50", .5), ("p90", .9))}


def main(argv=None) -> dict:
    from pipeline.config import ChatTemplate, Regenerate
    from pipeline.regenerate import HFRegenerator, VllmRegenerator

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path("runs/demo/target"))
    ap.add_argument("--prompts", type=Path, required=True,
                    help="a corpus file; the recorded figures used LIMA (lima_1029.ultrachat.jsonl, data/README.md)")
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = Regenerate(enabled=True, max_new_tokens=args.max_new_tokens, batch_size=args.hf_batch,
                     vllm={"max_model_len": args.max_model_len, "max_num_seqs": args.n})
    t0 = time.perf_counter()
    hf = HFRegenerator(str(args.target), cfg, ChatTemplate())
    hf_load = time.perf_counter() - t0
    convs = first_turns(args.prompts, args.n)
    prompts = [p for p in (hf.prompt_ids(c) for c in convs) if len(p) + args.max_new_tokens <= hf.max_len]
    hf_out, hf_s = timed(hf, prompts, args.hf_batch)
    single, _ = timed(hf, prompts, 1)
    t0 = time.perf_counter()
    vl = VllmRegenerator(str(args.target), cfg, ChatTemplate())
    vl_load = time.perf_counter() - t0
    vl_out, vl_s = timed(vl, prompts, len(prompts))
    hf_tok, vl_tok = sum(map(len, hf_out)), sum(map(len, vl_out))
    result = {"target": str(args.target), "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "hf_batch": args.hf_batch, "hf_tokens": hf_tok, "vllm_tokens": vl_tok,
              "hf_s": round(hf_s, 2), "vllm_s": round(vl_s, 2),
              "hf_tokens_per_s": round(hf_tok / hf_s, 1), "vllm_tokens_per_s": round(vl_tok / vl_s, 1),
              "vllm_vs_hf": round((vl_tok / vl_s) / (hf_tok / hf_s), 3),
              "same_tokens_rate": round(sum(a == b for a, b in zip(hf_out, vl_out)) / max(1, len(prompts)), 4),
              "hf_batched_vs_single_rate": round(sum(a == b for a, b in zip(hf_out, single)) / max(1, len(prompts)), 4),
              "vllm_vs_single_rate": round(sum(a == b for a, b in zip(vl_out, single)) / max(1, len(prompts)), 4),
              "tie_margins_vllm_vs_single": quantiles(tie_margins(hf.model, prompts, single, vl_out)),
              "tie_margins_batched_vs_single": quantiles(tie_margins(hf.model, prompts, single, hf_out)),
              "hf_load_s": round(hf_load, 1), "vllm_load_s": round(vl_load, 1)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":  # vLLM may spawn processes: the guard is required
    main()
