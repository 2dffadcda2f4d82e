"""Flywheel benchmark: one round of learning from served traffic, the swap under load, judged.

    python -m tools.bench.flywheel --traffic GSM8K/train.jsonl [--preset demo|smollm2] [--target T] [--head H]
        [--served 400] [--judge 40] [--speed 20] [--out runs/bench_flywheel]

After `make demo` (or SmolLM2's starter head, `--preset smollm2`): the preset's endpoint (configs/serve/, its
target and head, traffic log on) answers `--served` questions of one domain (GSM8K's train split, not
shipped: data/README.md "Larger corpora"), then one flywheel round (configs/flywheel/: log -> pipeline ->
train -> gate) runs against it, and its swap step runs while 16 clients send requests without pause. Judged
afterwards on prompts no round saw, GSM8K test questions (the domain) and MT-Bench and C-Eval (the others):
old head against new, tau on the fixed tree; and the decode speed of the served policy (the endpoint's
speculative settings, adaptive) over the target alone, each output compared with the target alone's.
Last line: one JSON object.
"""
from __future__ import annotations

import argparse
import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from infer.benchmarks import read_gsm8k
from pipeline import storage

ROOT = Path(__file__).resolve().parents[2]


def serve_traffic(url: str, model: str, prompts: list[str], max_tokens: int, concurrency: int = 4) -> int:
    import openai

    c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    ask = lambda p: c.chat.completions.create(model=model, messages=[{"role": "user", "content": p}],  # noqa: E731
                                              max_tokens=max_tokens, temperature=0)
    with ThreadPoolExecutor(concurrency) as pool:
        return sum(1 for r in pool.map(ask, prompts) if r.choices[0].message.content is not None)


def wait_logged(cfg, n: int, timeout: float = 120) -> int:
    from infer.flywheel import endpoint_call

    deadline, written = time.time() + timeout, 0
    while time.time() < deadline:
        written = endpoint_call(cfg, "/health")[1]["traffic_log"]["logged"]
        if written >= n:
            break
        time.sleep(0.5)
    return written


class Load:
    """`clients` threads sending chat requests without pause until stopped; what each answer's usage names."""

    def __init__(self, url: str, model: str, prompts: list[str], clients: int = 16, max_tokens: int = 32):
        import openai

        self.c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        self.model, self.prompts, self.max_tokens = model, prompts, max_tokens
        self.stop, self.results, self.errors = threading.Event(), [], []
        self.threads = [threading.Thread(target=self._client, args=(i,)) for i in range(clients)]

    def _client(self, i: int) -> None:
        k = i
        while not self.stop.is_set():
            p = self.prompts[k % len(self.prompts)]
            k += len(self.threads)
            try:
                r = self.c.chat.completions.create(model=self.model, messages=[{"role": "user", "content": p}],
                                                   max_tokens=self.max_tokens, temperature=0)
                self.results.append((time.time(), p, r.choices[0].message.content,
                                     (r.usage.model_extra or {}).get("head_version")))  # vLLM's names none
            except Exception as e:  # the goal is none: each is counted and shown
                self.errors.append(repr(e)[:200])

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()


def broken_head(src: Path, dst: Path) -> Path:
    """A copy of a head whose weights file is not safetensors."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    return dst


def control_head(cfg, rnd, out: Path) -> str:
    """The control: the serving head trained as many steps on its old shards alone (no traffic) -> its folder.
    What the round gains beyond it is the traffic's; the rest is more training."""
    from infer.flywheel import derived_yaml
    from trainer.config import TrainConfig
    from trainer.driver import run_training
    from pipeline.yaml_config import load_config

    steps = json.loads(storage.read_text(storage.join(rnd.dir, "head", "report.json")))["steps"]
    path = derived_yaml(cfg.trainer, out / "control.yaml", {
        "out_dir": str(out / "control"), "data.shards": str(storage.absolute(cfg.replay.shards)),
        "model.init_from": rnd.state["steps"]["log"]["head"], "max_steps": steps, "epochs": 100})
    tcfg = load_config(TrainConfig, path, cfg.trainer_overrides)
    run_training(tcfg)
    return str(out / "control" / f"head_{tcfg.export_formats[0]}")


def vllm_swap(target: Path, old: str, new: str, prompts: list[str], port: int) -> dict:
    """The vllm backend takes a new head by redeploying (Ray Serve's rolling update of the app), under the
    same 16 clients: how many requests fail, and how long the redeploy takes."""
    from ray import serve

    from infer.serve import start
    from tools.bench.serve import deployment

    cfg = deployment("vllm", target, Path(old), port, 3, 2)  # Serve's one HTTP proxy keeps its first port
    url = start(cfg)
    with Load(url, cfg.model_name, prompts) as load:
        time.sleep(5)
        t0 = time.time()
        start(cfg.model_copy(update={"head": Path(new)}))
        t1 = time.time()
        time.sleep(5)
    serve.delete(cfg.app_name)
    return {"requests": len(load.results) + len(load.errors), "failed": len(load.errors),
            "answered_before_redeploy_returned": sum(1 for r in load.results if r[0] < t1),
            "answered_after": sum(1 for r in load.results if r[0] >= t1), "redeploy_s": round(t1 - t0, 1),
            "errors": load.errors[:3]}


def judged(n: int) -> list[dict]:
    """The judged benchmarks, `n` prompts each: GSM8K test (the domain), MT-Bench and C-Eval (the others)."""
    return [{"name": "gsm8k", "kind": "gsm8k", "path": ROOT / "data/gsm8k/test.jsonl", "limit": n},
            {"name": "mt_bench", "kind": "mt_bench", "path": ROOT / "data/mt_bench/question.jsonl", "limit": n},
            {"name": "ceval", "kind": "ceval", "path": ROOT / "data/ceval", "limit": n}]


def judge(target: Path, old: str, new: str, n: int, out: Path, dtype: str = "auto") -> dict:
    from infer.gate import GateConfig, run_gate

    return run_gate(GateConfig(target=target, serving=old, candidate=new, benchmarks=judged(n), out_dir=out,
                               decode={"sizing": "fixed", "max_new_tokens": 64}, dtype=dtype, threads_per_actor=2))


def speed(scfg, head: str, n: int, out: Path) -> dict:
    """The served policy (the endpoint's speculative settings) over the target alone, on `n` prompts of each
    judged benchmark (infer/eval.py: both decode every turn in one actor) -> {benchmark: speedup, identical}."""
    from infer.eval import EvalConfig, evaluate

    decode = scfg.speculative.model_dump() | {"max_new_tokens": 96}
    report = evaluate(EvalConfig(target=scfg.target, head=head, out_dir=out, benchmarks=judged(n), decode=decode,
                                 compare_fixed=False, dtype=scfg.dtype, threads_per_actor=2))
    return {name: {"speedup": b["speedup"], "tau": b["tau"], "identical": b["match_rate"] == 1.0}
            for name, b in report["benchmarks"].items()}


def speed_keys(timed: dict) -> dict:
    """The JSON's speed keys: the domain's (GSM8K) before and after the round, the other benchmarks'."""
    if not timed:
        return {}
    other = lambda side: {n: b["speedup"] for n, b in timed[side].items() if n != "gsm8k"}  # noqa: E731
    return {"domain_speedup_before": timed["before"]["gsm8k"]["speedup"],
            "domain_speedup_after": timed["after"]["gsm8k"]["speedup"],
            "other_speedup_before": other("before"), "other_speedup_after": other("after"),
            "speed_tau": {side: {n: b["tau"] for n, b in t.items()} for side, t in timed.items()}}


PRESETS = {"demo": ("configs/serve/demo.yaml", "configs/flywheel/demo.yaml"),
           "smollm2": ("configs/serve/smollm2.yaml", "configs/flywheel/smollm2.yaml")}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="demo",
                    help="the endpoint (configs/serve/) and round (configs/flywheel/) configs, target and head")
    ap.add_argument("--target", type=Path, help="null: the preset's serve config's")
    ap.add_argument("--head", type=Path, help="null: the preset's serve config's")
    ap.add_argument("--traffic", type=Path, help="the served questions: GSM8K's train.jsonl (not shipped)")
    ap.add_argument("--served", type=int, default=400, help="traffic requests served before the round")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--judge", type=int, default=40, help="prompts of each judged benchmark")
    ap.add_argument("--speed", type=int, default=20, help="prompts of each benchmark timed; 0: no timing")
    ap.add_argument("--config", type=Path, help="the round's config; null: the preset's")
    ap.add_argument("--out", type=Path, default=ROOT / "runs/bench_flywheel")
    ap.add_argument("--skip", nargs="*", default=[], choices=["control", "vllm"],
                    help="control: no replay-only head; vllm: no redeploy of the vllm backend")
    ap.add_argument("--vllm-only", type=Path, metavar="CANDIDATE",
                    help="only the vllm backend's redeploy from --head to this head folder")
    args = ap.parse_args(argv)
    serve_yaml, round_yaml = (ROOT / p for p in PRESETS[args.preset])
    args.config = args.config or round_yaml
    from infer.cluster.local import free_port
    from infer.flywheel import (STEPS, FlywheelConfig, Round, endpoint_call, serving, step_gate, step_log,
                                step_pipeline, step_swap, step_train)
    from infer.serve import ServeConfig, start
    from pipeline.yaml_config import load_config

    port = free_port()
    given = [f"target={args.target}"] * bool(args.target) + [f"head={args.head}"] * bool(args.head)
    scfg = load_config(ServeConfig, serve_yaml, given + [
        f"port={port}", "num_cpus_per_replica=0",
        f"traffic_log.path={args.out / 'traffic'}", "traffic_log.flush_rows=64", "traffic_log.flush_s=1"])
    scfg = scfg.model_copy(update={"target": storage.absolute(scfg.target), "head": storage.absolute(scfg.head)})
    args.target, args.head = scfg.target, scfg.head

    if args.vllm_only:
        from infer.serve import stop

        load_prompts = [it["turns"][0] for it in read_gsm8k(ROOT / "data/gsm8k/test.jsonl", 64)]
        result = {"vllm_redeploy": vllm_swap(args.target, str(args.head), str(args.vllm_only), load_prompts,
                                             port)}
        stop()
        print(json.dumps(result), flush=True)
        return result
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    url = start(scfg)
    cfg = load_config(FlywheelConfig, args.config, [f"endpoint={url}", f"work_dir={args.out / 'flywheel'}"])
    if args.traffic is None or not args.traffic.is_file():
        raise SystemExit(f"--traffic {args.traffic}: need GSM8K's train.jsonl (or any jsonl of 'question' rows)")
    prompts = [it["turns"][0] for it in read_gsm8k(args.traffic, args.served)]
    t0 = time.time()
    served = serve_traffic(url, scfg.model_name, prompts, args.max_tokens)
    logged = wait_logged(cfg, served)
    serve_s = time.time() - t0
    print(f"[bench] served {served} requests in {serve_s:.0f} s; {logged} logged", flush=True)

    t0 = time.time()
    rnd = Round(cfg.work_dir)
    rnd.run("log", step_log, cfg, serving(cfg))
    for name, step in (("pipeline", step_pipeline), ("train", step_train), ("gate", step_gate)):
        rnd.run(name, step, cfg)
    load_prompts = [it["turns"][0] for it in read_gsm8k(ROOT / "data/gsm8k/test.jsonl", 64)]
    with Load(url, scfg.model_name, load_prompts) as load:
        time.sleep(3)
        if rnd.state["steps"]["gate"]["promote"]:
            rnd.run("swap", step_swap, cfg)
        else:  # measured all the same: the swap is half the benchmark; the JSON keeps the gate's verdict
            print(f"[bench] the gate kept the serving head ({rnd.state['steps']['gate']['reasons']}); swapping "
                  "anyway to measure the swap", flush=True)
            rnd.run("swap", lambda r, c: dict(endpoint_call(c, "/v1/admin/head", {
                "head": r.state["steps"]["train"]["candidate"]})[1], forced=True), cfg)
        swapped_at = time.time()
        time.sleep(3)
        round_s = time.time() - t0 - 6  # the load's own 6 s of pauses are not the round's
        broken = broken_head(args.head, args.out / "head_broken")  # refused while the new head serves on
        refused = endpoint_call(cfg, "/v1/admin/head", {"head": str(broken)})
        time.sleep(2)
    old, new = rnd.state["steps"]["log"]["head_version"], rnd.state["steps"]["swap"]["head_version"]
    texts: dict[str, set] = {}
    for _, p, text, _ in load.results:
        texts.setdefault(p, set()).add(text)
    report = judge(args.target, str(args.head), rnd.state["steps"]["train"]["candidate"], args.judge, args.out,
                   scfg.dtype)
    sets = report["sets"]
    from ray import serve

    from infer.serve import stop

    serve.delete(scfg.app_name)
    timed = {}
    if args.speed:
        timed = {side: speed(scfg, head, args.speed, args.out / f"speed_{side}") for side, head in
                 (("before", str(args.head)), ("after", rnd.state["steps"]["train"]["candidate"]))}
    control = None
    if "control" not in args.skip:
        ctl = judge(args.target, str(args.head), control_head(cfg, rnd, args.out), args.judge, args.out / "judge_control",
                    scfg.dtype)
        control = {n: {"tau": s["candidate_tau"], "ratio": s["ratio"]} for n, s in ctl["sets"].items()}
    vllm = None if "vllm" in args.skip else vllm_swap(args.target, str(args.head),
                                                     rnd.state["steps"]["train"]["candidate"], load_prompts,
                                                     scfg.port)
    stop()
    result = {
        "served_records": logged,
        "swap": {"requests": len(load.results) + len(load.errors), "failed": len(load.errors),
                 "answered_by_old": sum(1 for r in load.results if r[3] == old),
                 "answered_by_new": sum(1 for r in load.results if r[3] == new), "errors": load.errors[:3],
                 "broken_head": {"status": refused[0], "error": refused[1].get("error", {}).get("message", "")[:120]}},
        "domain_tau_before": sets["gsm8k"]["serving_tau"], "domain_tau_after": sets["gsm8k"]["candidate_tau"],
        "domain_ratio": sets["gsm8k"]["ratio"],
        "other_tau_before": {n: s["serving_tau"] for n, s in sets.items() if n != "gsm8k"},
        "other_tau_after": {n: s["candidate_tau"] for n, s in sets.items() if n != "gsm8k"},
        "other_ratio": {n: s["ratio"] for n, s in sets.items() if n != "gsm8k"},
        **speed_keys(timed),
        "identical": report["identical"] and rnd.state["steps"]["gate"]["identical"]
        and all(len(t) == 1 for t in texts.values()) and all(b["identical"] for t in timed.values() for b in t.values()),
        "gate": {k: rnd.state["steps"]["gate"][k] for k in ("sets", "promote", "reasons")},
        "control_replay_only": control, "vllm_redeploy": vllm,
        "round_s": round(round_s, 1), "steps_s": {s: rnd.state["steps"][s]["seconds"] for s in STEPS[:5]},
        "serve_traffic_s": round(serve_s, 1), "swap_at_s": round(swapped_at - t0, 1)}
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
