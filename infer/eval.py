"""python -m infer.eval CONFIG.yaml [key=value ...]

Acceptance length and speedup per benchmark. Prompts are spread over Ray actors, each with its own
target + head; every turn runs vanilla and speculative decoding side by side inside one actor, so each
speedup is a ratio measured on one machine at one time. Writes report.json, report.md and PNG plots.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Literal

from pydantic import Field

from infer.generate import SpecSettings
from pipeline.cluster import check_shared, ensure_ray
from pipeline import storage
from pipeline.yaml_config import (ExistingPath, InputLocation, Location, ModelDtype, StrictModel,
                                  config_arguments, errors_exit, load_or_exit)


class Bench(StrictModel):
    name: str = Field(description="the benchmark's name in the report")
    kind: Literal["mt_bench", "gsm8k", "ceval", "jsonl"] = Field(description="the file's layout")
    path: ExistingPath = Field(description="question.jsonl, test.jsonl, the C-Eval folder or prompts' jsonl")
    limit: int | None = Field(None, gt=0, description="items used; null: all")
    few_shot: int = Field(0, ge=0, description="C-Eval dev examples in the prompt")


class Sweep(StrictModel):
    enabled: bool = Field(False, description="also decode a grid of tree shapes on a few prompts")
    top_k: list[int] = Field([2, 4], description="the grid's top_k values")
    depth: list[int] = Field([4, 6], description="the grid's depths")
    total_tokens: list[int] = Field([8, 16], description="the grid's total_tokens")
    prompts: int = Field(6, gt=0, description="prompts per benchmark in each grid point")


class EvalConfig(StrictModel):
    target: InputLocation = Field(description="the target's Hugging Face folder or a URI")
    head: InputLocation = Field(description="a head folder or a URI")
    out_dir: Location = Field(Path("runs/eval"), description="report.json, report.md, plots: folder or URI")
    benchmarks: list[Bench] = Field(description="the benchmarks to run")
    decode: SpecSettings = SpecSettings()
    # the report's `fixed` columns: the same shape every round, decoded on the same turns
    compare_fixed: bool = Field(True, description="also decode every turn with decode's shape fixed")
    dtype: ModelDtype = Field("auto", description="target and head")
    sweep: Sweep = Sweep()
    num_actors: int = Field(1, gt=0, description="Ray actors, each with a target and head")
    cpus_per_actor: float = Field(1, gt=0, description="Ray CPUs per actor")
    gpus_per_actor: float = Field(0, ge=0, description="Ray GPUs per actor")
    threads_per_actor: int | None = Field(None, description="torch threads of an actor; null: its Ray CPUs")
    resources_per_actor: dict[str, float] = Field(
        {}, description="custom Ray resources, e.g. {eagleray_worker: 1}")
    ray_address: str | None = Field(None, description="null: join $RAY_ADDRESS if set, else a local Ray")


class EvalWorker:
    """Ray actor: one target + head; runs vanilla and speculative decoding on whole items."""

    def __init__(self, target: str, head: str, threads: int | None, use_gpu: bool, dtype: str = "auto",
                 cpu_path: str = "auto"):
        import torch

        from infer.generate import EagleGenerator
        from pipeline.target import torch_dtype

        if threads:
            torch.set_num_threads(threads)
        device = "cuda" if use_gpu else "cpu"
        self.gen = EagleGenerator.from_folders(target, storage.node_copy(head),
                                               dtype=torch_dtype(dtype, device), device=device,
                                               cpu_path=cpu_path)

    def path_line(self) -> str:
        """The generator's start-up line: which path the target and the head run, and why."""
        return self.gen.path_line

    def run(self, bench: str, item: dict, settings: dict, compare_fixed: bool = False) -> list[dict]:
        """Every turn decoded with the target alone, then (compare_fixed) the fixed tree, then `settings`;
        each record holds all of them, so every ratio comes from one actor at one time."""
        tok, recs, history = self.gen.tokenizer, [], []
        spec_s = SpecSettings(**settings)
        van_s = spec_s.model_copy(update={"mode": "vanilla"})
        fixed_s = spec_s.model_copy(update={"sizing": "fixed"}) if compare_fixed else None
        for t, question in enumerate(item["turns"]):
            history.append({"role": "user", "content": question})
            ids = tok.apply_chat_template(history, add_generation_prompt=True, return_dict=True)["input_ids"]
            van = self.gen.generate(ids, van_s)
            rec = {"bench": bench, "id": item["id"], "turn": t, "van_tokens": len(van.tokens),
                   "van_seconds": van.stats.seconds}
            if fixed_s is not None:
                fixed = self.gen.generate(ids, fixed_s)
                rec.update(fixed_record(fixed, van))
            spec = self.gen.generate(ids, spec_s)
            history.append({"role": "assistant", "content": spec.text})  # the model's own answer
            recs.append(dict(rec, spec_tokens=len(spec.tokens), spec_seconds=spec.stats.seconds,
                             rounds=spec.stats.rounds, drafted=spec.stats.rounds - spec.stats.plain_steps,
                             accepted=spec.stats.accepted, match=spec.tokens == van.tokens))
        return recs


def fixed_record(g, van) -> dict:
    """The compared fixed tree's part of a turn's record."""
    return {"fixed_tokens": len(g.tokens), "fixed_seconds": g.stats.seconds, "fixed_rounds": g.stats.rounds,
            "fixed_match": g.tokens == van.tokens}


def load_items(cfg: EvalConfig) -> dict[str, list[dict]]:
    from infer.benchmarks import READERS

    out = {}
    for b in cfg.benchmarks:
        kw = {"few_shot": b.few_shot} if b.kind == "ceval" else {}
        out[b.name] = READERS[b.kind](b.path, b.limit, **kw)
        if not out[b.name]:
            raise ValueError(f"benchmarks: {b.name} ({b.path}) has no items")
    return out


def run_items(pool, jobs: list[tuple[str, dict]], settings: dict, desc: str,
              compare_fixed: bool = False) -> list[dict]:
    from tqdm import tqdm

    records = []
    with tqdm(total=len(jobs), desc=desc, unit="prompt") as bar:
        for recs in pool.map_unordered(lambda a, job: a.run.remote(job[0], job[1], settings, compare_fixed), jobs):
            records += recs
            bar.update(1)
    return records


def evaluate(cfg: EvalConfig) -> dict:
    import ray
    from ray.util import ActorPool

    from infer.report import aggregate, write_report

    storage.check("head", cfg.head, must_exist=True)  # before any work: one line naming the key
    storage.check("target", cfg.target, must_exist=True)
    storage.check("out_dir", cfg.out_dir, writable=True)
    print(f"eval: {ensure_ray(cfg.ray_address)}", flush=True)
    check_shared({"target": cfg.target, "head": cfg.head})  # the actors' (the report is written here)
    items = load_items(cfg)
    # An actor lost with its node is restarted and its prompt decoded again (each prompt's record is
    # written once, by the call that returns); its constructor's arguments are strings, passed inline.
    worker = ray.remote(num_cpus=cfg.cpus_per_actor, num_gpus=cfg.gpus_per_actor, resources=cfg.resources_per_actor,
                        max_restarts=-1, max_task_retries=-1)(EvalWorker)
    head = str(storage.absolute(cfg.head))
    actors = [worker.remote(str(storage.absolute(cfg.target)), head, cfg.threads_per_actor,
                            cfg.gpus_per_actor > 0, cfg.dtype, cfg.decode.cpu_path)
              for _ in range(cfg.num_actors)]
    print(f"eval: {ray.get(actors[0].path_line.remote())}", flush=True)
    pool = ActorPool(actors)
    settings = cfg.decode.model_dump()
    jobs = [(name, it) for name, its in items.items() for it in its]
    compare = cfg.compare_fixed and cfg.decode.sizing == "adaptive" and cfg.decode.mode != "vanilla"
    report = {"target": storage.redact(cfg.target), "head": storage.redact(cfg.head), "settings": settings,
              "benchmarks": aggregate(run_items(pool, jobs, settings, "eval", compare), cfg.decode.depth)}
    if cfg.sweep.enabled:
        sub = [(name, it) for name, its in items.items() for it in its[: cfg.sweep.prompts]]
        report["sweep"] = []
        for k, d, n in itertools.product(cfg.sweep.top_k, cfg.sweep.depth, cfg.sweep.total_tokens):
            s = dict(settings, top_k=k, depth=d, total_tokens=n, sizing="fixed")  # a sweep of shapes
            agg = aggregate([dict(r, bench="all") for r in run_items(pool, sub, s, f"sweep {k}/{d}/{n}")], d)["all"]
            report["sweep"].append({"top_k": k, "depth": d, "total_tokens": n, "tau": agg["tau"],
                                    "speedup": agg["speedup"], "match_rate": agg["match_rate"]})
    for a in actors:
        ray.kill(a)
    files = storage.Mirror(cfg.out_dir)
    report = write_report(files.local, report)
    files.push()
    return report


def main(argv: list[str] | None = None) -> dict:
    args = config_arguments("python -m infer.eval", __doc__).parse_args(argv)
    cfg = load_or_exit(EvalConfig, args.config, args.overrides)
    with errors_exit("eval"):
        report = evaluate(cfg)
    per = "; ".join(f"{n} tau {b['tau']:.2f}, {b['speedup']:.2f}x" + (
        f" (fixed {b['fixed']['speedup']:.2f}x)" if "fixed" in b else "") + f", identical {b['match_rate']:.0%}"
        for n, b in report["benchmarks"].items())
    print(f"[eval] {per}; {storage.redact(storage.join(cfg.out_dir, 'report.md'))}", flush=True)
    return report


if __name__ == "__main__":
    main()
