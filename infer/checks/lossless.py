"""Lossless check: our tree decoding vs the target's own greedy `generate`, token by token.

    python -m infer.checks.lossless [--target runs/demo/target] [--head runs/demo/head/head_speculators]
                                   [--prompts FILE.jsonl] [--n 200] [--max-new-tokens 64]
                                   [--dtype bfloat16 [--fused-verify]] [--device cuda]

Default prompts: MT-Bench first turns and GSM8K test questions from data/ (n/2 each; --data DIR for another folder).
The last line printed is one JSON object with `prompts` and `matched`.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from infer.generate import EagleGenerator, SpecSettings, SpecStats
from infer.benchmarks import chat_ids, default_prompts, prompt_file


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="runs/demo/target")
    ap.add_argument("--head", default="runs/demo/head/head_speculators")
    ap.add_argument("--prompts", type=Path)
    ap.add_argument("--data", "--shared", dest="shared", type=Path)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--total-tokens", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--sizing", choices=["adaptive", "fixed"], default="adaptive",
                    help="adaptive: the shape as caps, sized per round (infer/round_cost.py); fixed: the shape")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (target, head and HF generate)")
    ap.add_argument("--fused-verify", action="store_true",
                    help="below fp32: one masked SDPA call per layer instead of the exact verify attention")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    gen = EagleGenerator.from_folders(args.target, args.head, dtype=getattr(torch, args.dtype), device=args.device,
                                      exact_verify=not args.fused_verify)
    texts = prompt_file(args.prompts) if args.prompts else default_prompts(args.shared, args.n)
    texts = texts[: args.n]
    s = SpecSettings(mode="tree", top_k=args.top_k, depth=args.depth, total_tokens=args.total_tokens,
                     max_new_tokens=args.max_new_tokens, sizing=args.sizing)
    matched, mismatches, stats = 0, [], []
    for i, text in enumerate(texts):
        ids = chat_ids(gen.tokenizer, text)
        dev = gen.target.device
        want = gen.target.model.generate(torch.tensor([ids], device=dev),
                                         attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=dev),
                                         max_new_tokens=args.max_new_tokens, do_sample=False)[0, len(ids):].tolist()
        got = gen.generate(ids, s)
        stats.append(got.stats)
        if got.tokens == want:
            matched += 1
        else:
            first = next((j for j, (a, b) in enumerate(zip(got.tokens, want)) if a != b), min(len(got.tokens), len(want)))
            mismatches.append({"index": i, "first_diff": first})
    result = {"ok": matched == len(texts), "prompts": len(texts), "matched": matched, "tau": round(SpecStats.pooled_tau(stats), 3),
              "mismatches": mismatches[:10], "settings": s.__dict__, "dtype": args.dtype, "device": args.device,
              "exact_verify": bool(gen.target.lean and gen.target.lean.exact_attention)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
