"""Stage 1, ingest: read every source in Ray Data tasks, normalise, deduplicate, mix by weight.

A source is a file, a glob or a URI (.json, .jsonl or .parquet; pipeline/storage.py), each file one
Ray Data task. Writes under <run_dir>/ingest/: records.jsonl ({id, source, messages}; `served: true` for
the traffic log's records, which regenerate passes through), rejects.jsonl (one reason per bad record),
held_out.jsonl (the latest `held_out` share of served records) and stats.json (counts per source and per
reason). Every input record ends up in exactly one of: the output, a reject, the held-out records, or the
`not_sampled` count of the weighted mix.
"""
from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import ray

from pipeline import storage
from pipeline.formats import Reject, detect_format, normalise, read_records
from pipeline.config import Ingest


def content_key(messages: list[dict]) -> str:
    """Dedupe key: roles and whitespace-collapsed, case-folded contents."""
    canon = [[m["role"], " ".join(m["content"].split()).casefold()] for m in messages]
    return hashlib.sha1(json.dumps(canon, ensure_ascii=False).encode()).hexdigest()


def parse_source(row: dict, max_chars: int, prompt_only: bool = False) -> list[dict]:
    """One source file -> one row per record, accepted or rejected (runs as a Ray Data task).
    prompt_only: records without answers are accepted (regeneration will write them)."""
    out = []
    for idx, obj, reason in read_records(row["path"]):
        rec = {"source": row["source"], "order": row["order"], "part": row["part"], "index": idx, "id": "",
               "messages": "", "key": "", "reason": reason or "", "detail": "", "served": False, "finished_at": 0.0}
        if reason is None:
            try:
                msgs = normalise(obj, row["format"], prompt_only)
                if sum(len(m["content"]) for m in msgs) > max_chars:
                    raise Reject("too_long", f"> {max_chars} characters")
                rid = obj.get("id") or obj.get("prompt_id") if isinstance(obj, dict) else None
                if detect_format(obj) == "served":  # the target's own answer: regenerate passes it through
                    rid, fin = obj.get("request_id"), obj["finished_at"]
                    rec.update(served=True, finished_at=float(fin) if isinstance(fin, (int, float)) else 0.0)
                rec.update(id=str(rid) if isinstance(rid, (str, int)) else "", key=content_key(msgs),
                           messages=json.dumps(msgs, ensure_ascii=False))
            except Reject as r:
                rec.update(reason=r.reason, detail=str(r)[:200])
        out.append(rec)
    return out


def mix_counts(available: dict[str, int], sources, total: int | None) -> dict[str, int]:
    """How many records each source contributes. Weighted sources share the mix by ratio (never
    upsampled: the mix shrinks to what the scarcest source allows); max_records caps; else all."""
    want = {}
    weighted = [s for s in sources if s.weight is not None]
    wsum = sum(s.weight for s in weighted)
    if weighted:
        cap = min(available[s.label] * wsum / s.weight for s in weighted)
        size = min(total, cap) if total is not None else cap
        for s in weighted:
            want[s.label] = min(available[s.label], int(round(size * s.weight / wsum)))
    for s in sources:
        if s.weight is None:
            want[s.label] = min(available[s.label], s.max_records or available[s.label])
    return want


def source_files(key: str, loc) -> list:
    """A source's files: itself, or what its glob matches (sorted). A URI is checked here, before any
    work: unreachable, refused or matching nothing stops the stage with one line naming `key`."""
    if storage.is_uri(loc):
        storage.check(key, loc, must_exist=not storage.has_glob(loc))
    files = storage.expand(loc)
    if not files:
        raise storage.StorageError(f"{key}: {storage.redact(loc)}: no file matches")
    return [f if storage.is_uri(f) else str(Path(f).resolve()) for f in files]


def hold_out(accepted: dict[str, list[dict]], share: float, stats: dict, path: Path) -> int:
    """The latest `share` of the served records (all sources together, by finish time) moved from `accepted`
    to held_out.jsonl (pipeline/served.py `time_split`) -> how many."""
    from pipeline.served import time_split

    served = [r for pool in accepted.values() for r in pool if r["served"]]
    _, held = time_split(served, share)
    gone = {id(r) for r in held}
    for label, pool in accepted.items():
        accepted[label] = [r for r in pool if id(r) not in gone]
        stats[label]["held_out"] = len(pool) - len(accepted[label])
    with open(path, "w", encoding="utf-8") as f:
        for r in held:
            f.write(json.dumps({"id": r["id"], "source": r["source"], "messages": json.loads(r["messages"]),
                                "finished_at": r["finished_at"]}, ensure_ascii=False) + "\n")
    return len(held)


def run_ingest(cfg: Ingest, out_dir: Path, prompt_only: bool = False) -> dict:
    """prompt_only is the pipeline's regeneration switch: with it on, the target answers bare prompts."""
    labels = [s.label for s in cfg.sources]
    if len(set(labels)) != len(labels):
        raise ValueError(f"ingest.sources: two sources share the name {labels}; give them distinct `name`s")
    items = [{"source": s.label, "order": i, "part": j, "path": f, "format": s.format}
             for i, s in enumerate(cfg.sources) for j, f in enumerate(source_files(f"ingest.sources.{i}.path", s.path))]
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = {s.label: sum(it["source"] == s.label for it in items) for s in cfg.sources}
    ds = ray.data.from_items(items, override_num_blocks=len(items))
    rows = ds.flat_map(parse_source, fn_kwargs={"max_chars": cfg.max_chars, "prompt_only": prompt_only}).take_all()
    rows.sort(key=lambda r: (r["order"], r["part"], r["index"]))

    stats = {s.label: {"files": parts[s.label], "read": 0, "accepted": 0, "rejected": {}, "held_out": 0,
                       "selected": 0, "not_sampled": 0} for s in cfg.sources}
    seen_keys: set[str] = set()
    seen_ids: set[str] = set()
    accepted: dict[str, list[dict]] = {s.label: [] for s in cfg.sources}
    with open(out_dir / "rejects.jsonl", "w", encoding="utf-8") as rej:
        for r in rows:
            st = stats[r["source"]]
            st["read"] += 1
            if not r["reason"] and r["key"] in seen_keys:
                r["reason"], r["detail"] = "duplicate", "same normalised content as an earlier record"
            # A record's place: its index in the file, and which file of a glob's (part) when there are several.
            where = r["index"] if parts[r["source"]] == 1 else f"{r['part']}:{r['index']}"
            if r["reason"]:
                st["rejected"][r["reason"]] = st["rejected"].get(r["reason"], 0) + 1
                rej.write(json.dumps({"source": r["source"], "index": where, "reason": r["reason"],
                                      "detail": r["detail"]}) + "\n")
                continue
            seen_keys.add(r["key"])
            rid = r["id"] or f"{r['source']}:{where}"
            if rid in seen_ids:  # ids must be unique downstream (shards are keyed by them)
                rid = f"{rid}#{r['source']}:{where}"
            seen_ids.add(rid)
            st["accepted"] += 1
            accepted[r["source"]].append({"id": rid, "source": r["source"], "messages": r["messages"],
                                          "served": r["served"], "finished_at": r["finished_at"]})
    held = hold_out(accepted, cfg.held_out, stats, out_dir / "held_out.jsonl")

    want = mix_counts({k: len(v) for k, v in accepted.items()}, cfg.sources, cfg.total_records)
    rng = random.Random(cfg.seed)
    mixed = []
    for s in cfg.sources:
        pool = accepted[s.label]
        picked = pool if want[s.label] >= len(pool) else rng.sample(pool, want[s.label])
        stats[s.label]["selected"] = len(picked)
        stats[s.label]["not_sampled"] = len(pool) - len(picked)
        mixed += picked
    rng.shuffle(mixed)
    with open(out_dir / "records.jsonl", "w", encoding="utf-8") as f:
        for rec in mixed:
            f.write(json.dumps({"id": rec["id"], "source": rec["source"], "messages": json.loads(rec["messages"])}
                               | ({"served": True} if rec["served"] else {}), ensure_ascii=False) + "\n")
    by_reason: dict[str, int] = {}
    for st in stats.values():
        for k, v in st["rejected"].items():
            by_reason[k] = by_reason.get(k, 0) + v
    summary = {"records": len(mixed), "read": sum(st["read"] for st in stats.values()),
               "rejected": sum(by_reason.values()), "rejected_by_reason": by_reason,
               "not_sampled": sum(st["not_sampled"] for st in stats.values()), "held_out": held,
               "prompt_only": sum(not any(m["role"] == "assistant" for m in json.loads(r["messages"])) for r in mixed),
               "sources": stats}
    (out_dir / "stats.json").write_text(json.dumps(summary, indent=2))
    return summary
