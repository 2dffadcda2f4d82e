"""Demo: prompts decoded by the target alone and with the EAGLE-3 tree, side by side.

    python -m infer.demo.decode [--target runs/demo/target] [--head runs/demo/head/head_speculators] [--prompt TEXT]
        [--out runs/demo/decode.json]

Prints one line (tokens/s of both, tau, whether every output is identical); the texts go to --out.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from infer.benchmarks import chat_ids
from infer.generate import EagleGenerator, SpecSettings


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="runs/demo/target")
    ap.add_argument("--head", default="runs/demo/head/head_speculators")
    ap.add_argument("--prompt", action="append",
                    help="repeatable; default: two prompts in the demo corpus's style")
    ap.add_argument("--out", type=Path, default=Path("runs/demo/decode.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the step's console is its one line
    gen = EagleGenerator.from_folders(args.target, args.head)
    prompts = args.prompt or ["Sam has 17 marbles. Sam buys 8 more and then gives 5 to Tara. How many marbles does Sam have now?",
                              "Write a Python function that returns the largest number in a list."]
    rows = []
    for text in prompts:
        ids = chat_ids(gen.tokenizer, text)
        gen.generate(ids, SpecSettings(mode="vanilla", max_new_tokens=8))  # warm-up
        van = gen.generate(ids, SpecSettings(mode="vanilla", max_new_tokens=128))
        spec = gen.generate(ids, SpecSettings(mode="tree", top_k=4, depth=5, total_tokens=16, max_new_tokens=128))
        rows.append({"prompt": text, "vanilla": van.text, "eagle3": spec.text, "identical": van.tokens == spec.tokens,
                     "tokens": len(spec.tokens), "vanilla_tokens": len(van.tokens), "vanilla_s": van.stats.seconds, "eagle3_s": spec.stats.seconds,
                     "tau": spec.stats.tau})
    van_rate = sum(r["vanilla_tokens"] for r in rows) / sum(r["vanilla_s"] for r in rows)
    spec_rate = sum(r["tokens"] for r in rows) / sum(r["eagle3_s"] for r in rows)
    out = {"prompts": rows, "vanilla_tokens_per_s": round(van_rate, 1), "eagle3_tokens_per_s": round(spec_rate, 1),
           "speedup": round(spec_rate / van_rate, 3), "tau": round(sum(r["tau"] for r in rows) / len(rows), 3),
           "identical": sum(r["identical"] for r in rows)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, ensure_ascii=False, indent=2))
    print(f"[decode] {len(rows)} prompts: target alone {van_rate:.1f} tokens/s, with the head {spec_rate:.1f} "
          f"({out['speedup']:.2f}x, tau {out['tau']:.2f}); identical output {out['identical']}/{len(rows)}; "
          f"texts in {args.out}", flush=True)
    return out


if __name__ == "__main__":
    main()
