"""Replay tree sizing policies on recorded drafts: fixed shapes vs `sizing: cost`, under this machine's costs.

    python tools/replay_sizing.py [--target runs/demo/target] [--head runs/demo/head/head_speculators] [--n 16]
        [--dtype bfloat16] [--top-k 4] [--depth 6] [--max-new-tokens 96] [--shapes 3/8,2/4,5/16]

For every position of each prompt's greedy answer, the draft grows its tree from that position (top_k,
depth) and every candidate is kept with its cumulative draft probability and depth, beside the chain of
candidates that matches the target's greedy continuation. Decoding under a policy is then replayed
exactly: a round at position p that keeps the best m candidates of depth <= d accepts the chain's nodes
among them and moves p on by that plus the bonus, at the cost ingest + (d - 1) x level + step + m x node
(infer/round_cost.py, measured here). Valid because the draft's state at a position does not depend on
how earlier rounds were cut (its cache holds committed positions only). Policies: fixed `depth/total`
shapes of this top_k, and the cost rule itself (`cost_width`, the grow threshold) under caps, alone and
with the decoder's `DraftGate` (plain steps while drafting rounds lose); vanilla is one token per 1-token
step. Costs exclude what the loop spends outside the forwards, so the figures run
above bench_decode's; compare policies, not absolute rates. Last line: one JSON object with tokens/s, tau
and nodes / levels per round for each.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from infer.benchmarks import chat_ids, default_prompts
from infer.generate import EagleGenerator, SpecSettings
from infer.round_cost import DraftGate, RoundCosts, cost_width


def record(gen: EagleGenerator, ids: list[int], top_k: int, depth: int, n_new: int) -> list[dict]:
    """Per position of the greedy answer: candidates sorted by score (log-probs, depths) and the ranks of
    the candidate chain that matches the greedy continuation."""
    answer = gen.generate(ids, SpecSettings(mode="vanilla", max_new_tokens=n_new)).tokens
    seq = torch.tensor(ids + answer)
    plen = len(ids)
    _, aux = gen.target.forward(seq, torch.arange(len(seq)), gen.target.new_cache())
    gen.draft.reset()
    hid, dlog = gen.draft.ingest(aux[:plen], seq[1:plen + 1], torch.arange(plen))
    out = []
    for p in range(plen, len(seq) - 1):  # root: the token at position p
        gen.draft.build_tree(int(seq[p]), hid, dlog, p - 1, top_k, depth, 2)
        t = gen.draft.table
        order = torch.sort(t.scores[:t.n], descending=True, stable=True).indices
        rank = torch.empty(t.n, dtype=torch.long)
        rank[order] = torch.arange(t.n)
        chain, parent = [], -1
        for d in range(1, min(depth, len(seq) - 1 - p) + 1):
            hit = ((t.parents[:t.n] == parent) & (t.tokens[:t.n] == seq[p + d])).nonzero().flatten()
            if hit.numel() == 0:
                break
            parent = int(hit[0])
            chain.append(int(rank[parent]))
        out.append({"p": p, "scores": t.scores[:t.n][order], "depths": t.depths[:t.n][order], "chain": chain})
        hid, dlog = gen.draft.ingest(aux[p:p + 1], seq[p + 1:p + 2], torch.tensor([p]))
    gen.draft.reset()
    return out


def round_outcome(pos: dict, d: int, m: int) -> int:
    """Accepted draft tokens when the best m candidates of depth <= d are verified."""
    keep = (pos["depths"] <= d).nonzero().flatten()
    rank_in_kept = {int(r): i for i, r in enumerate(keep)}
    return sum(1 for r in pos["chain"][:d] if rank_in_kept.get(r, m) < m)


def cost_policy(pos: dict, costs: RoundCosts, max_depth: int, cap: int) -> tuple[int, int]:
    """The cost rule of DraftRunner.build_tree on a recorded position: levels, then width."""
    plan = costs.plan(pos["p"])
    d = 1
    while d < max_depth and float(pos["scores"][pos["depths"] == d].max().exp()) >= plan.grow_threshold:
        d += 1
    scores = pos["scores"][pos["depths"] <= d]
    return d, cost_width(scores, plan.base_ms + (d - 1) * plan.level_ms, plan.node_ms, cap)


def replay(prompts: list[list[dict]], costs: RoundCosts, policy, gated: bool = False) -> dict:
    """Decode every recorded prompt under `policy`; gated: with the decoder's DraftGate, whose plain steps
    cost a 1-token step each (the catch-up ingest is counted as the probe round's one ingest)."""
    tokens = rounds = nodes = levels = plain = 0
    ms = 0.0
    for positions in prompts:
        gate, i = DraftGate() if gated else None, 0
        while i < len(positions):
            pos = positions[i]
            step, node = costs.at(pos["p"])
            if gate is not None and not gate.drafts():
                ms, tokens, rounds, nodes, plain, i = ms + step, tokens + 1, rounds + 1, nodes + 1, plain + 1, i + 1
                continue
            d, m = policy(pos)
            acc = round_outcome(pos, d, m)
            ms += costs.ingest + (d - 1) * costs.level + step + m * node
            if gate is not None:
                gate.record(costs.plan(pos["p"]).gained(acc, d, m + 1))
            tokens, rounds, nodes, levels = tokens + acc + 1, rounds + 1, nodes + m + 1, levels + d
            i += acc + 1
    out = {"tokens_per_s": round(tokens / ms * 1e3, 1), "tau": round(tokens / rounds, 3),
           "nodes_per_round": round(nodes / rounds, 2), "levels_per_round": round(levels / rounds, 2)}
    if gated:
        out["plain_step_share"] = round(plain / rounds, 3)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="runs/demo/target")
    ap.add_argument("--head", default="runs/demo/head/head_speculators")
    ap.add_argument("--data", "--shared", dest="shared", type=Path)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--depth", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--shapes", default="3/8,2/4,3/5,4/10,5/16", help="fixed depth/total_tokens shapes")
    ap.add_argument("--cost-caps", default="5/16", help="depth/total_tokens caps of the cost rule")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    gen = EagleGenerator.from_folders(args.target, args.head, dtype=getattr(torch, args.dtype))
    costs = gen.round_costs(args.top_k)
    texts = default_prompts(args.shared, args.n)
    with torch.no_grad():
        recorded = [record(gen, chat_ids(gen.tokenizer, t), args.top_k, args.depth, args.max_new_tokens)
                    for t in texts]
    cap_d, cap_total = map(int, args.cost_caps.split("/"))
    steps_ms = sum(costs.at(pos["p"])[0] for positions in recorded for pos in positions)
    result = {"costs_ms": {k: round(v, 5) for k, v in vars(costs).items()}, "prompts": len(texts),
              "positions": sum(map(len, recorded)), "top_k": args.top_k, "depth": args.depth,
              "vanilla": {"tokens_per_s": round(sum(map(len, recorded)) / steps_ms * 1e3, 1)}}
    for gated in (False, True):  # the tree rule alone, then with the decoder's DraftGate (what it runs)
        result[f"cost_{args.top_k}/{args.cost_caps}" + ("_gated" if gated else "")] = replay(
            recorded, costs, lambda pos: cost_policy(pos, costs, min(cap_d, args.depth), cap_total - 1), gated)
    for shape in args.shapes.split(","):
        d, total = map(int, shape.split("/"))
        result[f"fixed_{args.top_k}/{d}/{total}"] = replay(recorded, costs, lambda pos, d=d, m=total - 1: (d, m))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
