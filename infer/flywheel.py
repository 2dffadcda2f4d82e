"""eagleray flywheel CONFIG.yaml [key=value ...] — one round of learning from served traffic.

Against a running endpoint (infer/serve.py with `traffic_log` on), a round runs six steps into
work_dir/round-NNN/ (work_dir: a folder or a URI), each recorded in its state.json when it ends, so a round cut
short resumes at the step it was in and a finished round is never redone:
  log       the traffic log's files no earlier round used, copied into the round (waits for min_records)
  pipeline  ingest them (`format: served`, the latest `held_out` share kept apart), tokenize, capture, vocab
  train     warm start from the serving head, the new shards mixed with a replayed share of the old ones
  gate      the candidate against the serving head (infer/gate.py): traffic tau up, benchmarks kept, identical
  swap      POST /v1/admin/head on the endpoint when the gate promotes (infer/head_swap.py)
  report    the round's figures: report.json in the round, one line per round in work_dir/report.md
The base pipeline and trainer YAMLs give every setting a round does not own (target, capture, model, optim).
Every location a round names (its folders, the heads, the replayed shards) is a URI when work_dir is one, else
an absolute path; on a Ray cluster of several nodes a local work_dir is refused before any work.
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import yaml
from pydantic import Field

from infer.eval import Bench
from infer.generate import SpecSettings
from pipeline import storage
from pipeline.yaml_config import (ExistingPath, InputLocation, Location, ModelDtype, StrictModel, config_arguments,
                                  errors_exit, load_config, load_or_exit, parse_override, set_dotted)

STEPS = ("log", "pipeline", "train", "gate", "swap", "report")


class FlywheelReplay(StrictModel):
    shards: InputLocation = Field(description="the serving head's training shards (a capture folder or URI)")
    tokens: InputLocation | None = Field(None, description="their tokens.parquet for the vocabulary; null: beside")
    share: float = Field(0.5, ge=0, lt=1, description="the replayed rows' share of each round's training rows")


class FlywheelGate(StrictModel):
    benchmarks: list[Bench] = Field([], description="benchmarks the candidate must not fall on")
    decode: SpecSettings = SpecSettings(sizing="fixed", max_new_tokens=64)
    min_gain: float = Field(1.05, gt=0, description="candidate/serving tau on the held-out traffic, at least")
    max_drop: float = Field(0.02, ge=0, lt=1, description="a benchmark's tau may fall by this share at most")
    held_out_limit: int | None = Field(None, gt=0, description="held-out records judged; null: all")
    dtype: ModelDtype = Field("auto", description="target and heads (tau only: no timing in the verdict)")
    threads_per_actor: int | None = Field(None, description="torch threads of the gate's actor; null: 1")


class FlywheelConfig(StrictModel):
    endpoint: str = Field(description="the running endpoint's base URL, e.g. http://127.0.0.1:8000")
    api_key: str | None = Field(None, description="its Bearer key; null: $EAGLERAY_API_KEY if set")
    work_dir: Location = Field(Path("runs/flywheel"), description="round-NNN/ folders and report.md: folder or URI")
    traffic: InputLocation | None = Field(None, description="the traffic log folder; null: the endpoint's /health")
    serving_head: InputLocation | None = Field(None, description="the serving head's folder or URI; null: /health's")
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


def below(root, loc) -> str:
    """`loc`'s path inside folder `root` ('' when it is not inside), for local paths and URIs alike."""
    base, sub = str(root).partition("?")[0].rstrip("/") + "/", str(loc).partition("?")[0]
    return sub[len(base):] if sub.startswith(base) else ""


class Round:
    """One round's folder and its state.json (the steps done, with what each produced), in work_dir: a folder
    (made absolute, so work on other nodes never resolves it in its own working directory) or a URI."""

    def __init__(self, work_dir):
        self.work_dir = storage.absolute(work_dir)
        found = storage.expand(storage.join(self.work_dir, "round-*", "state.json"))  # a URI's * spans folders
        done = [p for p in found if re.fullmatch(r"round-\d+/state\.json", below(self.work_dir, p))]
        last = json.loads(storage.read_text(done[-1])) if done else None
        n = len(done) if last and "report" not in last["steps"] else len(done) + 1
        self.name = f"round-{n:03d}"
        self.dir = storage.join(self.work_dir, self.name)
        self.path = storage.join(self.dir, "state.json")
        fresh = {"round": n, "steps": {}}
        self.state = json.loads(storage.read_text(self.path)) if storage.is_file(self.path) else fresh
        # every file an earlier round took, so no record trains two rounds
        self.used = {f for p in done if below(self.work_dir, p) != f"{self.name}/state.json"
                     for f in json.loads(storage.read_text(p))["steps"].get("log", {}).get("files", [])}

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
    head = storage.absolute(cfg.serving_head) or health.get("head")
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
        storage.write_bytes(storage.join(rnd.dir, "traffic", f"{i:05d}-{storage.name(f)}"), storage.read_bytes(f))
    return {"files": files, "records": rows, **now}


def derived_yaml(base: Path, loc, changes: dict) -> Path:
    """The base YAML with the round's keys set (dotted names), written at `loc` in the round for provenance
    (a path or a URI) -> the local copy that is loaded (`loc` itself when local; see `local_yaml`)."""
    tree = yaml.safe_load(base.read_text(encoding="utf-8")) or {}
    for key, value in changes.items():
        set_dotted(tree, key.split("."), value, key)
    copy = storage.Mirror(loc)
    storage.write_text(copy.local, yaml.safe_dump(tree, sort_keys=False))
    copy.push()
    return copy.local


def local_yaml(loc) -> Path:
    """A round's YAML (a path or a URI) as a local file to load: the URI's pulled into its mirror."""
    return storage.Mirror(loc).pull()


def beside(loc, *names: str):
    """A location in the folder that holds `loc` (a path, made absolute, or a URI)."""
    if not storage.is_uri(loc):
        return storage.absolute(loc).parent.joinpath(*names)
    base, sep, query = loc.partition("?")
    return storage.join(base.rstrip("/").rsplit("/", 1)[0] + sep + query, *names)


def step_pipeline(rnd: Round, cfg: FlywheelConfig) -> dict:
    from pipeline.__main__ import run
    from pipeline.config import PipelineConfig

    tokens = storage.absolute(cfg.replay.tokens or beside(cfg.replay.shards, "tokenize", "tokens.parquet"))
    path = derived_yaml(cfg.pipeline, storage.join(rnd.dir, "pipeline.yaml"), {
        "run_dir": str(storage.join(rnd.dir, "data")),
        "ingest": {"sources": [{"path": str(storage.join(rnd.dir, "traffic", "*.parquet")), "format": "served"}],
                   "held_out": cfg.held_out, "seed": 0},
        "regenerate.enabled": False,  # the answers are the target's own already
        "vocab.include": [str(tokens)] if storage.is_file(tokens) else []})
    summary = run(load_config(PipelineConfig, path, cfg.pipeline_overrides))
    ing = summary["ingest"]
    return {"records": ing["records"], "held_out": ing["held_out"], "rejected": ing["rejected_by_reason"],
            "rows": summary["capture"].get("rows")}


def step_train(rnd: Round, cfg: FlywheelConfig) -> dict:
    from trainer.config import TrainConfig
    from trainer.driver import run_training

    head = rnd.state["steps"]["log"]["head"]
    path = derived_yaml(cfg.trainer, storage.join(rnd.dir, "trainer.yaml"), {
        "out_dir": str(storage.join(rnd.dir, "head")), "data.shards": str(storage.join(rnd.dir, "data", "capture")),
        "data.replay": {"shards": str(storage.absolute(cfg.replay.shards)), "share": cfg.replay.share},
        "model.init_from": head})
    tcfg = load_config(TrainConfig, path, cfg.trainer_overrides)
    report = run_training(tcfg)
    # the location the swap POSTs: a URI that replicas on any node pull themselves (infer/head_swap.py)
    return {"candidate": str(storage.join(storage.absolute(tcfg.out_dir), f"head_{tcfg.export_formats[0]}")),
            "val": {k: v for k, v in (report or {}).items() if isinstance(v, (int, float))}}


def step_gate(rnd: Round, cfg: FlywheelConfig) -> dict:
    from infer.gate import GateConfig, run_gate, summary_line
    from pipeline.config import PipelineConfig

    pcfg = load_config(PipelineConfig, local_yaml(storage.join(rnd.dir, "pipeline.yaml")), cfg.pipeline_overrides)
    g = cfg.gate
    result = run_gate(GateConfig(
        target=pcfg.target, serving=rnd.state["steps"]["log"]["head"],
        candidate=rnd.state["steps"]["train"]["candidate"],
        held_out=storage.join(pcfg.stage_dir("ingest"), "held_out.jsonl"), held_out_limit=g.held_out_limit,
        benchmarks=g.benchmarks, decode=g.decode, min_gain=g.min_gain, max_drop=g.max_drop, out_dir=rnd.dir,
        dtype=g.dtype, threads_per_actor=g.threads_per_actor))
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
    report = storage.join(rnd.work_dir, "report.md")  # appended as read + written whole: objects have no append
    old = storage.read_text(report) if storage.is_file(report) else (
        "# Flywheel rounds\n\n| round | served records | tau serving -> candidate | serving after | round time |\n"
        "|---|---|---|---|---|\n")
    if line + "\n" not in old:  # a report step cut short after its write adds no second line
        storage.write_text(report, old + line + "\n")
    storage.write_text(storage.join(rnd.dir, "report.json"), json.dumps(rnd.state, indent=2))
    return {"line": line}


def check_shared_locations(cfg: FlywheelConfig) -> None:
    """Before any work, on a Ray cluster of several nodes: a local work_dir (or replay shards, serving head)
    names a folder only this machine has, where the round's trainer workers and gate actors on other nodes
    read and write. Refused in one line naming the key. Ray is joined only when a cluster is named (the
    pipeline's ray_address, else $RAY_ADDRESS: the Ray the round's stages join); a local Ray is one node."""
    given = [value for parts, value in map(parse_override, cfg.pipeline_overrides) if parts == ["ray_address"]]
    base = (yaml.safe_load(cfg.pipeline.read_text(encoding="utf-8")) or {}).get("ray_address")
    address = (given or [base])[-1] or os.environ.get("RAY_ADDRESS")
    locs = {"work_dir": cfg.work_dir, "replay.shards": cfg.replay.shards, "serving_head": cfg.serving_head}
    if not address or all(loc is None or storage.is_uri(loc) for loc in locs.values()):
        return
    from pipeline.cluster import check_shared, ensure_ray

    print(f"[flywheel] {ensure_ray(address)}", flush=True)
    check_shared(locs)


def run_round(cfg: FlywheelConfig) -> dict:
    """One round (or the rest of one cut short) -> its state; raises Waiting when traffic is short."""
    check_shared_locations(cfg)
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
