"""eagleray flywheel CONFIG.yaml [key=value ...] — one round of learning from served traffic.

Against a running endpoint (infer/serve.py with `traffic_log` on), a round runs six steps into
work_dir/round-NNN/, each recorded in its state.json when it ends, so a round cut short resumes at the step it
was in and a finished round is never redone:
  log       the traffic log's files no earlier round used, copied into the round (waits for min_records)
  pipeline  ingest them (`format: served`, the latest `held_out` share kept apart), tokenize, capture, vocab
  train     warm start from the serving head, the new shards mixed with a replayed share of the old ones
  gate      the candidate against the serving head (infer/gate.py): traffic tau up, benchmarks kept, identical
  swap      POST /v1/admin/head on the endpoint when the gate promotes (infer/head_swap.py)
  report    the round's figures: report.json in the round, one line per round in work_dir/report.md
The base pipeline and trainer YAMLs give every setting a round does not own (target, capture, model, optim).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import yaml
from pydantic import Field

from infer.eval import Bench
from infer.generate import SpecSettings
from pipeline import storage
from pipeline.yaml_config import (ExistingPath, InputLocation, StrictModel, config_arguments, errors_exit,
                                  load_config, load_or_exit, set_dotted)

STEPS = ("log", "pipeline", "train", "gate", "swap", "report")


class FlywheelReplay(StrictModel):
    shards: ExistingPath = Field(description="the serving head's training shards (a capture folder)")
    tokens: ExistingPath | None = Field(None, description="their tokens.parquet for the vocabulary; null: beside")
    share: float = Field(0.5, ge=0, lt=1, description="the replayed rows' share of each round's training rows")


class FlywheelGate(StrictModel):
    benchmarks: list[Bench] = Field([], description="benchmarks the candidate must not fall on")
    decode: SpecSettings = SpecSettings(sizing="fixed", max_new_tokens=64)
    min_gain: float = Field(1.05, gt=0, description="candidate/serving tau on the held-out traffic, at least")
    max_drop: float = Field(0.02, ge=0, lt=1, description="a benchmark's tau may fall by this share at most")
    held_out_limit: int | None = Field(None, gt=0, description="held-out records judged; null: all")


class FlywheelConfig(StrictModel):
    endpoint: str = Field(description="the running endpoint's base URL, e.g. http://127.0.0.1:8000")
    api_key: str | None = Field(None, description="its Bearer key; null: $EAGLERAY_API_KEY if set")
    work_dir: Path = Field(Path("runs/flywheel"), description="round-NNN/ folders and report.md")
    traffic: InputLocation | None = Field(None, description="the traffic log folder; null: the endpoint's /health")
    serving_head: ExistingPath | None = Field(None, description="the serving head's folder; null: /health's")
    min_records: int = Field(32, gt=0, description="a round waits until this many new served records exist")
    held_out: float = Field(0.2, gt=0, lt=1, description="the latest share of the records, kept for the gate")
    pipeline: ExistingPath = Field(description="base pipeline YAML (target, tokenize, capture, vocab)")
    pipeline_overrides: list[str] = Field([], description="key=value overrides of the round's pipeline config")
    trainer: ExistingPath = Field(description="base trainer YAML (model, optim, scaling)")
    trainer_overrides: list[str] = Field([], description="key=value overrides of the round's trainer config")
    replay: FlywheelReplay
    gate: FlywheelGate = FlywheelGate()
    swap: bool = Field(True, description="promote on the endpoint when the gate says so")


class Waiting(Exception):
    """Not enough new traffic for a round yet."""


def endpoint_call(cfg: FlywheelConfig, path: str, body: dict | None = None, timeout: float = 300) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    key = cfg.api_key or os.environ.get("EAGLERAY_API_KEY")
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(cfg.endpoint.rstrip("/") + path, headers=headers,
                                 data=None if body is None else json.dumps(body).encode())
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


class Round:
    """One round's folder and its state.json (the steps done, with what each produced)."""

    def __init__(self, work_dir: Path):
        done = sorted(work_dir.glob("round-*/state.json"))
        last = json.loads(done[-1].read_text()) if done else None
        n = len(done) if last and "report" not in last["steps"] else len(done) + 1
        self.dir = work_dir / f"round-{n:03d}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "state.json"
        self.state = json.loads(self.path.read_text()) if self.path.is_file() else {"round": n, "steps": {}}
        # every file an earlier round took, so no record trains two rounds
        self.used = {f for p in done if p != self.path for f in json.loads(p.read_text())["steps"]
                     .get("log", {}).get("files", [])}

    def run(self, name: str, step, *args) -> dict:
        if name in self.state["steps"]:
            print(f"[flywheel] {name}: done earlier", flush=True)
            return self.state["steps"][name]
        t0 = time.time()
        out = dict(step(self, *args), seconds=round(time.time() - t0, 1))
        self.state["steps"][name] = out
        storage.write_text(self.path, json.dumps(self.state, indent=2))
        print(f"[flywheel] {name}: {out['seconds']} s", flush=True)
        return out


def serving(cfg: FlywheelConfig) -> dict:
    """The endpoint's serving head and traffic log (GET /health), the config's where it names them."""
    status, health = endpoint_call(cfg, "/health", timeout=30)
    if status != 200:
        raise ValueError(f"endpoint: {cfg.endpoint}/health answered {status}")
    head = cfg.serving_head or health.get("head")
    traffic = cfg.traffic or (health.get("traffic_log") or {}).get("path")
    if not head or not traffic:
        raise ValueError("endpoint: serves no head or logs no traffic (set serving_head / traffic, or traffic_log)")
    return {"head": str(head), "head_version": health.get("head_version"), "traffic": str(traffic)}


def step_log(rnd: Round, cfg: FlywheelConfig, now: dict) -> dict:
    files = [str(f) for f in storage.expand(storage.join(now["traffic"], "*.parquet")) if str(f) not in rnd.used]
    rows = sum(storage.parquet_file(f).metadata.num_rows for f in files)
    if rows < cfg.min_records:
        raise Waiting(f"{rows} new served records in {storage.redact(now['traffic'])}, a round needs {cfg.min_records}")
    for i, f in enumerate(files):
        storage.write_bytes(rnd.dir / "traffic" / f"{i:05d}-{storage.name(f)}", storage.read_bytes(f))
    return {"files": files, "records": rows, **now}


def derived_yaml(base: Path, path: Path, changes: dict) -> Path:
    """The base YAML with the round's keys set (dotted names), written into the round for provenance."""
    tree = yaml.safe_load(base.read_text(encoding="utf-8")) or {}
    for key, value in changes.items():
        set_dotted(tree, key.split("."), value, key)
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


def step_pipeline(rnd: Round, cfg: FlywheelConfig) -> dict:
    from pipeline.__main__ import run
    from pipeline.config import PipelineConfig

    tokens = cfg.replay.tokens or cfg.replay.shards.parent / "tokenize" / "tokens.parquet"
    path = derived_yaml(cfg.pipeline, rnd.dir / "pipeline.yaml", {
        "run_dir": str(rnd.dir / "data"),
        "ingest": {"sources": [{"path": str(rnd.dir / "traffic" / "*.parquet"), "format": "served"}],
                   "held_out": cfg.held_out, "seed": 0},
        "regenerate.enabled": False,  # the answers are the target's own already
        "vocab.include": [str(tokens.resolve())] if tokens.is_file() else []})
    summary = run(load_config(PipelineConfig, path, cfg.pipeline_overrides))
    ing = summary["ingest"]
    return {"records": ing["records"], "held_out": ing["held_out"], "rejected": ing["rejected_by_reason"],
            "rows": summary["capture"].get("rows")}


def step_train(rnd: Round, cfg: FlywheelConfig) -> dict:
    from trainer.config import TrainConfig
    from trainer.driver import run_training

    head = rnd.state["steps"]["log"]["head"]
    path = derived_yaml(cfg.trainer, rnd.dir / "trainer.yaml", {
        "out_dir": str(rnd.dir / "head"), "data.shards": str(rnd.dir / "data" / "capture"),
        "data.replay": {"shards": str(cfg.replay.shards.resolve()), "share": cfg.replay.share},
        "model.init_from": head})
    tcfg = load_config(TrainConfig, path, cfg.trainer_overrides)
    report = run_training(tcfg)
    return {"candidate": str((rnd.dir / "head" / f"head_{tcfg.export_formats[0]}").resolve()),
            "val": {k: v for k, v in (report or {}).items() if isinstance(v, (int, float))}}


def step_gate(rnd: Round, cfg: FlywheelConfig) -> dict:
    from infer.gate import GateConfig, run_gate, summary_line
    from pipeline.config import PipelineConfig

    target = load_config(PipelineConfig, rnd.dir / "pipeline.yaml", cfg.pipeline_overrides).target
    g = cfg.gate
    result = run_gate(GateConfig(
        target=target, serving=rnd.state["steps"]["log"]["head"], candidate=rnd.state["steps"]["train"]["candidate"],
        held_out=rnd.dir / "data" / "ingest" / "held_out.jsonl", held_out_limit=g.held_out_limit,
        benchmarks=g.benchmarks, decode=g.decode, min_gain=g.min_gain, max_drop=g.max_drop, out_dir=rnd.dir))
    print(summary_line(result), flush=True)
    return {k: result[k] for k in ("sets", "identical", "promote", "reasons")}


def step_swap(rnd: Round, cfg: FlywheelConfig) -> dict:
    if not (cfg.swap and rnd.state["steps"]["gate"]["promote"]):
        return {"swapped": False, "why": "the gate kept the serving head" if cfg.swap else "swap: false"}
    status, body = endpoint_call(cfg, "/v1/admin/head", {"head": rnd.state["steps"]["train"]["candidate"]})
    if status != 200:
        raise ValueError(f"swap: the endpoint refused the candidate ({status}): {body.get('error', body)}")
    return {"swapped": True, **body}


def step_report(rnd: Round, cfg: FlywheelConfig) -> dict:
    steps = rnd.state["steps"]
    sets = steps["gate"]["sets"]
    line = (f"| {rnd.state['round']} | {steps['log']['records']} | "
            + " | ".join(f"{n} {s['serving_tau']:.2f} -> {s['candidate_tau']:.2f}" for n, s in sets.items())
            + f" | {steps['swap'].get('head_version', 'kept')} | {sum(s['seconds'] for s in steps.values()):.0f} s |")
    report = cfg.work_dir / "report.md"
    if not report.is_file():
        report.write_text("# Flywheel rounds\n\n| round | served records | tau serving -> candidate | serving after "
                          "| round time |\n|---|---|---|---|---|\n")
    with report.open("a", encoding="utf-8") as f:
        f.write(line + "\n")
    (rnd.dir / "report.json").write_text(json.dumps(rnd.state, indent=2))
    return {"line": line}


def run_round(cfg: FlywheelConfig) -> dict:
    """One round (or the rest of one cut short) -> its state; raises Waiting when traffic is short."""
    rnd = Round(cfg.work_dir)
    now = None if "log" in rnd.state["steps"] else serving(cfg)
    rnd.run("log", step_log, cfg, now)
    for name, step in (("pipeline", step_pipeline), ("train", step_train), ("gate", step_gate),
                       ("swap", step_swap), ("report", step_report)):
        rnd.run(name, step, cfg)
    return rnd.state


def main(argv: list[str] | None = None) -> dict:
    args = config_arguments("eagleray flywheel", __doc__).parse_args(argv)
    cfg = load_or_exit(FlywheelConfig, args.config, args.overrides)
    try:
        with errors_exit("flywheel"):
            state = run_round(cfg)
    except Waiting as w:
        print(f"[flywheel] waiting: {w}", flush=True)
        return {"waiting": str(w)}
    steps = state["steps"]
    print(f"[flywheel] round {state['round']}: {steps['log']['records']} served records; "
          f"{'swapped to ' + steps['swap']['head_version'] if steps['swap']['swapped'] else steps['swap']['why']}; "
          f"{sum(s['seconds'] for s in steps.values()):.0f} s", flush=True)
    return state


if __name__ == "__main__":
    main()
