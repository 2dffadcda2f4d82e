"""The peers tool's judging half (tools/bench/peers.py): the prompt sets, every head's vLLM tau on them
and our run's ratios to the best peer.

Sets are split by source (`--tune-prompts` / `--report-prompts`, infer/benchmarks.py `disjoint_sets`): a
recipe is chosen on one and reported on the other; the report set's ratios are the JSON's top level.
"""
from __future__ import annotations

from pathlib import Path

from infer.benchmarks import chat_ids, default_prompts, disjoint_sets, prompt_file, prompt_set
from tools.bench.peer_envs import speculators_prep


def judge(args, heads: dict[str, Path], prompts: list[list[int]], out: Path) -> dict[str, dict]:
    """vLLM's chain tau at each k for every head, and our engine's at k=3 where it imports the head."""
    from infer.checks import vllm_interop as check_vllm
    from infer.generate import EagleGenerator

    res: dict[str, dict] = {name: {} for name in heads}
    for k in (3, 7):
        work = out / f"vllm_k{k}"
        work.mkdir(parents=True, exist_ok=True)
        runs = check_vllm.run_vllm(args.vllm_python, args.target, heads, prompts, k, args.max_new_tokens, work)
        for name, r in runs.items():
            res[name][f"vllm_tau_k{k}"] = check_vllm.tau_from_counts(r["drafts"], r["accepted"])
            res[name][f"accept_by_pos_k{k}"] = check_vllm.by_pos(r)
    if not args.no_ours_engine:
        for name, head in heads.items():
            try:
                gen = EagleGenerator.from_folders(args.target, head)
            except ValueError as err:
                res[name]["ours_engine_k3"] = f"not imported: {err}"
                continue
            r = check_vllm.run_ours(gen, prompts, 3, args.max_new_tokens)
            res[name]["ours_engine_tau_k3"] = check_vllm.tau_from_counts(r["drafts"], r["accepted"])
    return res


HELD_OUT = "held-out"
REPORT, TUNE = "report", "tune"
PEER_KINDS = ("speculators", "specforge")
VERSUS = ("eagleray_vs_best_peer", "eagleray_vs_best_peer_k7", "eagleray_vs_best_peer_pos1")


def versus_peers(kinds: dict[str, str], scores: dict[str, dict], ours_name: str = "eagleray") -> dict:
    """Our run's (default: the default recipe's) vLLM tau (k=3, k=7) and its acceptance at the first draft
    position (k=3) over the best peer's, on one prompt set; None where either is missing."""
    def ratio(get):
        peer = [v for n, s in scores.items() if kinds.get(n) in PEER_KINDS and (v := get(s)) is not None]
        ours = get(scores.get(ours_name, {}))
        return round(ours / max(peer), 4) if peer and ours else None

    first = lambda s: (s.get("accept_by_pos_k3") or [None])[0]  # noqa: E731
    return dict(zip(VERSUS, (ratio(lambda s: s.get("vllm_tau_k3")), ratio(lambda s: s.get("vllm_tau_k7")),
                             ratio(first))))


def every_run(kinds: dict[str, str], scores: dict[str, dict]) -> dict[str, dict]:
    """Each of our other runs (--ours) against the best peer (`versus_peers`) and our default run (k=3 tau)."""
    out = {}
    for name in scores:
        if kinds.get(name, "").startswith("eagleray") and name != "eagleray":
            base, tau = scores.get("eagleray", {}).get("vllm_tau_k3"), scores[name].get("vllm_tau_k3")
            out[name] = {**versus_peers(kinds, scores, name),
                         "vs_default": round(tau / base, 4) if tau and base else None}
    return out


def prompt_sets(args, val_rows: int) -> dict[str, dict]:
    """The prompt sets judged, report last: --report-prompts (with --tune-prompts, split by source), else
    --prompts (a file, or held-out rows), else the tool's default MT-Bench + GSM8K list. Each: its spec, token
    ids (at most --n of at most --max-prompt-tokens), and how many were too long."""
    if args.report_prompts and args.prompts:
        raise SystemExit("--prompts and --report-prompts: one or the other")
    if args.tune_prompts and not args.report_prompts:
        raise SystemExit("--tune-prompts needs --report-prompts (the set the result is reported on)")
    if args.report_prompts:
        tune, report = (disjoint_sets(args.tune_prompts, args.report_prompts, args.data) if args.tune_prompts
                        else ([], prompt_set(args.report_prompts, args.data)))
        texts = {TUNE: (args.tune_prompts, tune)} if args.tune_prompts else {}
        texts[REPORT] = (args.report_prompts, report)
    elif str(args.prompts) == HELD_OUT:
        texts = {REPORT: (HELD_OUT, None)}
    else:
        texts = {REPORT: (str(args.prompts or "data/ (MT-Bench + GSM8K)"),
                          prompt_file(args.prompts) if args.prompts else default_prompts(None, 4 * args.n))}
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(args.target)
    sets = {}
    for name, (spec, items) in texts.items():
        ids = held_out_prompts(args.capture, val_rows) if items is None else [chat_ids(tok, t) for t in items]
        short = [p for p in ids if len(p) <= args.max_prompt_tokens]
        sets[name] = {"spec": spec, "ids": short[: args.n], "too_long": len(ids) - len(short)}
    return sets


def held_out_prompts(capture: Path, n_val: int) -> list[list[int]]:
    """The prompts of our held-out rows, as the target saw them: each row's ids up to its first loss token
    (the first turn and the assistant's header), for judging heads on text like their training data."""
    prompts = []
    for row in speculators_prep.training_rows(capture, n_val, held_out=True):
        first = next((i for i, m in enumerate(row["loss_mask"]) if m), None)
        if first:
            prompts.append(list(row["input_ids"][:first]))
    return prompts
