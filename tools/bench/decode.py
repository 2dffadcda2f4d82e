"""Decoding benchmark, batch 1, T=0, all methods side by side on the same prompts in one process.

    python -m tools.bench.decode [--target runs/demo/target] [--head runs/demo/head/head_speculators]
        [--assistant runs/demo/assistant] [--prompts FILE.jsonl] [--n 40] [--max-new-tokens 96]
        [--top-k 4] [--depth 5] [--total-tokens 16] [--compare-head runs/demo/head_dflash/head_dflash]

Methods: HF `generate` (greedy), our vanilla loop, the EAGLE tree fixed, the same shape with the adaptive
policy (`eagle_adaptive`: depth and total_tokens as caps, each round sized by this machine's measured costs
and the request's acceptance, down to plain steps; infer/round_cost.py), the EAGLE chain fixed (top_k 1,
same depth), the same tree decoded on the HF forward instead of the lean one (`eagle_tree_hf_forward`; differs from
`eagle_tree` only for Llama-shaped targets, infer/cpu/lean.py), HF prompt-lookup decoding, HF
assisted generation with a 2-layer assistant trained by infer/demo/target.py (built on first use when
missing). Each prompt runs every method in turn, so drift on a shared machine hits all alike.
tau = new tokens / target forwards after prefill.
For our own loops the JSON also has `round_split` (seconds per round: draft = tree growth + ingest,
verify = the target forward, accept = acceptance + KV compaction, other = the rest of the loop) and
`model_speedup`, the cost model's prediction tau x T_step / (T_verify + T_draft) from the measured tau and
per-round times (T_step = our vanilla loop's forward), beside `speedup_vs_vanilla` as measured: the gap is
what the loop spends outside the model's forwards. The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
from infer.generate import EagleGenerator, SpecSettings
from infer.benchmarks import chat_ids, default_prompts, prompt_file


class ForwardCounter:
    def __init__(self, model):
        self.n = 0
        model.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.n += 1


def ensure_assistant(path: Path, target: Path) -> Path:
    if not (path / "config.json").is_file():
        corpus = ROOT / "runs/demo/corpus/train.jsonl"
        subprocess.run([sys.executable, "-m", "infer.demo.target", f"tokenizer={target}",
                        "--out", str(path),
                        "--preset", "assistant", "--corpus", str(corpus)], check=True)
    return path


def fused_verify(gen: EagleGenerator, ids: list[int], s: SpecSettings):
    """The tree with one masked SDPA call per layer in the verify (below fp32 it is not bit-exact)."""
    gen.target.lean.exact_attention = False
    try:
        g = gen.generate(ids, s)
    finally:
        gen.target.lean.exact_attention = True
    return g.tokens, g.stats


def load_generator(args) -> EagleGenerator:
    """The target with args.head, or with a seeded untrained head over its vocabulary (`--head random`)."""
    dtype = getattr(torch, args.dtype)
    if str(args.head) != "random":
        return EagleGenerator.from_folders(args.target, args.head, dtype=dtype)
    from infer.checks.sampling import random_head
    from pipeline.target import default_aux_layers, num_layers

    plain = EagleGenerator.from_folders(args.target, None, dtype=dtype)
    model = plain.target.model
    return EagleGenerator(model, plain.tokenizer, random_head(model.config, dtype=dtype),
                          default_aux_layers(num_layers(model.config)))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path("runs/demo/target"))
    ap.add_argument("--head", type=Path, default=Path("runs/demo/head/head_speculators"),
                    help="a head folder, or `random`: an untrained seeded head (a draft that is never right)")
    ap.add_argument("--assistant", type=Path, default=Path("runs/demo/assistant"))
    ap.add_argument("--prompts", type=Path)
    ap.add_argument("--data", "--shared", dest="shared", type=Path)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--total-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip", nargs="*", default=[], help="methods to leave out")
    ap.add_argument("--compare-head", type=Path, help="a second head (e.g. DFlash beside EAGLE-3): its tree and "
                    "chain run as eagle_cmp_tree / eagle_cmp_chain on the same prompts and target")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="target and head dtype (HF generate runs the same model object)")
    return ap.parse_args(argv)


def build_methods(gen: EagleGenerator, args) -> dict:
    """name -> fn(prompt ids) -> (tokens, SpecStats or None), without the skipped ones."""
    from transformers import AutoModelForCausalLM

    model, n_new = gen.target.model, args.max_new_tokens
    gen_hf = assistant = None
    if "eagle_tree_hf_forward" not in args.skip:  # shares the model and head; 3 aux hooks on HF's forward
        gen_hf = EagleGenerator(model, gen.tokenizer, gen.draft.head, gen.target.aux_layer_ids,
                                cpu_path="generic")
    if "assisted" not in args.skip:
        assistant = AutoModelForCausalLM.from_pretrained(ensure_assistant(args.assistant, args.target)).eval()
    tree = SpecSettings(mode="tree", top_k=args.top_k, depth=args.depth, total_tokens=args.total_tokens,
                        max_new_tokens=n_new, sizing="fixed")
    chain = SpecSettings(mode="chain", depth=args.depth, max_new_tokens=n_new, sizing="fixed")
    adaptive = tree.model_copy(update={"sizing": "adaptive"})  # the shape as caps, sized per round
    vanilla = SpecSettings(mode="vanilla", max_new_tokens=n_new)

    def hf(ids, **kw):
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n_new, do_sample=False,
                             **kw)
        return out[0, len(ids):].tolist(), None

    def ours(g: EagleGenerator, s: SpecSettings):
        return lambda ids: (lambda out: (out.tokens, out.stats))(g.generate(ids, s))

    methods = {"hf_generate": hf, "vanilla": ours(gen, vanilla), "eagle_tree": ours(gen, tree),
               "eagle_adaptive": ours(gen, adaptive),
               "eagle_chain": ours(gen, chain), "eagle_tree_hf_forward": gen_hf and ours(gen_hf, tree),
               "eagle_tree_fused_verify": lambda ids: fused_verify(gen, ids, tree),
               "prompt_lookup": lambda ids: hf(ids, prompt_lookup_num_tokens=10),
               "assisted": lambda ids: hf(ids, assistant_model=assistant)}
    if args.compare_head is not None:  # the same target model, a second head and draft runner
        from pipeline.target import num_layers
        from trainer.export import import_head
        from trainer.kinds import build_head

        state, hcfg, aux = import_head(args.compare_head, num_layers(model.config))
        head = build_head(hcfg)
        head.load_state_dict(state, strict=False)
        head.set_vocab(state["d2t"], state["t2d"])
        other = EagleGenerator(model, gen.tokenizer, head.to(getattr(torch, args.dtype)), aux or gen.target.aux_layer_ids)
        methods |= {"eagle_cmp_tree": ours(other, tree), "eagle_cmp_chain": ours(other, chain)}
    skip = set(args.skip)
    if not (gen.target.lean and gen.target.lean.exact_attention):
        skip.add("eagle_tree_fused_verify")  # the same as eagle_tree
    return {k: v for k, v in methods.items() if k not in skip}


def measure(methods: dict, prompts: list[list[int]], counter: ForwardCounter) -> dict:
    """Every method on every prompt in turn (the first prompt once more before, as warm-up)."""
    agg = {k: {"tokens": 0, "seconds": 0.0, "forwards": 0, "accepted": [], "match": 0, "nodes": 0, "levels": 0,
               "plain": 0, "split": {"draft": 0.0, "verify": 0.0, "accept": 0.0, "other": 0.0}} for k in methods}
    for fn in methods.values():
        fn(prompts[0])
    with torch.no_grad():
        for ids in prompts:
            ref = None
            for name, fn in methods.items():
                counter.n = 0
                t0 = time.perf_counter()
                tokens, stats = fn(ids)
                a = agg[name]
                a["seconds"] += time.perf_counter() - t0
                a["tokens"] += len(tokens)
                a["forwards"] += stats.rounds if stats is not None else max(0, counter.n - 1)
                if stats is not None:
                    a["accepted"] += stats.accepted
                    a["nodes"] += stats.nodes
                    a["levels"] += stats.levels
                    a["plain"] += stats.plain_steps
                    for part, sec in stats.split.items():
                        a["split"][part] += sec
                ref = tokens if ref is None else ref
                a["match"] += tokens == ref
    return agg


def summarize(agg: dict, n_prompts: int, depth: int) -> dict:
    """Per method: tau, tokens/s, speedup vs HF generate, greedy match; for our loops the round split,
    and for the speculative ones the cost model's speedup beside the measured one."""
    base = agg["hf_generate"]["tokens"] / agg["hf_generate"]["seconds"] if "hf_generate" in agg else None
    result = {}
    for name, a in agg.items():
        tps = a["tokens"] / a["seconds"]
        entry = {"tau": round(a["tokens"] / max(1, a["forwards"]), 3), "tokens_per_s": round(tps, 1),
                 "speedup_vs_hf": round(tps / base, 3) if base else None,
                 "greedy_match": f"{a['match']}/{n_prompts}"}
        rounds, drafted = max(1, a["forwards"]), max(1, len(a["accepted"]))  # plain steps are rounds too
        if name.startswith("eagle_"):
            entry["accept_by_depth"] = [round(sum(x > d for x in a["accepted"]) / drafted, 3)
                                        for d in range(depth)]
            entry["nodes_per_round"] = round(a["nodes"] / rounds, 2)
            entry["levels_per_round"] = round(a["levels"] / rounds, 2)
            entry["plain_step_share"] = round(a["plain"] / rounds, 3)  # rounds the DraftGate did not draft
        if name == "vanilla" or name.startswith("eagle_"):
            entry["round_split"] = {k: round(v / rounds, 5) for k, v in a["split"].items()}
            share = sum(a["split"].values())
            entry["other_share"] = round(a["split"]["other"] / share, 4) if share else None
        result[name] = entry
    if "vanilla" in result:
        t_step, van_tps = result["vanilla"]["round_split"]["verify"], result["vanilla"]["tokens_per_s"]
        for name in ("eagle_tree", "eagle_adaptive", "eagle_chain", "eagle_tree_hf_forward", "eagle_cmp_tree",
                     "eagle_cmp_chain"):
            if name in result:
                r = result[name]
                rs = r["round_split"]
                r["model_speedup"] = round(r["tau"] * t_step / (rs["verify"] + rs["draft"]), 3)
                r["speedup_vs_vanilla"] = round(r["tokens_per_s"] / van_tps, 3)
    return result


def node_costs(gen: EagleGenerator, top_k: int, prefix: int) -> dict:
    """A verified node's ms beside a 1-token step's, from this machine's round costs (infer/round_cost.py)
    after `prefix` committed tokens, and the node's GEMM limit: one more row through every linear of the
    target (2 FLOPs a weight) at the rate this machine's matmul reaches on the target's widest linear in
    its dtype, 256 rows at a time (the packed oneDNN linear where the lean target packs)."""
    from infer.round_cost import median_ms

    step, node = gen.round_costs(top_k).at(prefix)
    model = gen.target.model
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    widest = max(linears, key=lambda m: m.weight.numel())
    x = torch.randn(256, widest.in_features).to(widest.weight)
    lean = gen.target.lean
    run = widest
    if lean is not None and lean.packed:
        from infer.cpu.packed import PackedLinear
        run = PackedLinear.pack(widest.weight, widest.bias)
    gflops = 2 * 256 * widest.weight.numel() / median_ms(lambda: run(x), 10) / 1e6
    flops_per_node = 2 * sum(m.weight.numel() for m in linears)
    return {"step_ms": round(step, 3), "node_ms": round(node, 3), "cost_prefix": prefix,
            "node_ms_limit": round(flops_per_node / gflops / 1e6, 3), "gemm_gflops": round(gflops, 1),
            "node_gflop": round(flops_per_node / 1e9, 3)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = load_generator(args)
    counter = ForwardCounter(gen.target.model)
    methods = build_methods(gen, args)
    texts = (prompt_file(args.prompts) if args.prompts else default_prompts(args.shared, args.n))[: args.n]
    prompts = [chat_ids(gen.tokenizer, t) for t in texts]
    agg = measure(methods, prompts, counter)
    lean = gen.target.lean
    result = {"lean_target": lean is not None, "dtype": args.dtype,
              "packed_linears": bool(lean and lean.packed),
              "depth": args.depth, "prompts": len(texts), "max_new_tokens": args.max_new_tokens,
              "tree": {"top_k": args.top_k, "depth": args.depth, "total_tokens": args.total_tokens},
              "head": str(args.head), "compare_head": str(args.compare_head) if args.compare_head else None}
    result.update(summarize(agg, len(texts), args.depth))
    mid = round(sum(map(len, prompts)) / len(prompts) + args.max_new_tokens / 2)  # a decode's middle
    result.update(node_costs(gen, args.top_k, mid))
    fixed = {k: result[k]["tokens_per_s"] for k in ("eagle_tree", "eagle_chain", "vanilla") if k in result}
    if "eagle_adaptive" in result and fixed:  # the goal: adaptive at or above the best fixed policy
        best = max(fixed, key=fixed.get)
        ratio = result["eagle_adaptive"]["tokens_per_s"] / fixed[best]
        result["adaptive_vs_best_fixed"] = {"best_fixed": best, "ratio": round(ratio, 3)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
