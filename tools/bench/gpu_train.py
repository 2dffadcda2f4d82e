"""The training sections of tools/bench/gpu.py (docs/BENCHMARKS.md "GPU"): the TTT attention on the flash kernel and on
the blocked reference against fp32, one TTT step (either kernel, compiled or not, profiled on request), and
the step over batch shapes that change. Each takes bench_gpu's `Run` (device, sync, timing, --profile)."""
from __future__ import annotations

import time

import torch

from pipeline.target import LogitRule
from trainer.cost import step_flops
from trainer.head import Eagle3Head, head_config_from_target
from trainer.target_parts import TargetParts
from trainer.ttt import TTTObjective, target_distribution, target_rows, ttt_attention
from trainer.ttt_flash import flash_available, ttt_attention_flash


def top_ops(run, fn, calls: int = 2, top: int = 20) -> dict:
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


def attention_check(run, model, shape: dict, ttt: int) -> dict:
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


def train_step(run, model, shape: dict, ttt: int, peak_tflops: float, attention: str = "auto",
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
    cost = step_flops(hc, ttt)
    flops = cost.batch(rows, seq, int(mask.sum()))
    target_flops = int(mask.sum()) * cost.per_target_row
    return {"attention": "flash" if flash else "blocked", "ttt": ttt, "rows": rows, "seq": seq, "draft_vocab": vd,
            "step_ms": t_step, "tokens_per_s": round(rows * seq / t_step * 1e3), "target_lm_head_ms": t_target,
            **checks, "tflops": round(flops / t_step / 1e9, 1), "mfu": round(flops / t_step / 1e9 / peak_tflops, 3),
            "head_only_mfu": round((flops - target_flops) / max(t_step - t_target, 1e-6) / 1e9 / peak_tflops, 3),
            "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 2 ** 30, 1) if dev.type == "cuda" else None,
            "first_last_loss": [round(losses[0], 4), round(losses[-1], 4)], "losses": [round(x, 5) for x in losses],
            **({"profile": profiled} if profiled else {}),
            **({"compile_s": round(t_compile, 1)} if compiled else {})}


@torch.no_grad()
def fp32_lm_head_check(run, whole: TargetParts, parts: TargetParts, last: torch.Tensor, t2d: torch.Tensor,
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


def train_shapes(run, model, shape: dict, ttt: int) -> dict:
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
