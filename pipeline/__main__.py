"""python -m pipeline CONFIG.yaml [key=value ...] [--plan] [--inspect N]

Runs the stages the config enables (ingest -> regenerate -> tokenize -> capture -> vocab), each into
its own folder under run_dir, on a local Ray or the cluster in $RAY_ADDRESS (as under `ray job submit`).
--plan runs up to tokenize, prints the storage estimate as JSON and exits; --inspect N prints N
tokenized samples with the loss-masked spans marked [[ like this ]].
"""
from __future__ import annotations

import json
import time

from pipeline import storage
from pipeline.cluster import check_shared, ensure_ray, ray_data_settings
from pipeline.yaml_config import config_arguments, errors_exit, load_or_exit
from pipeline.config import Ingest, PipelineConfig


def log(stage: str, info: dict, t0: float) -> None:
    """One line per stage: its scalar counts (the nested ones are in its stats.json and summary.json)."""
    counts = ", ".join(f"{k} {v}" for k, v in info.items() if isinstance(v, (int, float, str)) and not
                       isinstance(v, bool) and v != 0 and k != "fingerprint")
    print(f"[{stage}] {time.time() - t0:.1f} s: {counts}", flush=True)


def main(argv: list[str] | None = None) -> dict:
    ap = config_arguments("python -m pipeline", __doc__, "capture.dtype=fp16")
    ap.add_argument("--plan", action="store_true", help="print the storage estimate and exit")
    ap.add_argument("--inspect", type=int, default=0, metavar="N", help="print N masked samples after tokenize")
    ap.add_argument("--check-sources", action="store_true",
                    help="only check that every ingest source exists (one line naming the first missing file), then exit")
    args = ap.parse_args(argv)
    if args.check_sources:  # before a long run (make real): stop at once on a corpus the clone lacks
        from pipeline.ingest import source_files

        ingest = load_or_exit(Ingest, args.config, args.overrides, section="ingest")
        with errors_exit("pipeline", catch=(ValueError,)):  # a URI source: reachable, matching files
            files = [f for i, s in enumerate(ingest.sources) for f in source_files(f"ingest.sources.{i}.path", s.path)]
        print(f"{args.config}: {len(ingest.sources)} ingest source(s) found ({len(files)} file(s))")
        return {"sources": len(ingest.sources)}
    cfg = load_or_exit(PipelineConfig, args.config, args.overrides)
    with errors_exit("pipeline", catch=(ValueError,)):  # bad settings, empty data: one line, exit 1
        return run(cfg, plan_only=args.plan, inspect_n=args.inspect)


def run(cfg: PipelineConfig, plan_only: bool = False, inspect_n: int = 0) -> dict:
    """run_dir may be a URI: its storage is checked before any work; the text stages then run in its local
    mirror (pipeline/storage.py Mirror), each stage's folder pushed when it ends, and capture's actors
    read the tokens and write the shards at the URI itself, the manifest last."""
    from pipeline.capture import run_capture
    from pipeline.ingest import run_ingest, source_files
    from pipeline.plan import estimate_storage
    from pipeline.regenerate import run_regenerate
    from pipeline.tokenize import inspect, run_tokenize
    from pipeline.vocab import run_vocab

    storage.check("run_dir", cfg.run_dir, writable=True)
    storage.check("target", cfg.target, must_exist=True)
    if cfg.ingest.enabled:  # every source found before any work (a URI's bucket, a glob's files)
        for i, s in enumerate(cfg.ingest.sources):
            source_files(f"ingest.sources.{i}.path", s.path)
    mirror, remote = storage.Mirror(cfg.run_dir), cfg.run_dir
    provenance = json.loads(cfg.model_dump_json())
    cfg = cfg.model_copy(update={"run_dir": mirror.local, "target": storage.absolute(cfg.target)})
    print(f"pipeline: {ensure_ray(cfg.ray_address)}; run_dir={storage.redact(remote)}", flush=True)
    # what Ray tasks on other nodes read or write: URIs on a cluster that shares no disk
    check_shared({"run_dir": remote, "target": cfg.target, "vocab.include": cfg.vocab.include,
                  "ingest.sources": [s.path for s in cfg.ingest.sources] if cfg.ingest.enabled else []})
    ray_data_settings()
    cfg.run_dir.mkdir(parents=True, exist_ok=True)
    (cfg.run_dir / "pipeline_config.json").write_text(json.dumps(provenance, indent=2))
    mirror.push("pipeline_config.json")
    summary, t0 = {}, time.time()
    records = cfg.stage_dir("ingest") / "records.jsonl"
    if cfg.ingest.enabled:
        summary["ingest"] = run_ingest(cfg.ingest, cfg.stage_dir("ingest"), prompt_only=cfg.regenerate.enabled)
        mirror.push("ingest")
        log("ingest", {k: v for k, v in summary["ingest"].items() if k != "sources"}, t0)
    if cfg.regenerate.enabled:
        summary["regenerate"] = run_regenerate(cfg.regenerate, cfg.target, records, cfg.stage_dir("regenerate"),
                                               cfg.chat, parts_at=storage.join(remote, "regenerate"))
        records = cfg.stage_dir("regenerate") / "records.jsonl"
        mirror.push("regenerate")
        log("regenerate", summary["regenerate"], t0)
    tokens = cfg.stage_dir("tokenize") / "tokens.parquet"
    if cfg.tokenize.enabled:
        if not records.is_file():
            raise ValueError(f"tokenize: {records} not found; enable ingest or point run_dir at an earlier run")
        summary["tokenize"] = run_tokenize(cfg.tokenize, cfg.target, records, cfg.stage_dir("tokenize"),
                                           cfg.chat)
        mirror.push("tokenize")
        log("tokenize", summary["tokenize"], t0)
        if inspect_n:
            print(inspect(tokens, cfg.target, inspect_n))
    if plan_only:
        summary["plan"] = estimate_storage(cfg, tokens)
        print(json.dumps(summary["plan"]))
        return summary
    if cfg.capture.enabled:
        summary["capture"] = run_capture(cfg.capture, cfg.target, storage.join(remote, "tokenize", "tokens.parquet"),
                                         storage.join(remote, "capture"), provenance=provenance)
        log("capture", summary["capture"], t0)
    if cfg.vocab.enabled:
        # read at run_dir (pushed after tokenize), not its local mirror: the read tasks may run on any node
        summary["vocab"] = run_vocab(cfg.vocab, cfg.target, storage.join(remote, "tokenize", "tokens.parquet"),
                                     cfg.stage_dir("capture"))
        mirror.push("capture")  # the vocab's files (the shards are at the URI already)
        log("vocab", summary["vocab"], t0)
    (cfg.run_dir / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False))
    mirror.push("summary.json")
    return summary


if __name__ == "__main__":
    main()
