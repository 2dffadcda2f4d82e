"""A batch-1 decode step against this machine's floor, ours and HF's side by side in one run.

    python tools/decode_floor.py [--target runs/demo/target] [--dtype bfloat16] [--prefix 256]
        [--steps 30] [--threads 2]

A 1-token step reads every weight once, so its floor is the weights' bytes (every distinct linear weight,
the lm_head included; the KV cache and the embedding's one row left out) over the rate this machine reads
memory, measured here in the same run (a large fp32 sum). Our lean step (`TargetRunner`, what our loop and
the verify run) and the HF forward step (what `generate` runs) are timed after the same `--prefix`-token
prompt, the context held there (median of `--steps`), and each is profiled once: self time of the linears,
of the attention kernel and of the rest (small ops, dispatch), as shares scaled to the median step. The
linears' own read rate says how close the weight traffic runs to the floor; the rest is what no faster
memory would remove. The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import torch
from torch import nn
from torch.profiler import profile

from infer.round_cost import median_ms
from infer.target import TargetRunner
from pipeline.target import default_aux_layers, load_model, num_layers

LINEAR_OPS = ("mkldnn::_linear_pointwise", "aten::addmm", "aten::mm", "aten::bmm", "aten::mv")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_attention_math",
                 "aten::_scaled_dot_product_efficient_attention",
                 "aten::_scaled_dot_product_flash_attention")


def read_gb_s(mb: int = 256, reps: int = 7) -> float:
    """This machine's memory read rate: a sum over an fp32 buffer far larger than the caches (median)."""
    x = torch.ones(mb * 2 ** 18)
    return x.numel() * 4 / median_ms(x.sum, reps) / 1e6


def linear_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of every distinct nn.Linear weight, of which the linears inside the decoder layers): a tied
    lm_head counts once, as the matrix it reads."""
    seen, total, layers = set(), 0, 0
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear) and mod.weight.data_ptr() not in seen:
            seen.add(mod.weight.data_ptr())
            nbytes = mod.weight.numel() * mod.weight.element_size()
            total += nbytes
            layers += nbytes if ".layers." in f".{name}." else 0
    return total, layers


def anatomy(step, steps: int) -> dict:
    """Median wall ms of `step()` and, from one profiled pass, its linears / attention / rest as ms."""
    for _ in range(8):  # with median_ms's two, ten warm-ups: oneDNN's first calls and the allocator settle
        step()
    ms = median_ms(step, steps)
    with profile() as prof:
        for _ in range(steps):
            step()
    self_us = {e.key: e.self_cpu_time_total for e in prof.key_averages()}
    total = sum(self_us.values())
    lin = sum(v for k, v in self_us.items() if k in LINEAR_OPS)
    att = sum(v for k, v in self_us.items() if k in ATTENTION_OPS)
    return {"step_ms": round(ms, 2), "linears_ms": round(ms * lin / total, 2),
            "attention_ms": round(ms * att / total, 2), "rest_ms": round(ms * (total - lin - att) / total, 2)}


def lean_step(runner: TargetRunner, prompt: torch.Tensor):
    """Our 1-token step, its context held at len(prompt) (the cache length restored after each step)."""
    cache = runner.new_cache()
    runner.forward(prompt, torch.arange(len(prompt)), cache, last_only=True)
    n, tok = len(prompt), prompt[-1:]

    def step():
        runner.forward(tok, torch.tensor([n]), cache)
        cache.length = n
    return step


def hf_step(model, prompt: torch.Tensor):
    """HF's 1-token forward as `generate` calls it (a DynamicCache, use_cache), the appended row dropped
    after each."""
    keep = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    out = model(input_ids=prompt[None], use_cache=True, **keep)
    past, n = out.past_key_values, len(prompt)

    def step():
        model(input_ids=prompt[None, -1:], position_ids=torch.tensor([[n]]), past_key_values=past,
              use_cache=True)
        past.crop(-1)  # drop the token this step appended
    return step


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path("runs/demo/target"))
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.target, getattr(torch, args.dtype))
    runner = TargetRunner(model, default_aux_layers(num_layers(model.config)))
    prompt = torch.arange(args.prefix) % model.config.vocab_size
    rate = read_gb_s()
    weights, in_layers = linear_bytes(model)
    floor_ms = weights / rate / 1e6
    result = {"target": str(args.target), "dtype": args.dtype, "prefix": args.prefix, "threads": args.threads,
              "lean_target": runner.lean is not None, "read_gb_s": round(rate, 1),
              "weights_mb": round(weights / 1e6, 1), "step_floor_ms": round(floor_ms, 2)}
    with torch.no_grad():
        for name, step in (("ours", lean_step(runner, prompt)), ("hf", hf_step(model, prompt))):
            a = anatomy(step, args.steps)
            a["share_of_floor"] = round(floor_ms / a["step_ms"], 3)  # 1.0: the step reads at memory speed
            a["linears_gb_s"] = round(weights / a["linears_ms"] / 1e6, 1) if a["linears_ms"] else None
            result[name] = a
    result["ours_vs_hf"] = round(result["hf"]["step_ms"] / result["ours"]["step_ms"], 3)
    result["layer_weights_mb"] = round(in_layers / 1e6, 1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
