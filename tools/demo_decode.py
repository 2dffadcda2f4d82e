"""Demo: one prompt decoded by the target alone and with the EAGLE-3 tree, side by side.

    python tools/demo_decode.py [--target runs/demo/target] [--head runs/demo/head/head_sglang] [--prompt TEXT]
"""
from __future__ import annotations

import argparse

import torch

from infer.generate import EagleGenerator, SpecSettings
from infer.benchmarks import chat_ids


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="runs/demo/target")
    ap.add_argument("--head", default="runs/demo/head/head_sglang")
    ap.add_argument("--prompt", action="append",
                    help="repeatable; default: two prompts in the demo corpus's style")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    gen = EagleGenerator.from_folders(args.target, args.head)
    prompts = args.prompt or ["Sam has 17 marbles. Sam buys 8 more and then gives 5 to Tara. How many marbles does Sam have now?",
                              "Write a Python function that returns the largest number in a list."]
    for text in prompts:
        ids = chat_ids(gen.tokenizer, text)
        gen.generate(ids, SpecSettings(mode="vanilla", max_new_tokens=8))  # warm-up
        van = gen.generate(ids, SpecSettings(mode="vanilla", max_new_tokens=128))
        spec = gen.generate(ids, SpecSettings(mode="tree", top_k=4, depth=5, total_tokens=16, max_new_tokens=128))
        print(f"\nQ: {text}")
        print(f"vanilla  ({len(van.tokens) / van.stats.seconds:6.1f} tok/s): {van.text!r}")
        print(f"eagle-3  ({len(spec.tokens) / spec.stats.seconds:6.1f} tok/s, tau {spec.stats.tau:.2f}): {spec.text!r}")
        print(f"identical: {van.tokens == spec.tokens}")


if __name__ == "__main__":
    main()
