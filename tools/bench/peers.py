"""Our trainer against the peers' EAGLE-3 trainers on one capture, every head judged by vLLM.

    python -m tools.bench.peers --target runs/peers/target --capture runs/peers/data/capture \
        --peers speculators --epochs 2 --n 40 --out runs/peers/bench

From one capture folder (our shards and draft vocabulary) it writes each peer's input format, trains each
peer's head in the peer's own environment (.peers/NAME, built by `make peers`), trains ours on the same rows
(the rows our trainer holds out are left out of the peers' data too), draft vocabulary and epochs, and
judges every head in vLLM's CPU build (chain, T=0, k=3 and k=7) on the same prompts, and in our engine
(chain k=3) for every head it imports. Each peer runs twice: its own defaults, and aligned to our TTT
length, decay, learning rate and optimizer. `--ours NAME:key=value,...` adds runs of our trainer with
overrides (a recipe switch measured against the rest). A run that fails is reported with its error and the
rest are still judged. The last line printed is one JSON object (docs/BENCHMARKS.md, "Against the peers").

Budgets: every run sees the same rows for the same epochs. Tokens per optimizer step are stated per run:
ours packs length-bucketed micro-batches of at most `data.max_tokens_per_batch` padded tokens and
`data.max_rows_per_batch` rows on each worker; speculators packs rows into one sequence of `--total-seq-len`
tokens, set to the real tokens our run put in a step on average, so both take about as many steps; SpecForge
trains a row a step and accumulates our rows per step (tools/bench/peer_envs/specforge_bench.py).
`train_s` is the trainer's wall time as a user sees it (start-up and export included), `loop_s` its training
epochs alone, validation and checkpoints left out (ours: report.json's `train_loop_s`, whose first epoch also
waits for Ray Data's pipeline to start; speculators: its epoch progress lines; SpecForge: its training
call, model set-up included), which `tokens_per_s` and
`token_ttt_steps_per_s` divide by; `peak_rss_mb` the largest resident memory of its process tree, sampled
every half second.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline.shards import join_captures, read_manifest
from pipeline.yaml_config import load_config
from tools.bench.peer_envs import specforge_bench, speculators_prep
from tools.bench.peer_judging import PEER_KINDS, REPORT, VERSUS, every_run, judge, prompt_sets, versus_peers
from trainer.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]

PEERS_DIR = ROOT / ".peers"


def peak_rss_run(cmd: list[str], log: Path, cwd: Path = ROOT, env: dict | None = None) -> tuple[int, float, float]:
    """Run cmd (output to log, `env` added to ours) -> (exit code, wall seconds, peak RSS of its process tree
    in MB)."""
    import psutil

    peak = [0]
    with log.open("w") as f:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env={**os.environ, **(env or {})})
        done = threading.Event()

        def sample():
            root = psutil.Process(proc.pid)
            while not done.wait(0.5):
                try:
                    procs = [root, *root.children(recursive=True)]
                    peak[0] = max(peak[0], sum(p.memory_info().rss for p in procs if p.is_running()))
                except psutil.Error:
                    pass

        threading.Thread(target=sample, daemon=True).start()
        rc = proc.wait()
        done.set()
    return rc, time.time() - t0, peak[0] / 2 ** 20


def speculators_loop_s(log: Path) -> float | None:
    """Seconds of speculators' training epochs, from its progress lines `Epoch N 100% ... a/a [ H:MM:SS <`
    (the first such line of each epoch is training, the second validation)."""
    seen, total = set(), 0.0
    for m in re.finditer(r"Epoch (\d+) 100% .*?\[ (\d+):(\d\d):(\d\d) <", log.read_text(errors="replace")):
        if m.group(1) not in seen:
            seen.add(m.group(1))
            total += int(m.group(2)) * 3600 + int(m.group(3)) * 60 + int(m.group(4))
    return total or None


def last_lines(log: Path, n: int = 3) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return " | ".join(lines[-n:])[-600:]


def split_overrides(kv: str) -> list[str]:
    """`a=1,b=[0.9,0.999]` -> ["a=1", "b=[0.9,0.999]"]: commas inside brackets belong to the value."""
    return [x for x in re.split(r",(?![^\[]*\])", kv) if x]


def train_ours(name: str, args, overrides: list[str], out: Path) -> dict:
    """Our trainer in a process of its own (its own local Ray), the speculators-format export judged."""
    run_dir = out / name
    base = [f"target={args.target}", f"data.shards={args.capture}", f"out_dir={run_dir}", f"epochs={args.epochs}"]
    if args.seed is not None:  # before the run's own overrides, which may set another
        base += [f"seed={args.seed}", f"data.seed={args.seed}"]
    kind = load_config(TrainConfig, args.ours_config, base + overrides).model.kind
    fmt = "dflash" if kind == "dflash" else "speculators"  # a DFlash head: vLLM's DFlashDraftModel
    base.append(f'export_formats=["{fmt}"]')
    cfg = load_config(TrainConfig, args.ours_config, base + overrides)
    cmd = [sys.executable, "-m", "infer.onpolicy", str(args.ours_config), *base, *overrides]  # `eagleray train`
    rc, secs, rss = peak_rss_run(cmd, out / f"{name}.log", env=args.ray_env)
    head = run_dir / f"head_{fmt}"
    entry = {"kind": "eagleray" if kind == "eagle3" else f"eagleray_{kind}", "overrides": overrides,
             "train_s": round(secs, 1), "peak_rss_mb": round(rss),
             "ttt_steps": cfg.model.ttt_length if kind == "eagle3" else cfg.model.block_size - 1,
             "tokens_per_step": cfg.data.max_tokens_per_batch *
             cfg.scaling.num_workers * cfg.optim.grad_accum, "head": str(head)}  # padded tokens, at most
    entry["status"] = "ok" if rc == 0 and (head / "config.json").is_file() else f"failed: {last_lines(out / f'{name}.log')}"
    if kind == "dflash" and entry["status"] == "ok":  # what speculators' DFlash aligns to
        m = cfg.model
        entry["dflash"] = {"block_size": m.block_size, "num_layers": m.layers, "decay_gamma": m.decay_gamma,
                           "lr": cfg.optim.lr, "anchors": m.anchors, "mask_token_id": json.loads(
                               (head / "config.json").read_text())["dflash_config"]["mask_token_id"],
                           "labels": m.labels, "position_weight": m.position_weight,
                           "dpace_alpha": m.dpace_alpha, "block_causal": m.block_causal}
    if (run_dir / "report.json").is_file():
        report = json.loads((run_dir / "report.json").read_text())
        # loop_s: the epochs' reading and steps, as speculators' epoch bars time them; fit_s: Ray Train's
        # whole run (worker start, DeepSpeed, evaluations, checkpoints)
        entry["loop_s"] = report.get("train_loop_s") or report.get("wall_s")
        entry |= {"fit_s": report.get("wall_s"), "epoch_s": report.get("epoch_train_s"), "steps": report.get("steps")}
        if "onpolicy" in report:  # the rounds' cost beside the offline run's
            op = report["onpolicy"]
            entry["onpolicy"] = {k: op[k] for k in ("extra_target_forwards", "extra_wall_s", "offline_wall_s",
                                                    "decode_tau")}
    return entry


def train_all_ours(args) -> dict[str, dict]:
    """Our default run (unless --no-default) and each --ours run; with --warm-ray inside one local Ray."""
    from contextlib import nullcontext

    from infer.cluster.local import LocalCluster

    args.ray_env = None
    cluster = LocalCluster(workers=0, head_cpus=os.cpu_count() or 2) if args.warm_ray else nullcontext()
    with cluster as warm:  # LocalCluster starts on entry
        if warm is not None:
            args.ray_env = {"RAY_ADDRESS": warm.address}
        entries = {} if args.no_default else {"eagleray": train_ours("eagleray", args, [], args.out)}
        for spec in args.ours:
            name, _, kv = spec.partition(":")
            entries[name] = train_ours(name, args, split_overrides(kv), args.out)
    for e in entries.values():
        e["warm_ray"] = args.warm_ray
    return entries


def tokens_per_step(ours: dict, capture: Path, n_val: int, epochs: int) -> int:
    """The tokens our run put in one optimizer step on average (its steps over the same rows and epochs):
    speculators packs one sequence of this many tokens a step, so both take about as many steps."""
    if ours.get("steps"):  # never below the longest row (a longer row would not fit one packed sequence)
        longest = read_manifest(capture)["max_length"]
        return max(longest, round(speculators_prep.training_tokens(capture, n_val) * epochs / ours["steps"]))
    return ours["tokens_per_step"]


def speculators_runs(args, prep: Path, tokens_per_step: int) -> dict[str, list[str]]:
    """speculators' defaults (TTT 3, its EAGLE 3.1 norms, Muon, lm_head from the target) and the same
    trainer aligned to ours where it takes the setting."""
    ours = args.ours_cfg
    common = ["--speculator-type", "eagle3", "--verifier-name-or-path", str(args.target),
              "--draft-vocab-size", str(speculators_prep.draft_vocab_size(prep)),
              "--d2t-path", str(prep / "d2t.npy"), "--t2d-path", str(prep / "t2d.npy"),
              "--target-layer-ids", *[str(i) for i in speculators_prep.vllm_layer_ids(prep)],
              "--epochs", str(args.epochs), "--train-data-ratio", f"{speculators_prep.train_ratio(prep):.9f}", "--total-seq-len", str(tokens_per_step),
              "--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype", "float32",
              "--num-workers", "0", "--logger", "", "--no-resume-from-checkpoint"]
    if args.seed is not None:
        common += ["--seed", str(args.seed)]
    aligned = ["--ttt-steps", str(ours.model.ttt_length), "--ttt-step-loss-decay", str(ours.model.decay),
               "--lr", str(ours.optim.lr), "--optimizer", "adamw"]
    return {"speculators": common, "speculators_aligned": common + aligned}


def peer_run_wanted(which: str, name: str) -> bool:
    """--peer-runs: a peer's EAGLE-3 run `name` (its defaults, or `*_aligned`) is trained or not."""
    return which == "both" or which != "dflash" and name.endswith("_aligned") == (which == "aligned")


def speculators_dflash_flags(eagle_flags: list[str], dflash: dict, tokens_per_step: int,
                             anchors_per_step: int) -> list[str]:
    """speculators' DFlash (`--speculator-type dflash`) aligned to one of our DFlash runs: its block size,
    layers, slot decay, mask token, learning rate, labels (`ce` = hard, `kl_div` = soft), slot weights
    (D-PACE or the fixed decay) and block causality, on the same rows, vocabulary and epochs as its EAGLE-3
    runs (eagle_flags: speculators_runs' defaults run), packed to that run's tokens per step, with as many
    anchor blocks a step as ours drew (its default, 512 a pack, would give it more). Its defaults differ
    from ours in the last three (hard labels, D-PACE, a causal block). Soft labels with D-PACE: it refuses."""
    flags = list(eagle_flags)
    flags[flags.index("--speculator-type") + 1] = "dflash"
    flags[flags.index("--total-seq-len") + 1] = str(tokens_per_step)
    dpace = dflash.get("position_weight") == "dpace"
    return flags + ["--block-size", str(dflash["block_size"]), "--num-layers", str(dflash["num_layers"]),
                    "--dflash-decay-gamma", str(dflash["decay_gamma"]), "--mask-token-id", str(dflash["mask_token_id"]),
                    "--lr", str(dflash["lr"]), "--optimizer", "adamw", "--max-anchors", str(anchors_per_step),
                    "--loss-fn", "ce" if dflash.get("labels") == "hard" else "kl_div",
                    "--per-position-loss-weight", "dpace" if dpace else "fixed-exp-decay",
                    "--dpace-alpha", str(dflash.get("dpace_alpha", 0.5)),
                    "--no-sliding-window-non-causal" if dflash.get("block_causal") else "--sliding-window-non-causal"]


def train_speculators(name: str, flags: list[str], prep: Path, out: Path) -> dict:
    python = PEERS_DIR / "speculators" / "bin" / "python"
    save = out / name
    entry = {"kind": "speculators", "flags": flags, "head": None}
    if not python.is_file():
        return entry | {"status": "failed: no .peers/speculators (run `make peers`)"}
    cmd = [str(python), str(ROOT / "tools/bench/peer_envs/speculators_train.py"), str(prep), *flags, "--save-path", str(save)]
    rc, secs, rss = peak_rss_run(cmd, out / f"{name}.log")
    epochs = sorted((int(p.name), p) for p in save.glob("[0-9]*") if (p / "config.json").is_file())
    if "--block-size" in flags:  # a DFlash run drafts block_size - 1 tokens a forward
        entry["kind"] = "speculators_dflash"
        ttt = int(flags[flags.index("--block-size") + 1]) - 1
    else:
        ttt = int(flags[flags.index("--ttt-steps") + 1]) if "--ttt-steps" in flags else 3
    entry |= {"train_s": round(secs, 1), "loop_s": speculators_loop_s(out / f"{name}.log"),
              "peak_rss_mb": round(rss), "ttt_steps": ttt,
              "tokens_per_step": int(flags[flags.index("--total-seq-len") + 1])}
    if rc != 0 or not epochs:
        return entry | {"status": f"failed: {last_lines(out / f'{name}.log')}"}
    return entry | {"status": "ok", "head": str(epochs[-1][1])}


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--capture", type=Path, required=True, help="a capture folder: shards, manifest, draft vocab")
    ap.add_argument("--peers", default="speculators", help="comma-separated: speculators, specforge ('' for ours only)")
    ap.add_argument("--peer-runs", choices=["both", "defaults", "aligned", "dflash"], default="both",
                    help="each peer's EAGLE-3 with its own defaults, aligned to ours, or both (the default); "
                         "dflash: none of those, only speculators' DFlash beside each DFlash run of ours")
    ap.add_argument("--add-capture", type=Path, help="a second capture (an on-policy round's): every run trains "
                    "on both, joined in OUT/capture (pipeline/shards.py join_captures)")
    ap.add_argument("--ours-config", type=Path, default=ROOT / "configs/trainer/demo.yaml")
    ap.add_argument("--ours", action="append", default=[], metavar="NAME:key=value,...",
                    help="another run of our trainer with these overrides (repeatable)")
    ap.add_argument("--prompts", type=Path, help="MT-Bench-style or {\"prompt\"} JSONL, or 'held-out': the prompts "
                    "of our trainer's held-out rows of the capture; default: data/ benchmarks")
    ap.add_argument("--tune-prompts", metavar="SOURCES", help="prompts a recipe is chosen on: comma-separated "
                    "mt_bench, gsm8k, ceval, chat (the --data folder's) or jsonl files; judged and reported apart")
    ap.add_argument("--report-prompts", metavar="SOURCES", help="prompts the result is reported on (the top-level "
                    "ratios), from sources --tune-prompts does not name; with --tune-prompts, refused if they share one")
    ap.add_argument("--data", type=Path, help="the folder named sources are read from (default: the repo's data/)")
    ap.add_argument("--n", type=int, default=40, help="prompts per set")
    ap.add_argument("--max-prompt-tokens", type=int, default=512, help="longer prompts are left out (counted)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "runs/peers/bench")
    ap.add_argument("--vllm-python", default=sys.executable)
    ap.add_argument("--no-ours-engine", action="store_true", help="judge in vLLM only")
    ap.add_argument("--seed", type=int, help="every run's seed (ours: seed and data.seed; speculators: --seed); "
                    "default: each trainer's own (ours 0, speculators 42)")
    ap.add_argument("--no-default", action="store_true",
                    help="skip the run of our default recipe (ablations of --ours runs; only with --peers '')")
    ap.add_argument("--warm-ray", action="store_true",
                    help="our runs join one local Ray started before them (as on a running cluster), not each its "
                         "own; stopped before the peers train")
    ap.add_argument("--judge", action="append", default=[], metavar="NAME=HEAD_DIR",
                    help="judge these exported heads only (repeatable), e.g. an earlier run's on other prompts: "
                         "no training")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse(argv)
    args.target, args.capture = args.target.resolve(), args.capture.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.add_capture:  # both captures' rows, for ours and the peers alike
        join_captures(args.capture, args.add_capture.resolve(), args.out / "capture")
        args.capture = args.out / "capture"
    ours_cfg = args.ours_cfg = load_config(TrainConfig, args.ours_config,
                                           [f"target={args.target}", f"data.shards={args.capture}"])
    sets = prompt_sets(args, ours_cfg.data.val_rows)
    if args.judge:
        heads = dict((n, Path(d)) for n, _, d in (j.partition("=") for j in args.judge))
        result = {"sets": {name: {"prompts": ps["spec"], "n": len(ps["ids"]),
                                  "heads": judge(args, heads, ps["ids"], args.out / name)} for name, ps in sets.items()}}
        (args.out / "result.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result))
        return result
    if args.no_default and args.peers:
        raise SystemExit("--no-default: only with --peers '' (the peers' budgets follow our default run)")
    entries = train_all_ours(args)
    peers = [p for p in args.peers.split(",") if p]
    if {"speculators", "specforge"} & set(peers):  # one neutral copy of the rows, read by both peers
        prep = speculators_prep.write(args.capture, args.target, args.out / "speculators_data", ours_cfg.data.val_rows)
    if "speculators" in peers:
        per_step = tokens_per_step(entries["eagleray"], args.capture, ours_cfg.data.val_rows, args.epochs)
        runs = speculators_runs(args, prep, per_step)
        for name, flags in runs.items():
            if peer_run_wanted(args.peer_runs, name):
                entries[name] = train_speculators(name, flags, prep, args.out)
        for name, e in [(n, e) for n, e in entries.items() if "dflash" in e]:  # each DFlash run of ours
            steps = tokens_per_step(e, args.capture, ours_cfg.data.val_rows, args.epochs)
            rows = (read_manifest(args.capture)["rows"] - ours_cfg.data.val_rows) * args.epochs
            anchors = round(e["dflash"]["anchors"] * rows / max(1, e.get("steps") or rows))
            flags = speculators_dflash_flags(runs["speculators"], e["dflash"], steps, anchors)
            entries[f"speculators_{name}"] = train_speculators(f"speculators_{name}", flags, prep, args.out)
    if "specforge" in peers:
        per_row = specforge_bench.rows_per_step(entries["eagleray"], prep, args.epochs)
        for name, overrides in specforge_bench.runs(ours_cfg, per_row, args.epochs, args.seed).items():
            if peer_run_wanted(args.peer_runs, name):
                entries[name] = specforge_bench.train(name, overrides, prep, args.target, args.out, peak_rss_run)
    unknown = [p for p in peers if p not in ("speculators", "specforge")]
    for p in unknown:
        entries[p] = {"kind": p, "status": "failed: not supported by this tool yet", "head": None}

    tokens = speculators_prep.training_tokens(args.capture, ours_cfg.data.val_rows)
    heads = {n: Path(e["head"]) for n, e in entries.items() if e["status"] == "ok"}
    result = {"heads": entries, "epochs": args.epochs, "training_tokens": tokens, "sets": {}}
    for set_name, ps in sets.items():  # the report set last: its scores are the heads' and the top level's
        scores = judge(args, heads, ps["ids"], args.out / set_name) if heads else {}
        kinds = {n: e["kind"] for n, e in entries.items()}
        one = {"prompts": ps["spec"], "n": len(ps["ids"]), "prompts_left_out_too_long": ps["too_long"],
               **versus_peers(kinds, scores), "runs": every_run(kinds, scores), "heads": scores}
        result["sets"][set_name] = one
    report = result["sets"][REPORT]
    result |= {k: report[k] for k in ("prompts", "n", "prompts_left_out_too_long", *VERSUS, "runs")}
    for name, e in entries.items():
        e.update(report["heads"].get(name, {}))
        secs = e.get("loop_s") or e.get("train_s")
        if secs and e["status"] == "ok":  # per second of the training loop where the trainer says it
            e["tokens_per_s"] = round(tokens * args.epochs / secs, 1)
            e["token_ttt_steps_per_s"] = round(tokens * args.epochs * e["ttt_steps"] / secs, 1)
        base = entries.get("eagleray", {})
        if any(o.startswith("onpolicy.start_head=") for o in e.get("overrides", [])):  # rounds on the default's head
            e["train_s_with_start"] = round(e["train_s"] + base.get("train_s", 0), 1)
            if e.get("vllm_tau_k3") and base.get("vllm_tau_k3"):  # the rounds' gain per hour they cost
                e["extra_tau_per_extra_hour"] = round((e["vllm_tau_k3"] - base["vllm_tau_k3"]) * 3600 / e["train_s"], 2)
        secs = e.get("train_s_with_start") or e.get("train_s")
        if e.get("vllm_tau_k3") and secs:  # what a user's hour of training buys, wall time
            e["tau_gain_per_train_hour"] = round((e["vllm_tau_k3"] - 1) * 3600 / secs, 2)
    for key, out in (("token_ttt_steps_per_s", "eagleray_vs_fastest_peer_speed"),
                     ("tau_gain_per_train_hour", "eagleray_vs_best_peer_per_hour")):
        peer = [e[key] for e in entries.values() if e["kind"] in PEER_KINDS and key in e]
        ours = entries.get("eagleray", {}).get(key)
        result[out] = round(ours / max(peer), 4) if peer and ours else None
    for name, e in entries.items():  # each DFlash run of ours against speculators' DFlash aligned to it
        peer = entries.get(f"speculators_{name}", {})
        if "dflash" in e and e.get("vllm_tau_k3") and peer.get("vllm_tau_k3"):
            result[f"{name}_vs_speculators_dflash"] = round(e["vllm_tau_k3"] / peer["vllm_tau_k3"], 4)
    (args.out / "result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
