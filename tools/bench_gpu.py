"""Component benchmark on a GPU at Llama-3.1-8B shapes with random bf16 weights (README "GPU").

    python tools/bench_gpu.py [--shape llama8b|tiny] [--out FILE] [--budget-s 480] [--sections a,b] [--profile]

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
from pipeline.target import LogitRule, default_aux_layers
from trainer.cost import step_flops
from trainer.head import Eagle3Head, head_config_from_target
from trainer.target_parts import TargetParts
from trainer.ttt import TTTObjective, target_distribution, target_rows, ttt_attention
from trainer.ttt_flash import flash_available, ttt_attention_flash

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


def top_ops(run: Run, fn, calls: int = 2, top: int = 20) -> dict:
    """fn run `calls` times under torch.profiler: the ops with the most self time on the device (the CPU
    where there is no GPU), in ms per call, and the total."""
    from torch.profiler import ProfilerActivity, profile

    cuda = run.device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(calls):
            fn()
        run.sync()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    # on a GPU the kernels alone: an aten op's device time is its kernels' again
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0
              and (not cuda or str(getattr(e, "device_type", "")).endswith("CUDA"))]
    events.sort(key=lambda e: -getattr(e, attr))
    return {"total_ms": round(sum(getattr(e, attr) for e in events) / 1e3 / calls, 2),
            "ops": [[e.key[:80], round(getattr(e, attr) / 1e3 / calls, 2), e.count // calls]
                    for e in events[:top]]}


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


def attention_check(run: Run, model, shape: dict, ttt: int) -> dict:
    """The TTT attention of the last step (ttt - 1 diagonal key blocks) at the target's head shape, bf16:
    forward + backward time and peak memory on the flash kernel and on the blocked reference, and each one's
    output and gradients against the blocked reference in fp32 (max abs error over the reference's max)."""
    cfg, dev = model.config, run.device
    h, b, t = cfg.num_attention_heads, shape["rows"], shape["seq"]
    d = cfg.hidden_size // h
    gen = torch.Generator(device=dev).manual_seed(0)
    leaves = [torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16, generator=gen)
              for _ in range(2 * ttt + 1)]
    w = torch.randn(b, h, t, d, device=dev, dtype=torch.bfloat16, generator=gen)

    def run_kind(kind: str, dtype):
        xs = [x.to(dtype).requires_grad_() for x in leaves]
        q, keys, vals = xs[0], xs[1:ttt + 1], xs[ttt + 1:]
        if kind == "flash":
            out = ttt_attention_flash(q, keys, vals)
        else:
            causal = torch.full((t, t), float("-inf"), device=dev, dtype=dtype).triu(1)
            out = ttt_attention(q, keys, vals, causal)
        return [out.detach(), *torch.autograd.grad((out * w.to(dtype)).sum(), xs)]

    ref = run_kind("blocked", torch.float32)
    res = {"shape": [b, h, t, d], "diagonal_blocks": ttt - 1}
    kinds = ["flash", "blocked"] if flash_available(leaves[0]) else ["blocked"]
    for kind in kinds:
        got = run_kind(kind, torch.bfloat16)
        errs = [float((g.float() - r).abs().max() / r.abs().max()) for g, r in zip(got, ref)]
        del got
        if dev.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        ms = run.ms(lambda: run_kind(kind, torch.bfloat16), max(3, run.reps // 2))
        res[kind] = {"fwd_bwd_ms": ms, "out_rel_err": round(errs[0], 6),
                     "grad_rel_err_max": round(max(errs[1:]), 6),
                     "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2 ** 30, 2)
                     if dev.type == "cuda" else None}
    return res


def seeded_head(cfg, vd: int, dev: torch.device, ttt: int, attention: str = "auto", compiled: bool = False):
    """The same bf16 head in every train section (so their losses compare), its objective, and a function
    that takes one AdamW step on a batch (the objective's arguments) and returns its loss."""
    hc = head_config_from_target(cfg, vd)
    torch.manual_seed(0)
    head = Eagle3Head(hc).to(dev, torch.bfloat16)
    head.set_vocab(torch.zeros(vd, dtype=torch.long), torch.arange(cfg.vocab_size) < vd)
    objective = TTTObjective(head, ttt, 0.8, attention, compiled)
    opt = torch.optim.AdamW(head.parameters(), lr=1e-4, **({"fused": True} if dev.type == "cuda" else {}))

    def train_on(*batch) -> float:
        loss = objective(*batch)["loss"]
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return hc, head, objective, train_on


def train_step(run: Run, model, shape: dict, ttt: int, peak_tflops: float, attention: str = "auto",
               compiled: bool = False) -> dict:
    """One TTT step as trainer/loop.py runs it (target lm_head on the rows read, objective, backward, AdamW),
    with the head in bf16 and AdamW's state in the parameters' dtype (DeepSpeed's bf16 keeps fp32 master
    weights; its optimizer step is not what is measured here). attention: the objective's kernel choice.
    compiled: the objective's pieces through torch.compile (`model.compile`)."""
    cfg, dev, vd = model.config, run.device, shape["draft_vocab"]
    hc, head, objective, train_on = seeded_head(cfg, vd, dev, ttt, attention, compiled)
    flash = attention == "flash" or (attention == "auto" and flash_available(head.fc.weight, hc.head_dim))
    whole = TargetParts(model.model.embed_tokens.weight, model.lm_head.weight, None, LogitRule.of(cfg), cfg)
    parts = whole.to(dev, torch.bfloat16, bf16_hidden=True)  # as trainer/loop.py on a GPU, bf16 shards
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    rows, seq = shape["rows"], shape["seq"]
    gen = torch.Generator(device=dev).manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (rows, seq), device=dev, generator=gen)
    aux = torch.randn(rows, seq, 3 * cfg.hidden_size, device=dev, dtype=torch.bfloat16, generator=gen)
    last = torch.randn(rows, seq, cfg.hidden_size, device=dev, dtype=torch.bfloat16, generator=gen)
    mask = torch.zeros(rows, seq, dtype=torch.long, device=dev)
    mask[:, seq // 4:] = 1  # a quarter of each row is prompt
    losses = []

    def target_side():
        with torch.no_grad():
            need, row = target_rows(mask)
            p, am = target_distribution(parts.logits(last[need]), head.t2d)
        return parts.embed(ids), p, am, row

    def step():
        emb, p, am, row = target_side()
        losses.append(train_on(aux, emb, p, am, row, mask))

    t_compile = time.perf_counter()
    step()  # untimed in every section (a compiled one compiles here), so their loss lists compare
    t_compile = time.perf_counter() - t_compile
    t_step = run.ms(step)
    profiled = top_ops(run, step) if run.profile else None
    t_target = run.ms(target_side)
    emb, _, _, row = target_side()
    # a compiled objective would compile again for no_grad: its loss pair is left out
    loss_of = None if compiled else (lambda p, am: float(objective(aux, emb, p, am, row, mask)["loss"]))
    checks = fp32_lm_head_check(run, whole, parts, last[target_rows(mask)[0]], head.t2d, loss_of)
    flops = step_flops(hc, ttt).batch(rows, seq, int(mask.sum()))
    target_flops = int(mask.sum()) * step_flops(hc, ttt).per_target_row
    return {"attention": "flash" if flash else "blocked", "ttt": ttt, "rows": rows, "seq": seq, "draft_vocab": vd,
            "step_ms": t_step, "tokens_per_s": round(rows * seq / t_step * 1e3), "target_lm_head_ms": t_target,
            **checks, "tflops": round(flops / t_step / 1e9, 1), "mfu": round(flops / t_step / 1e9 / peak_tflops, 3),
            "head_only_mfu": round((flops - target_flops) / max(t_step - t_target, 1e-6) / 1e9 / peak_tflops, 3),
            "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2 ** 30, 1) if dev.type == "cuda" else None,
            "first_last_loss": [round(losses[0], 4), round(losses[-1], 4)], "losses": [round(x, 5) for x in losses],
            **({"profile": profiled} if profiled else {}),
            **({"compile_s": round(t_compile, 1)} if compiled else {})}


@torch.no_grad()
def fp32_lm_head_check(run: Run, whole: TargetParts, parts: TargetParts, last: torch.Tensor, t2d: torch.Tensor,
                       loss_of) -> dict:
    """The trainer's bf16 target lm_head (`parts`) against the fp32 one it replaced on a GPU: the fp32 one's
    time, the logits' largest difference (relative to their largest value) and, where `loss_of(p, argmax)`
    is given, the objective's loss on each one's target table."""
    parts32 = whole.to(run.device, torch.bfloat16)  # the fp32 lm_head (CPU, or shards stored above bf16)
    t_lm32 = run.ms(lambda: parts32.logits(last))
    a, b = parts.logits(last), parts32.logits(last)
    pair = None
    if loss_of is not None:
        pair = [round(loss_of(*target_distribution(x, t2d)), 6) for x in (a, b)]
    err = float((a - b).abs().max() / b.abs().max())
    return {"target_lm_head_fp32_ms": t_lm32, "target_logits_rel_err_vs_fp32": err, "loss_vs_fp32_lm_head": pair}


def train_shapes(run: Run, model, shape: dict, ttt: int) -> dict:
    """The trainer's batches change shape from step to step (length buckets): eager against compiled
    (`model.compile`) over [rows, seq] shapes holding the same tokens. Per mode: the first pass over the
    shapes in seconds (a compiled objective compiles, then recompiles with dynamic dims), then each shape's
    median step in ms. The batches are random (the target side is not what is measured)."""
    cfg, dev, vd = model.config, run.device, shape["draft_vocab"]
    tokens, r0 = shape["rows"] * shape["seq"], shape["rows"]
    mix = [(r, tokens // r) for r in (r0, 2 * r0, 4 * r0, max(1, r0 // 2))]
    gen = torch.Generator(device=dev).manual_seed(0)
    batches = []
    for rows, seq in mix:
        mask = torch.zeros(rows, seq, dtype=torch.long, device=dev)
        mask[:, seq // 4:] = 1
        need, row = target_rows(mask)
        p = torch.softmax(torch.randn(int(need.sum()), vd, device=dev, generator=gen), -1)
        am = torch.randint(0, vd, (int(need.sum()),), device=dev, generator=gen)
        aux = torch.randn(rows, seq, 3 * cfg.hidden_size, device=dev, dtype=torch.bfloat16, generator=gen)
        emb = torch.randn(rows, seq, cfg.hidden_size, device=dev, dtype=torch.bfloat16, generator=gen)
        batches.append((aux, emb, p, am, row, mask))
    res = {"shapes": [f"{r}x{t}" for r, t in mix]}
    for compiled in (False, True):
        train_on = seeded_head(cfg, vd, dev, ttt, "auto", compiled)[3]
        t0 = time.perf_counter()
        for batch in batches:
            train_on(*batch)
        run.sync()
        first = time.perf_counter() - t0
        res["compiled" if compiled else "eager"] = {
            "first_pass_s": round(first, 1),
            "step_ms": {f"{r}x{t}": run.ms(lambda b=b: train_on(*b), 3) for (r, t), b in zip(mix, batches)}}
    return res


def target_costs(run: Run, model, aux_ids: list[int], prefix: int, lean: bool, exact: bool = False) -> dict:
    """Our TargetRunner: the 1-token step and n-node verifies after `prefix` tokens, timed as
    measure_round_costs times them. exact: the lean forward's exact verify (the decoder's default)."""
    runner = TargetRunner(model, aux_ids, lean=lean, exact_verify=exact)
    if lean and runner.lean is None:
        return {"skipped": "the lean forward refused this target (see the log line)"}
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
    target = TargetRunner(model, aux_ids, lean=False)
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
