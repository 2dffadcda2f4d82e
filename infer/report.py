"""Eval report: per-benchmark figures from per-turn records (pure), report.md tables, PNG plots."""
from __future__ import annotations

import json
import statistics
from pathlib import Path


def aggregate(records: list[dict], depth: int) -> dict:
    """Records (one per benchmark item turn) -> figures. tau is pooled (ARCHITECTURE.md §8): all generated tokens
    over all verify forwards of the benchmark, bonus tokens included."""
    out = {}
    for bench in dict.fromkeys(r["bench"] for r in records):
        rs = [r for r in records if r["bench"] == bench]
        per_prompt: dict[str, list[int]] = {}
        for r in rs:
            t = per_prompt.setdefault(r["id"], [0, 0])
            t[0] += r["spec_tokens"]
            t[1] += r["rounds"]
        taus = [tok / max(1, n) for tok, n in per_prompt.values()]
        rounds = [a for r in rs for a in r["accepted"]]
        spec_tps = sum(r["spec_tokens"] for r in rs) / max(1e-9, sum(r["spec_seconds"] for r in rs))
        van_tps = sum(r["van_tokens"] for r in rs) / max(1e-9, sum(r["van_seconds"] for r in rs))
        out[bench] = {
            "prompts": len(per_prompt), "turns": len(rs), "generated_tokens": sum(r["spec_tokens"] for r in rs),
            "tau": round(sum(r["spec_tokens"] for r in rs) / max(1, sum(r["rounds"] for r in rs)), 4),
            "tau_mean": round(statistics.fmean(taus), 4), "tau_median": round(statistics.median(taus), 4),
            "accept_by_depth": [round(sum(a > d for a in rounds) / max(1, len(rounds)), 4) for d in range(depth)],
            "tokens_per_s_vanilla": round(van_tps, 2), "tokens_per_s_spec": round(spec_tps, 2),
            "speedup": round(spec_tps / max(1e-9, van_tps), 4),
            "match_rate": round(sum(r["match"] for r in rs) / max(1, len(rs)), 4),
            "drafting_share": round(sum(r.get("drafted", r["rounds"]) for r in rs)
                                    / max(1, sum(r["rounds"] for r in rs)), 4),
        }
        if all("fixed_tokens" in r for r in rs):
            out[bench]["fixed"] = fixed_figures(rs, van_tps)
    return out


def fixed_figures(rs: list[dict], van_tps: float) -> dict:
    """The compared fixed tree on the same turns: pooled tau, tokens/s, speedup over the same vanilla runs."""
    tps = sum(r["fixed_tokens"] for r in rs) / max(1e-9, sum(r["fixed_seconds"] for r in rs))
    return {"tau": round(sum(r["fixed_tokens"] for r in rs) / max(1, sum(r["fixed_rounds"] for r in rs)), 4),
            "tokens_per_s": round(tps, 2), "speedup": round(tps / max(1e-9, van_tps), 4),
            "match_rate": round(sum(r["fixed_match"] for r in rs) / max(1, len(rs)), 4)}


def write_markdown(path: Path, report: dict) -> None:
    s = report["settings"]
    lines = [f"# EAGLE-3 eval: {report['head']}", "",
             f"Target `{report['target']}`; tree top_k={s['top_k']} depth={s['depth']} "
             f"total_tokens={s['total_tokens']} ({s['sizing']}), T={s['temperature']}, "
             f"max_new_tokens={s['max_new_tokens']}. Speedups over the target alone on the same turns; "
             "drafted = share of rounds that ran the draft.", "",
             "| benchmark | prompts | tau | tau mean / median | speedup | drafted | tok/s vanilla | tok/s spec "
             "| greedy match |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, b in report["benchmarks"].items():
        lines.append(f"| {name} | {b['prompts']} | {b['tau']:.2f} | {b['tau_mean']:.2f} / {b['tau_median']:.2f} | "
                     f"{b['speedup']:.2f}x | {b['drafting_share']:.0%} | {b['tokens_per_s_vanilla']:.1f} | "
                     f"{b['tokens_per_s_spec']:.1f} | {b['match_rate']:.0%} |")
    if any("fixed" in b for b in report["benchmarks"].values()):
        shape = f"{s['top_k']}/{s['depth']}/{s['total_tokens']}"
        lines += ["", f"Adaptive beside the fixed tree ({shape} every round):", "",
                  "| benchmark | adaptive speedup | drafted | fixed speedup | adaptive tau | fixed tau |",
                  "| --- | --- | --- | --- | --- | --- |"]
        for name, b in report["benchmarks"].items():
            if "fixed" in b:
                f = b["fixed"]
                lines.append(f"| {name} | {b['speedup']:.2f}x | {b['drafting_share']:.0%} | {f['speedup']:.2f}x | "
                             f"{b['tau']:.2f} | {f['tau']:.2f} |")
    lines += ["", "Acceptance by depth (share of rounds accepting at least d+1 draft tokens):", "",
              "| benchmark | " + " | ".join(f"d{d + 1}" for d in range(s["depth"])) + " |",
              "| --- |" + " --- |" * s["depth"]]
    for name, b in report["benchmarks"].items():
        lines.append(f"| {name} | " + " | ".join(f"{x:.2f}" for x in b["accept_by_depth"]) + " |")
    if report.get("sweep"):
        lines += ["", "## Tree settings sweep", "", "| top_k | depth | total_tokens | tau | speedup |",
                  "| --- | --- | --- | --- | --- |"]
        for r in report["sweep"]:
            lines.append(f"| {r['top_k']} | {r['depth']} | {r['total_tokens']} | {r['tau']:.2f} | {r['speedup']:.2f}x |")
    lines += ["", "Plots: " + ", ".join(f"`{p}`" for p in report["plots"]), ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def write_plots(out_dir: Path, report: dict) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["benchmarks"])
    b = report["benchmarks"]
    files = []

    def save(fig, fname):
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        files.append(fname)

    def bar(fname, key, ylabel, title):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        ax.bar(names, [b[n][key] for n in names], color="#3b7dd8")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        for i, n in enumerate(names):
            ax.text(i, b[n][key], f"{b[n][key]:.2f}", ha="center", va="bottom", fontsize=8)
        save(fig, fname)

    bar("tau.png", "tau", "tokens per verify", "Acceptance length (pooled tau)")
    bar("speedup.png", "speedup", "x vanilla", "Speedup vs vanilla decoding")
    if all("fixed" in b[n] for n in names):
        fig, ax = plt.subplots(figsize=(5, 3.2))
        x = range(len(names))
        ax.bar([i - 0.2 for i in x], [b[n]["speedup"] for n in names], 0.4, label="adaptive", color="#3b7dd8")
        ax.bar([i + 0.2 for i in x], [b[n]["fixed"]["speedup"] for n in names], 0.4, label="fixed",
               color="#9ab8e8")
        ax.axhline(1.0, color="#888", lw=0.8)
        ax.set_xticks(list(x), names)
        ax.set_ylabel("x vanilla")
        ax.set_title("Adaptive vs fixed tree")
        ax.legend(fontsize=8)
        save(fig, "adaptive_vs_fixed.png")
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for n in names:
        ax.plot(range(1, len(b[n]["accept_by_depth"]) + 1), b[n]["accept_by_depth"], marker="o", label=n)
    ax.set_xticks(range(1, report["settings"]["depth"] + 1))
    ax.set_xlabel("draft depth")
    ax.set_ylabel("share of rounds")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by depth")
    ax.legend(fontsize=8)
    save(fig, "accept_by_depth.png")
    if report.get("sweep"):
        rows = report["sweep"]
        labels = [f"{r['top_k']}/{r['depth']}/{r['total_tokens']}" for r in rows]
        fig, ax = plt.subplots(figsize=(max(5, 0.5 * len(rows)), 3.2))
        ax.bar(labels, [r["tau"] for r in rows], color="#9ab8e8", label="tau")
        ax2 = ax.twinx()
        ax2.plot(labels, [r["speedup"] for r in rows], color="#d8593b", marker="o", label="speedup")
        ax.set_xlabel("top_k / depth / total_tokens")
        ax.set_ylabel("tau")
        ax2.set_ylabel("speedup")
        ax.tick_params(axis="x", rotation=45)
        ax.set_title("Tree settings sweep")
        save(fig, "sweep.png")
    return files


def write_report(out_dir: Path, report: dict) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    report["plots"] = write_plots(out_dir, report)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2, ensure_ascii=False))
    write_markdown(out_dir / "report.md", report)
    return report
