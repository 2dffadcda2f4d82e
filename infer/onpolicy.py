"""eagleray train CONFIG.yaml [key=value ...] — the trainer's run, then its on-policy rounds.

With `onpolicy.rounds: 0` (the default) this is `python -m trainer`. With rounds, out_dir holds:
  offline/     the trainer's run on data.shards, as `python -m trainer` makes it (none with start_head)
  prompts/     the prompts: onpolicy.pipeline's ingest sources, every prompt the offline records hold left out
  round-NNN/   decode    the current head decodes the round's fresh prompts with our engine (Ray Data actors
                         over the target, `resources_per_actor`): the target's own answers (lossless) and the
                         head's acceptance per drafting round, as served records (pipeline/served.py)
               data      those records through tokenize, capture and vocab (the pipeline's, no regeneration)
               head      a warm start from the current head on data/ beside `replay_share` of the offline shards
  head_<fmt>/  the last round's head (what eval, serve and vLLM load); report.json: every step's cost
Each step is recorded in state.json when it ends, so a run cut short resumes at the step it was in. Each
round reports its cost in target forwards (prefill plus verify forwards of the decode, one per captured
sequence) and wall time, and the current head's tau on the fresh prompts it decoded (docs/ARCHITECTURE.md
§6, "On-policy rounds").
"""
from __future__ import annotations

import io
import json
import time

from infer.flywheel import beside, derived_yaml
from pipeline import storage
from pipeline.yaml_config import config_arguments, errors_exit, load_config, load_or_exit
from trainer.config import TrainConfig


class RoundDecoder:
    """Ray Data actor: the target and the current head; a batch of prompts -> served records."""

    def __init__(self, target: str, head: str, dtype: str, threads: int | None, settings: dict):
        import torch

        from infer.generate import EagleGenerator, SpecSettings
        from pipeline.target import torch_dtype

        if threads:
            torch.set_num_threads(threads)
        from trainer.export import head_version

        local = storage.node_copy(head)
        self.gen = EagleGenerator.from_folders(storage.node_copy(target), local, dtype=torch_dtype(dtype, "cpu"))
        self.settings = SpecSettings(**settings)
        self.version = head_version(local)

    def __call__(self, batch: dict) -> dict:
        import ray

        from pipeline.served import served_row

        node, rows = ray.get_runtime_context().get_node_id(), []
        for rid, messages in zip(batch["id"], batch["messages"]):
            msgs = json.loads(messages)
            ids = self.gen.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)["input_ids"]
            t0 = time.time()
            g = self.gen.generate(ids, self.settings)
            st = g.stats
            rows.append(served_row(
                request_id=rid, model="onpolicy", route="chat", messages=msgs, prompt_tokens=len(ids),
                output_ids=g.tokens, output_text=g.text, finish_reason=g.finish_reason or "length", temperature=0.0,
                depth=st.depth, accepted=st.accepted, round_starts=st.round_starts, tau=st.tau,
                head_version=self.version, started_at=t0, finished_at=time.time()) | {"rounds": st.rounds, "node": node})
        return {k: [r[k] for r in rows] for k in rows[0]} if rows else {}


def prompt_of(messages: list[dict]) -> list[dict]:
    """A conversation -> the request of its first answer: the turns before the first assistant turn."""
    out = []
    for m in messages:
        if m["role"] == "assistant":
            break
        out.append(m)
    return out if any(m["role"] == "user" for m in out) else []


def step_prompts(cfg: TrainConfig, out) -> dict:
    """Every prompt of the pipeline's sources, shuffled by its seed, less those of the offline records."""
    from pipeline.config import PipelineConfig
    from pipeline.ingest import run_ingest

    pcfg = load_config(PipelineConfig, cfg.onpolicy.pipeline)
    ingest = pcfg.ingest.model_copy(update={"sources": [s.model_copy(update={"max_records": None, "weight": None})
                                                        for s in pcfg.ingest.sources], "total_records": None})
    local = storage.Mirror(storage.join(out, "prompts")).local
    stats = run_ingest(ingest, local, prompt_only=True)
    offline = beside(cfg.data.shards, "ingest", "records.jsonl")
    seen = set()
    if storage.is_file(offline):
        for line in storage.read_text(offline).splitlines():
            if line.strip():
                seen.add(json.dumps(prompt_of(json.loads(line)["messages"])))
    kept, overlap = [], 0
    for line in (local / "records.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line)
        prompt = prompt_of(rec["messages"])
        key = json.dumps(prompt)
        if not prompt or key in seen:
            overlap += bool(prompt)
            continue
        seen.add(key)
        kept.append({"id": rec["id"], "messages": json.dumps(prompt, ensure_ascii=False)})
    storage.write_text(storage.join(out, "prompts", "prompts.jsonl"), "".join(json.dumps(k) + "\n" for k in kept))
    need = cfg.onpolicy.rounds * cfg.onpolicy.records_per_round
    if len(kept) < cfg.onpolicy.records_per_round:
        raise ValueError(f"onpolicy.pipeline: {len(kept)} fresh prompts, a round needs records_per_round "
                         f"{cfg.onpolicy.records_per_round}")
    return {"read": stats["read"], "fresh": len(kept), "offline_overlap": overlap, "needed": need}


def step_decode(cfg: TrainConfig, out, r: int, head: str, max_new: int) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from pipeline.served import SERVED_SCHEMA

    op, n = cfg.onpolicy, cfg.onpolicy.records_per_round
    lines = storage.read_text(storage.join(out, "prompts", "prompts.jsonl")).splitlines()
    start = ((r - 1) * n) % len(lines)  # past the last fresh prompt, rounds reuse them from the start
    items = [json.loads(x) for x in (lines + lines)[start:start + n]]
    settings = {"mode": op.mode, "top_k": op.top_k, "depth": op.depth, "total_tokens": op.total_tokens,
                "sizing": "fixed", "max_new_tokens": max_new}
    ds = ray.data.from_items(items, override_num_blocks=max(1, min(len(items), 4 * op.num_actors)))
    # one batch in flight per actor: a batch waits for a free actor, not behind another's long decode
    pool = ray.data.ActorPoolStrategy(size=op.num_actors, max_tasks_in_flight_per_actor=1)
    rows = ds.map_batches(RoundDecoder, batch_size=4, compute=pool, num_cpus=op.cpus_per_actor,
                          resources=op.resources_per_actor or None,
                          fn_constructor_kwargs={"target": str(cfg.target), "head": str(head), "dtype": op.dtype,
                                                 "threads": op.threads_per_actor or max(1, int(op.cpus_per_actor)),
                                                 "settings": settings}).take_all()
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist([{k: r[k] for k in SERVED_SCHEMA.names} for r in rows], SERVED_SCHEMA),
                   buf, compression="zstd")
    storage.write_bytes(storage.join(out, f"round-{r:03d}", "decode", "records.parquet"), buf.getvalue())
    tokens, verify = sum(len(x["output_ids"]) for x in rows), sum(int(x["rounds"]) for x in rows)
    return {"records": len(rows), "tokens": tokens, "target_forwards": verify + len(rows),
            "tau": round(tokens / max(1, verify), 4), "nodes": len({x["node"] for x in rows})}


def step_data(cfg: TrainConfig, out, r: int) -> dict:
    from pipeline.__main__ import run
    from pipeline.config import PipelineConfig

    rdir = storage.join(out, f"round-{r:03d}")
    tokens = beside(cfg.data.shards, "tokenize", "tokens.parquet")
    path = derived_yaml(cfg.onpolicy.pipeline, storage.join(rdir, "pipeline.yaml"), {
        "run_dir": str(storage.join(rdir, "data")), "target": str(cfg.target),
        "ingest": {"sources": [{"path": str(storage.join(rdir, "decode", "*.parquet")), "format": "served"}],
                   "seed": 0},
        "regenerate.enabled": False,  # the answers are the target's own already
        "vocab.include": [str(tokens)] if storage.is_file(tokens) else []})
    summary = run(load_config(PipelineConfig, path))
    # one target forward per captured sequence (its hidden states and logits)
    return {"records": summary["ingest"]["records"], "rows": summary["capture"].get("rows"),
            "target_forwards": summary["capture"].get("rows") or 0}


def step_train(cfg: TrainConfig, out, r: int, head: str, overrides: list[str], path) -> dict:
    from trainer.driver import run_training

    op, rdir = cfg.onpolicy, storage.join(out, f"round-{r:03d}")
    changes = [f"out_dir={storage.join(rdir, 'head')}", f"data.shards={storage.join(rdir, 'data', 'capture')}",
               f"data.replay.shards={storage.absolute(cfg.data.shards)}", f"data.replay.share={op.replay_share}",
               f"model.init_from={head}", "onpolicy.rounds=0", f"epochs={op.epochs or cfg.epochs}",
               f"optim.lr={op.lr or cfg.optim.lr}"]
    report = run_training(load_config(TrainConfig, path, overrides + changes))
    return {"head": str(storage.join(rdir, "head", f"head_{cfg.export_formats[0]}")), "init_from": head,
            **{k: report.get(k) for k in ("steps", "train_loop_s", "wall_s", "first_loss", "best")}}


class State:
    """out_dir/state.json: the steps done, with what each produced."""

    def __init__(self, out):
        self.path = storage.join(out, "state.json")
        self.steps = json.loads(storage.read_text(self.path)) if storage.is_file(self.path) else {}

    def run(self, name: str, step, *args) -> dict:
        if name in self.steps:
            return self.steps[name]
        t0 = time.time()
        self.steps[name] = dict(step(*args), seconds=round(time.time() - t0, 1))
        storage.write_text(self.path, json.dumps(self.steps, indent=2))
        print(f"[onpolicy] {name}: {self.steps[name]['seconds']} s", flush=True)
        return self.steps[name]


def run_rounds(cfg: TrainConfig, path, overrides: list[str]) -> dict:
    from pipeline.cluster import check_shared, ensure_ray
    from pipeline.config import PipelineConfig
    from trainer.driver import run_training

    out, fmt = storage.absolute(cfg.out_dir), cfg.export_formats[0]
    print(f"[onpolicy] {ensure_ray(cfg.ray_address)}", flush=True)
    check_shared({"out_dir": out, "data.shards": cfg.data.shards, "target": cfg.target,
                  "onpolicy.start_head": cfg.onpolicy.start_head})
    max_new = cfg.onpolicy.max_new_tokens or load_config(PipelineConfig, cfg.onpolicy.pipeline).regenerate.max_new_tokens
    state = State(out)
    offline_dir = storage.join(out, "offline")

    def offline():
        if cfg.onpolicy.start_head is not None:  # the head an earlier run of this config exported
            return {"head": str(storage.absolute(cfg.onpolicy.start_head))}
        rep = run_training(load_config(TrainConfig, path, overrides + [f"out_dir={offline_dir}", "onpolicy.rounds=0"]))
        return {"head": str(storage.join(offline_dir, f"head_{fmt}")),
                **{k: rep.get(k) for k in ("steps", "train_loop_s", "wall_s", "first_loss", "best")}}

    head = state.run("offline", offline)["head"]
    state.run("prompts", step_prompts, cfg, out)
    for r in range(1, cfg.onpolicy.rounds + 1):
        state.run(f"round-{r:03d}.decode", step_decode, cfg, out, r, head, max_new)
        state.run(f"round-{r:03d}.data", step_data, cfg, out, r)
        head = state.run(f"round-{r:03d}.train", step_train, cfg, out, r, head, overrides, path)["head"]
    for f in cfg.export_formats:  # the last round's heads where a plain run puts its own
        src = storage.join(out, f"round-{cfg.onpolicy.rounds:03d}", "head", f"head_{f}")
        storage.upload(storage.node_copy(src), storage.join(out, f"head_{f}"))
    return write_report(cfg, out, state.steps)


def write_report(cfg: TrainConfig, out, steps: dict) -> dict:
    """report.json: the offline run's figures, every round's costs and the totals a plain run's report names."""
    rounds = [{"round": r, **{part: steps[f"round-{r:03d}.{part}"] for part in ("decode", "data", "train")}}
              for r in range(1, cfg.onpolicy.rounds + 1)]
    forwards = sum(x["decode"]["target_forwards"] + x["data"]["target_forwards"] for x in rounds)
    extra_s = sum(x[p]["seconds"] for x in rounds for p in ("decode", "data", "train")) + steps["prompts"]["seconds"]
    report = {"steps": steps["offline"].get("steps"), "best": rounds[-1]["train"]["best"],
              "train_loop_s": (steps["offline"].get("train_loop_s") or 0)
              + sum(x["train"].get("train_loop_s") or 0 for x in rounds),
              "wall_s": steps["offline"]["seconds"] + extra_s, "exports": [f"head_{f}" for f in cfg.export_formats],
              "onpolicy": {"rounds": rounds, "prompts": steps["prompts"], "extra_target_forwards": forwards,
                           "extra_wall_s": round(extra_s, 1), "offline_wall_s": steps["offline"]["seconds"],
                           "decode_tau": [x["decode"]["tau"] for x in rounds]}}
    storage.write_text(storage.join(out, "report.json"), json.dumps(report, indent=2))
    return report


def main(argv: list[str] | None = None) -> dict:
    args = config_arguments("eagleray train", __doc__, "onpolicy.rounds=1").parse_args(argv)
    cfg = load_or_exit(TrainConfig, args.config, args.overrides)
    if not cfg.onpolicy.rounds:
        from trainer.__main__ import main as train_main
        return train_main(argv)
    with errors_exit("train", root_cause=True):
        report = run_rounds(cfg, args.config, list(args.overrides))
    op = report["onpolicy"]
    print(f"[onpolicy] {len(op['rounds'])} rounds: decode tau {' -> '.join(f'{t:.2f}' for t in op['decode_tau'])}; "
          f"{op['extra_target_forwards']} extra target forwards, {op['extra_wall_s']:.0f} s beside the offline "
          f"run's {op['offline_wall_s']:.0f} s; heads in {storage.redact(cfg.out_dir)}", flush=True)
    return report


if __name__ == "__main__":
    main()
