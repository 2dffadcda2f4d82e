"""python -m infer.gate CONFIG.yaml [key=value ...] — promote a candidate head only when it beats the serving one.

Both heads decode the same prompts, after the target alone decodes each: the held-out served records (what
the endpoint was asked most recently, never trained on) and each benchmark's first turns. The decision:
- identical: every output of both heads equals the target alone's, token for token;
- traffic: candidate tau >= serving tau * min_gain on the held-out records;
- benchmarks: no benchmark's candidate tau below serving tau * (1 - max_drop).
Tau is read on the fixed tree (`decode.sizing: fixed`), which holds no timing, so a gate run on one machine
decides the same every time. Writes gate.json; the last line printed is its decision.
"""
from __future__ import annotations

import json
from pathlib import Path

from pydantic import Field

from infer.eval import Bench, EvalWorker
from infer.generate import SpecSettings
from pipeline import storage
from pipeline.cluster import check_shared, ensure_ray
from pipeline.yaml_config import (InputLocation, Location, ModelDtype, StrictModel, config_arguments, errors_exit,
                                  load_or_exit)

HELD_OUT = "traffic"  # the held-out served records' name in gate.json


class GateConfig(StrictModel):
    target: InputLocation = Field(description="the target's Hugging Face folder or a URI")
    serving: InputLocation = Field(description="the head the endpoint serves now: folder or URI")
    candidate: InputLocation = Field(description="the head that would replace it: folder or URI")
    held_out: InputLocation | None = Field(None, description="held-out served records (ingest's held_out.jsonl): "
                                                              "file or URI")
    held_out_limit: int | None = Field(None, gt=0, description="held-out records used; null: all")
    benchmarks: list[Bench] = Field([], description="benchmarks no head may fall on")
    decode: SpecSettings = SpecSettings(sizing="fixed", max_new_tokens=64)
    min_gain: float = Field(1.05, gt=0, description="candidate/serving tau on the held-out records, at least")
    max_drop: float = Field(0.02, ge=0, lt=1, description="a benchmark's tau may fall by this share at most")
    out_dir: Location = Field(Path("runs/gate"), description="gate.json: folder or URI")
    dtype: ModelDtype = Field("auto", description="target and heads")
    num_actors: int = Field(1, gt=0, description="Ray actors, each with the target and both heads")
    cpus_per_actor: float = Field(1, gt=0, description="Ray CPUs per actor")
    threads_per_actor: int | None = Field(None, description="torch threads of an actor; null: its Ray CPUs")
    ray_address: str | None = Field(None, description="null: join $RAY_ADDRESS if set, else a local Ray")


class GateWorker(EvalWorker):
    """Ray actor: eval's worker with the serving head, and the candidate over the same target."""

    def __init__(self, target: str, serving: str, candidate: str, threads: int | None, dtype: str = "auto"):
        from infer.generate import EagleGenerator
        from pipeline.target import torch_dtype

        super().__init__(target, serving, threads, False, dtype)
        self.serving = self.gen
        cand = storage.node_copy(candidate)
        try:
            self.candidate = self.serving.with_head(cand)
        except ValueError:  # other aux layers: a target runner of its own
            self.candidate = EagleGenerator.from_folders(storage.node_copy(target), cand,
                                                         dtype=torch_dtype(dtype, "cpu"))

    def run(self, name: str, item: dict, settings: dict) -> dict:
        s = SpecSettings(**settings)
        ids = self.serving.tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True,
                                                         return_dict=True)["input_ids"]
        van = self.serving.generate(ids, s.model_copy(update={"mode": "vanilla"})).tokens
        out = {"set": name, "id": item["id"]}
        for side, gen in (("serving", self.serving), ("candidate", self.candidate)):
            g = gen.generate(ids, s)
            out[side] = {"tokens": g.stats.new_tokens, "rounds": g.stats.rounds, "match": g.tokens == van}
        return out


def held_out_items(loc, limit: int | None) -> list[dict]:
    """Held-out served records (a file or a URI) -> prompts: each record's messages up to (not with) its
    last answer."""
    items = []
    for line in storage.read_text(loc).splitlines():
        if line.strip():
            rec = json.loads(line)
            msgs = rec["messages"]
            while msgs and msgs[-1]["role"] == "assistant":
                msgs = msgs[:-1]
            if msgs:
                items.append({"id": rec["id"], "messages": msgs})
    return items[:limit]


def prompt_sets(cfg: GateConfig) -> dict[str, list[dict]]:
    from infer.eval import load_items

    sets = {HELD_OUT: held_out_items(cfg.held_out, cfg.held_out_limit)} if cfg.held_out else {}
    for name, items in (load_items(cfg) if cfg.benchmarks else {}).items():
        sets[name] = [{"id": it["id"], "messages": [{"role": "user", "content": it["turns"][0]}]} for it in items]
    empty = [n for n, items in sets.items() if not items]
    if empty or not sets:
        raise ValueError(f"gate: no prompts in {', '.join(empty) or 'held_out nor benchmarks'}")
    return sets


def decide(records: list[dict], min_gain: float, max_drop: float) -> dict:
    """Per-set tau of both heads and the decision (the module's rules) from the workers' records."""
    sets: dict[str, dict] = {}
    for r in records:
        agg = sets.setdefault(r["set"], {"prompts": 0, "serving": [0, 0], "candidate": [0, 0], "identical": True})
        agg["prompts"] += 1
        for side in ("serving", "candidate"):
            agg[side][0] += r[side]["tokens"]
            agg[side][1] += r[side]["rounds"]
            agg["identical"] &= r[side]["match"]
    out, reasons = {}, []
    for name, agg in sets.items():
        serv, cand = (agg[s][0] / max(1, agg[s][1]) for s in ("serving", "candidate"))
        out[name] = {"prompts": agg["prompts"], "serving_tau": round(serv, 4), "candidate_tau": round(cand, 4),
                     "ratio": round(cand / serv, 4), "identical": agg["identical"]}
        if not agg["identical"]:
            reasons.append(f"{name}: output differs from the target alone's")
        if name == HELD_OUT and cand < serv * min_gain:
            reasons.append(f"{name}: tau {cand:.3f} vs {serv:.3f}, below the min_gain {min_gain}x")
        if name != HELD_OUT and cand < serv * (1 - max_drop):
            reasons.append(f"{name}: tau {cand:.3f} vs {serv:.3f}, falls more than max_drop {max_drop:.0%}")
    return {"sets": out, "identical": all(s["identical"] for s in out.values()), "promote": not reasons,
            "reasons": reasons}


def run_gate(cfg: GateConfig) -> dict:
    import ray
    from ray.util import ActorPool
    from tqdm import tqdm

    for key in ("serving", "candidate", "held_out"):
        if getattr(cfg, key) is not None:
            storage.check(key, getattr(cfg, key), must_exist=True)
    storage.check("out_dir", cfg.out_dir, writable=True)
    storage.check("target", cfg.target, must_exist=True)
    sets = prompt_sets(cfg)
    print(f"gate: {ensure_ray(cfg.ray_address)}", flush=True)
    check_shared({"target": cfg.target, "serving": cfg.serving, "candidate": cfg.candidate})
    worker = ray.remote(num_cpus=cfg.cpus_per_actor, max_restarts=-1, max_task_retries=-1)(GateWorker)
    loc = lambda x: str(storage.absolute(x))  # noqa: E731
    actors = [worker.remote(str(storage.absolute(cfg.target)), loc(cfg.serving), loc(cfg.candidate),
                            cfg.threads_per_actor or int(cfg.cpus_per_actor), cfg.dtype) for _ in range(cfg.num_actors)]
    jobs = [(name, it) for name, items in sets.items() for it in items]
    settings, records = cfg.decode.model_dump(), []
    with tqdm(total=len(jobs), desc="gate", unit="prompt") as bar:
        for rec in ActorPool(actors).map_unordered(lambda a, j: a.run.remote(j[0], j[1], settings), jobs):
            records.append(rec)
            bar.update(1)
    for a in actors:
        ray.kill(a)
    result = {"serving": storage.redact(cfg.serving), "candidate": storage.redact(cfg.candidate),
              "min_gain": cfg.min_gain, "max_drop": cfg.max_drop, "decode": settings,
              **decide(records, cfg.min_gain, cfg.max_drop)}
    storage.write_bytes(storage.join(cfg.out_dir, "gate.json"), json.dumps(result, indent=2).encode())
    return result


def summary_line(result: dict) -> str:
    per = "; ".join(f"{n} tau {s['serving_tau']:.2f} -> {s['candidate_tau']:.2f}" for n, s in result["sets"].items())
    verdict = "promote" if result["promote"] else "keep the serving head: " + "; ".join(result["reasons"])
    return f"[gate] {per}; identical {result['identical']}; {verdict}"


def main(argv: list[str] | None = None) -> dict:
    args = config_arguments("python -m infer.gate", __doc__).parse_args(argv)
    cfg = load_or_exit(GateConfig, args.config, args.overrides)
    with errors_exit("gate"):
        result = run_gate(cfg)
    print(summary_line(result), flush=True)
    return result


if __name__ == "__main__":
    main()
