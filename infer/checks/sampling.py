"""Sampling check: speculative draws of the next few tokens against the target's exact joint distribution.

    python -m infer.checks.sampling [--device cuda] [--dtype float32] [--n 8000]

A random Llama with a 48-token vocabulary and peaky next-token distributions (so few cells carry the mass)
and a random draft head; T=0.8, top-p 0.9. `--n` speculative generations of 3 tokens are counted per
sequence and compared with the exact p(t1, t2, t3) under the same warpers by a chi-square over the cells
expected >= 5 times (plus one cell for the rest). The last line printed is one JSON object with `p_value`,
`cells` and `accepted` (draft tokens accepted in all draws: > 0 shows the draft path was exercised).
"""
from __future__ import annotations

import argparse
import collections
import json
import time

import torch

from infer.generate import EagleGenerator, SpecSettings
from infer.tree import sampling_probs
from trainer.head import Eagle3Head, head_config_from_target

SETTINGS = SpecSettings(mode="tree", top_k=3, depth=2, total_tokens=6, max_new_tokens=3, temperature=0.8,
                        top_p=0.9, sizing="fixed")  # the adaptive policy's shapes follow timings
PROMPT = [5, 9, 17, 3]


def peaky_llama(dtype=torch.float64, device="cpu", seed=3):
    """vocab 48, 4 layers; lm_head scaled 12x so a handful of tokens carry each step's mass."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(12.0)
    return model.to(device, dtype)


def random_head(cfg, seed=0, dtype=torch.float64) -> Eagle3Head:
    """A seeded, untrained head over the target's whole vocabulary (the tests' random head too)."""
    torch.manual_seed(seed)
    return Eagle3Head(head_config_from_target(cfg, cfg.vocab_size)).to(dtype)


@torch.no_grad()
def exact_joint(model, prompt: list[int], s: SpecSettings) -> dict[tuple[int, int, int], float]:
    """p(t1, t2, t3) under `s`'s temperature / top-p, from full forwards (no cache), for every sequence the
    warped target can sample."""
    dev = model.device

    def probs(seqs: list[list[int]]) -> torch.Tensor:
        logits = model(torch.tensor(seqs, device=dev)).logits[:, -1]
        return sampling_probs(logits, s.temperature, s.top_p).double().cpu()

    out = {}
    p1 = probs([prompt])[0]
    for t1 in p1.nonzero().flatten().tolist():
        p2 = probs([prompt + [t1]])[0]
        t2s = p2.nonzero().flatten().tolist()
        p3 = probs([prompt + [t1, t2] for t2 in t2s])
        for row, t2 in enumerate(t2s):
            for t3 in p3[row].nonzero().flatten().tolist():
                out[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[row, t3])
    return out


def chi_square(counts: collections.Counter, joint: dict, n: int, min_expected: float = 5.0) -> dict:
    """Pearson's chi-square of `counts` (n draws) against `joint`, over the cells expected >= min_expected
    times plus one pooled cell for the rest; p from the upper regularised gamma (no scipy needed)."""
    big = [c for c, p in joint.items() if p * n >= min_expected]
    obs = [counts[c] for c in big] + [n - sum(counts[c] for c in big)]
    exp = [joint[c] * n for c in big] + [n - sum(joint[c] * n for c in big)]
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp) if e > 0)
    dof = len(obs) - 1
    p = float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    return {"cells": len(big), "chi2": round(stat, 3), "dof": dof, "p_value": round(p, 4)}


def draw_counts(model, head, draws: list[int], s: SpecSettings) -> tuple[collections.Counter, int]:
    """Sequences drawn with the seeds `draws` (one speculative generation each) and the drafts accepted."""
    gen = EagleGenerator(model, None, head, [0, 1, 2])  # 4 layers: explicit aux ids
    counts, accepted = collections.Counter(), 0
    for draw in draws:
        out = gen.generate(PROMPT, SpecSettings(**{**s.__dict__, "seed": draw}))
        counts[tuple(out.tokens)] += 1
        accepted += sum(out.stats.accepted)
    return counts, accepted


def run_check(model, head, n: int, seed: int = 123, s: SpecSettings = SETTINGS, workers: int = 1) -> dict:
    """n seeded speculative generations of 3 tokens from PROMPT vs the exact joint distribution. The seeds
    come from `seed` alone, so `workers` processes (spawned, each drawing its slice) count the same draws."""
    g = torch.Generator().manual_seed(seed)
    draws = [int(torch.randint(0, 2 ** 62, (1,), generator=g)) for _ in range(n)]
    t0 = time.perf_counter()
    if workers <= 1:
        counts, accepted = draw_counts(model, head, draws, s)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        parts = [draws[i::workers] for i in range(workers)]
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                 initializer=torch.set_num_threads, initargs=(1,)) as pool:  # a core each
            results = list(pool.map(draw_counts, [model] * workers, [head] * workers, parts, [s] * workers))
        counts, accepted = sum((c for c, _ in results), collections.Counter()), sum(a for _, a in results)
    secs = time.perf_counter() - t0
    joint = exact_joint(model, PROMPT, s)
    return {"n": n, "accepted": accepted, "impossible": sum(v for c, v in counts.items() if c not in joint),
            "seconds": round(secs, 1), "workers": workers, **chi_square(counts, joint, n)}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--n", type=int, default=8000)
    ap.add_argument("--seed", type=int, default=123)
    ap.add_argument("--workers", type=int, default=1, help="processes drawing in parallel (CPU)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    model = peaky_llama(dtype, args.device)
    res = run_check(model, random_head(model.config, seed=1, dtype=dtype), args.n, args.seed, workers=args.workers)
    res |= {"device": args.device, "dtype": args.dtype,
            "device_name": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"}
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
