"""Component benchmark on a GPU at Llama-3.1-8B shapes with random bf16 weights (docs/BENCHMARKS.md "GPU").

    python -m tools.bench.gpu [--shape llama8b|tiny] [--out FILE] [--budget-s 480] [--sections a,b] [--profile]

In one run, on one device:
- the hardware's own limits (a large bf16 GEMM, a device-to-device copy);
- capture (pipeline/hidden.py) tokens/s against a bare base-model forward and a forward with logits;
- the TTT attention on the flash kernel and on the blocked reference, each against fp32;
- one TTT training step of an EAGLE-3 head (trainer/ttt.py's objective, the target lm_head rows it reads,
  AdamW) in tokens/s and MFU against the measured GEMM peak: on either attention kernel, and on a GPU also
  compiled (`model.compile`) and over batch shapes that change;
- decode components: our TargetRunner's 1-token step and 16/32/64-node tree verifies after a 1024-token
  prefix, on the HF forward and on the lean forward; the draft's level and ingest; HF generate;
- the cost model's speedup tau x T_step / (T_verify + levels x T_level + T_ingest) at tau 3-6, and the
  1-token step against its floor (the weights' bytes over the measured copy rate).

Random weights say nothing about acceptance: tau is an input here, not a measurement. The lent GPU image has
torch and transformers but not Ray, DeepSpeed or pydantic, so this imports none of them. `--shape tiny`
runs the same code on CPU in seconds (tests/test_bench_gpu.py). Results are written to --out after every
section (a run cut short keeps what it measured); the last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from infer.draft import DraftRunner
from infer.round_cost import draft_times, median_ms, target_times
from infer.target import TargetRunner
from pipeline.hidden import capture_hidden, to_host
from pipeline.target import default_aux_layers
from trainer.head import Eagle3Head, head_config_from_target

from tools.bench.gpu_train import attention_check, train_shapes, train_step

SHAPES = {  # Llama-3.1-8B's shape (RoPE scaling left out: it does not change a kernel's cost)
    "llama8b": {"config": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                               max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False),
                "draft_vocab": 32000, "rows": 4, "seq": 2048, "prefix": 1024, "gemm": 8192},
    "tiny": {"config": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=2048, max_position_embeddings=4096,
                            tie_word_embeddings=False),
             "draft_vocab": 512, "rows": 2, "seq": 64, "prefix": 64, "gemm": 512},
}
TAUS = (3.0, 4.0, 5.0, 6.0)
VERIFY_NODES = (16, 32, 64)


class Run:
    """The device, its sync, the result tree written to `out` after each section, and the time budget."""

    def __init__(self, device: str, out: Path | None, budget_s: float, reps: int, only: set[str] | None = None,
                 profile: bool = False):
        self.device, self.out, self.budget_s, self.reps = torch.device(device), out, budget_s, reps
        self.only, self.profile = only, profile
        self.sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        self.t0, self.result = time.perf_counter(), {}

    def ms(self, fn, reps: int | None = None) -> float:
        return round(median_ms(fn, reps or self.reps, self.sync), 3)

    def section(self, name: str, fn, *args) -> None:
        """Run one section; its error is recorded (one line) instead of ending the run."""
        left = self.budget_s - (time.perf_counter() - self.t0)
        if self.only is not None and name not in self.only and name != "hardware":
            return
        if left <= 0:
            self.result[name] = {"skipped": "time budget spent"}
        else:
            try:
                self.result[name] = fn(self, *args)
            except Exception as e:  # a section that breaks on this device must not lose the others
                self.result[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        self.result["elapsed_s"] = round(time.perf_counter() - self.t0, 1)
        if self.out is not None:
            self.out.write_text(json.dumps(self.result, indent=1))
        print(f"[{self.result['elapsed_s']:7.1f}s] {name}: {json.dumps(self.result[name])[:600]}", flush=True)


def hardware(run: Run, n: int) -> dict:
    a = torch.randn(n, n, device=run.device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=run.device, dtype=torch.bfloat16)
    gemm = run.ms(lambda: a @ b, 10)
    src = torch.empty(2 ** 30 if run.device.type == "cuda" else 2 ** 24, dtype=torch.uint8, device=run.device)
    dst = torch.empty_like(src)
    copy = run.ms(lambda: dst.copy_(src), 10)
    out = {"bf16_gemm_tflops": 2 * n ** 3 / gemm / 1e9, "gemm_n": n,  # unrounded: MFUs divide by it
           "copy_gb_s": round(2 * src.numel() / copy / 1e6, 1)}  # bytes read + written
    if run.device.type == "cuda":
        out["name"] = torch.cuda.get_device_name()
    return out


def random_target(shape: dict, device: torch.device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**shape["config"])
    cfg._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval()


def forward_flops(model, tokens: int, context: float, logits: bool) -> float:
    """2 x multiply-adds of the decoder layers (+ lm_head) per token, plus attention over `context` keys."""
    c = model.config
    layers = sum(p.numel() for p in model.model.layers.parameters())
    attn = 4 * c.num_hidden_layers * c.num_attention_heads * (c.hidden_size // c.num_attention_heads) * context
    return tokens * (2 * layers + attn + (2 * c.hidden_size * c.vocab_size if logits else 0))


@torch.no_grad()
def capture(run: Run, model, aux_ids: list[int], rows: int, seq: int, peak_tflops: float) -> dict:
    ids = torch.randint(3, model.config.vocab_size, (rows, seq), device=run.device)
    n = rows * seq
    bare = run.ms(lambda: model.model(input_ids=ids, use_cache=False))
    full = run.ms(lambda: model(input_ids=ids, use_cache=False))
    cap = run.ms(lambda: capture_hidden(model, ids, None, aux_ids))
    host = run.ms(lambda: [t.cpu() for t in capture_hidden(model, ids, None, aux_ids)])
    pinned = run.ms(lambda: [to_host(t) for t in capture_hidden(model, ids, None, aux_ids)])
    flops = forward_flops(model, n, seq / 2, logits=False)
    return {"tokens": n, "rows": rows, "seq": seq,
            "tokens_per_s": {"bare_forward": round(n / bare * 1e3), "forward_with_logits": round(n / full * 1e3),
                             "capture": round(n / cap * 1e3), "capture_to_host": round(n / host * 1e3),
                             "capture_to_host_pinned": round(n / pinned * 1e3)},
            "capture_vs_bare": round(bare / cap, 3), "capture_to_host_vs_bare": round(bare / host, 3),
            "capture_to_host_pinned_vs_bare": round(bare / pinned, 3),
            "bare_forward_mfu": round(flops / bare / 1e9 / peak_tflops, 3)}


def target_costs(run: Run, model, aux_ids: list[int], prefix: int, lean: bool, exact: bool = False) -> dict:
    """Our TargetRunner: the 1-token step and n-node verifies after `prefix` tokens, timed as
    measure_round_costs times them. exact: the lean forward's exact verify (the decoder's default)."""
    runner = TargetRunner(model, aux_ids, cpu_path="auto" if lean else "generic", exact_verify=exact)
    if lean and runner.lean is None:
        return {"skipped": f"the lean forward refused this target: {runner.path.reason}"}
    info = {"exact_attention": runner.lean.exact_attention, "row_wise": runner.lean.row_wise} if exact else {}
    ids = torch.randint(3, model.config.vocab_size, (prefix + max(VERIFY_NODES),))
    times, _ = target_times(runner, ids, prefix, (1, *VERIFY_NODES), run.reps, run.sync)
    return {**info, "step_ms": round(times[0], 3),
            **{f"verify{n}_ms": round(t, 3) for n, t in zip(VERIFY_NODES, times[1:])}}


def draft_costs(run: Run, model, aux_ids: list[int], shape: dict, top_k: int, depth: int) -> dict:
    cfg, dev, p = model.config, run.device, shape["prefix"]
    head = Eagle3Head(head_config_from_target(cfg, shape["draft_vocab"])).to(dev, torch.bfloat16).eval()
    draft = DraftRunner(head, model.model.embed_tokens.weight)
    ids = torch.randint(3, cfg.vocab_size, (p + 1,))
    target = TargetRunner(model, aux_ids, cpu_path="generic")
    _, aux = target.forward(ids[:p], torch.arange(p), target.new_cache(), last_only=True)  # the prefix's aux
    d = draft_times(draft, aux, ids, p, top_k, run.reps, run.sync, depth=depth, total_tokens=64)
    return {"top_k": top_k, "depth": depth, "ingest3_ms": round(d["ingest"], 3), "tree_ms": round(d["tree"], 3),
            "level_ms": round(d["level"], 3)}


@torch.no_grad()
def hf_generate(run: Run, model, prefix: int, new: int, static: bool) -> dict:
    ids = torch.randint(3, model.config.vocab_size, (1, prefix), device=run.device)
    kw = {"max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    if static:  # transformers compiles the forward for a static cache on a GPU
        kw["cache_implementation"] = "static"
    t0 = time.perf_counter()
    model.generate(ids, **kw)
    run.sync()
    first = time.perf_counter() - t0
    ms = run.ms(lambda: model.generate(ids, **kw), 3)
    return {"ms_per_token": round(ms / new, 3), "tokens_per_s": round(new / ms * 1e3, 1),
            "first_call_s": round(first, 1), "new_tokens": new, "prefix": prefix}


def model_speedup(res: dict, levels: int) -> dict:
    """tau x T_step / (T_verify + levels x T_level + T_ingest) per target path, verify size and tau."""
    d = res.get("draft", {})
    if "level_ms" not in d:
        return {}
    out = {}
    for path in ("target_hf", "target_lean"):
        t = res.get(path, {})
        if "step_ms" not in t:
            continue
        for n in VERIFY_NODES:
            round_ms = t[f"verify{n}_ms"] + levels * d["level_ms"] + d["ingest3_ms"]
            out[f"{path}_n{n}"] = {str(tau): round(tau * t["step_ms"] / round_ms, 2) for tau in TAUS}
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None, help="JSON written after every section")
    ap.add_argument("--budget-s", type=float, default=480, help="sections that would start later are skipped")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ttt", type=int, default=7)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--levels", type=int, default=6, help="draft levels per round in the cost model")
    ap.add_argument("--new-tokens", type=int, default=64, help="HF generate's tokens")
    ap.add_argument("--sections", default=None, help="comma-separated sections to run (hardware always runs)")
    ap.add_argument("--profile", action="store_true", help="train sections: the ops with the most device time")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    only = set(args.sections.split(",")) if args.sections else None
    run = Run(args.device, args.out, args.budget_s, args.reps, only, args.profile)
    import transformers

    run.result["shape"] = {"name": args.shape, **shape}
    run.result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    run.section("hardware", hardware, shape["gemm"])
    peak = run.result["hardware"].get("bf16_gemm_tflops", float("nan"))  # nan: MFUs unknown, not an error
    model = random_target(shape, run.device)
    aux_ids = default_aux_layers(model.config.num_hidden_layers)
    weight_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    run.result["weights_gb"] = round(weight_bytes / 1e9, 2)
    run.section("capture", capture, model, aux_ids, shape["rows"], shape["seq"], peak)
    run.section("ttt_attention", attention_check, model, shape, args.ttt)
    run.section("train", train_step, model, shape, args.ttt, peak)
    run.section("train_blocked", train_step, model, shape, args.ttt, peak, "blocked")
    run.section("target_hf", target_costs, model, aux_ids, shape["prefix"], False)
    run.section("target_lean", target_costs, model, aux_ids, shape["prefix"], True)
    run.section("target_lean_exact", target_costs, model, aux_ids, shape["prefix"], True, True)
    run.section("draft", draft_costs, model, aux_ids, shape, args.top_k, args.levels)
    run.section("hf_generate", hf_generate, model, shape["prefix"], args.new_tokens, False)
    copy = run.result["hardware"].get("copy_gb_s")
    if copy:  # a 1-token step reads every weight once: bytes / (copy rate / 2, it counts read + write)
        run.result["step_floor_ms"] = round(weight_bytes / (copy / 2) / 1e6, 3)
    run.result["model_speedup"] = model_speedup(run.result, args.levels)
    if run.device.type == "cuda":  # compiles: minutes on a CPU
        run.section("train_compiled", train_step, model, shape, args.ttt, peak, "auto", True)
        run.section("train_shapes", train_shapes, model, shape, args.ttt)
        run.section("hf_generate_static_compiled", hf_generate, model, shape["prefix"], args.new_tokens, True)
    print(json.dumps(run.result))
    return run.result


if __name__ == "__main__":
    main()
