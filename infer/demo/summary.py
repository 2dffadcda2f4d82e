"""Demo: the one screen `make demo` ends with, read from what each step wrote under runs/demo/.

    python -m infer.demo.summary [--demo runs/demo] [--seconds N]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def read(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def head_kind(report: dict) -> str:
    return "EAGLE 3.1" if any((report.get("options") or {}).values()) else "EAGLE-3"


def exported(report: dict) -> str:
    """Which exports the trainer wrote, and who loads them (SGLang reads no EAGLE 3.1 option)."""
    names = [Path(p).name for p in (report.get("exports") or {}).values()]
    readers = "vLLM and SGLang" if "head_sglang" in names else "vLLM and our engine"
    return f"{' and '.join(n + '/' for n in names) or 'no export'} load in {readers}"


def lines(demo: Path, seconds: float | None = None) -> list[str]:
    """The summary's lines (pure: files in, text out)."""
    tgt, pipe = read(demo / "target/report.json"), read(demo / "data/summary.json")
    head, dec = read(demo / "head/report.json"), read(demo / "decode.json")
    ev, srv = read(demo / "report/report.json"), read(demo / "serve.json")
    cap = pipe.get("capture", {})
    best = head.get("best") or {}
    chain = f" (chain of {len(best['val_acc'])})" if best.get("val_acc") else ""  # the simulation's length
    out = ["", "EagleRay demo" + (f": done in {seconds / 60:.1f} min" if seconds else ""),
           f"  target    {demo}/target/    {tgt.get('params', 0) / 1e6:.1f}M-parameter Llama, {tgt.get('steps_run')} "
           f"steps, held-out loss {tgt.get('val_loss')}",
           f"  data      {demo}/data/      {cap.get('rows')} conversations, {cap.get('tokens')} tokens of hidden "
           f"states in {cap.get('shards')} zstd Parquet shard(s), draft vocabulary {pipe.get('vocab', {}).get('draft_vocab_size')}",
           f"  head      {demo}/head/      {head_kind(head)}, {head.get('steps')} steps; {exported(head)}; "
           f"held-out simulated tau {best.get('sim_tau', float('nan')):.2f}{chain}"]
    if ev.get("benchmarks"):
        out += [f"  eval      {demo}/report/    report.md, speedup.png, adaptive_vs_fixed.png"]
        out += [f"            {name:<9} tau {b['tau']:.2f}   speedup {b['speedup']:.2f}x" + (
                f" (fixed tree {b['fixed']['speedup']:.2f}x)" if "fixed" in b else "") +
                f", drafted {b.get('drafting_share', 1):.0%} of rounds, identical to the target {b['match_rate']:.0%}"
                for name, b in ev["benchmarks"].items()]
    if dec:
        p = dec["prompts"][0]
        out += [f"  decode    target alone {dec['vanilla_tokens_per_s']} tokens/s, with the head "
                f"{dec['eagle3_tokens_per_s']} ({dec['speedup']:.2f}x), identical {dec['identical']}/{len(dec['prompts'])}",
                f"            Q: {p['prompt'][:90]}", f"            A: {_one_line(p['eagle3'])}"]
    if srv:
        out += [f"  serve     {srv['endpoint']} (openai client, model {srv['model']}), tau {srv['tau']:.2f}",
                f"            Q: {srv['question'][:90]}", f"            A: {_one_line(srv['answer'])}"]
    how = "shipped in data/demo_target/; make demo-target retrains it" if tgt.get("shipped_from") else "trained here"
    out += ["", f"The demo target is a {tgt.get('params', 0) / 1e6:.1f}M-parameter model trained in minutes on generated "
            f"chats ({how}):", "its answers are fluent but often wrong. What the demo shows is the draft head making "
            "the target's own", "output come out faster, token for token identical. Next: README.md \"The stages\" "
            "for your own target and data."]
    if tgt.get("hit_time_cap"):
        out.insert(3, "            (its training hit max_minutes on this machine: `make clean-demo` and "
                      "`make demo-target` for the full recipe)")
    return out


def _one_line(text: str, width: int = 90) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", type=Path, default=Path("runs/demo"))
    ap.add_argument("--seconds", type=float)
    args = ap.parse_args(argv)
    print("\n".join(lines(args.demo, args.seconds)))


if __name__ == "__main__":
    main()
