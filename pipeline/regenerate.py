"""Stage 2 (optional), regenerate: the target rewrites every assistant turn in Ray Data actors.

Turn k of every record in a batch is generated together (left-padded), conditioned on the record's
already regenerated turns 0..k-1, so the draft later learns the target's own distribution. Each record
ends as `success`, `skipped` (prompt too long for the target: kept as it was) or `errored` (kept
as it was or dropped, per `on_error`); all are counted, none vanish.
"""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import pyarrow as pa
import ray
import torch

from pipeline.schema import Regenerate
from pipeline.tokenize import read_records_table


class Regenerator:
    def __init__(self, target: str, cfg: dict):
        from transformers import AutoTokenizer

        from pipeline.capture import load_target

        self.cfg = Regenerate(**cfg)
        self.model, self.device = load_target(target, "auto", self.cfg.num_gpus_per_actor > 0)
        self.tok = AutoTokenizer.from_pretrained(target)
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.max_pos = getattr(self.model.config, "max_position_embeddings", 4096)
        self.kw = {} if self.cfg.enable_thinking is None else {"enable_thinking": self.cfg.enable_thinking}

    def _generate(self, prompts: list[list[dict]], seed: int) -> list[str]:
        texts = [self.tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True, **self.kw)
                 for p in prompts]
        enc = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
        torch.manual_seed(seed)
        sample = self.cfg.temperature > 0
        out = self.model.generate(**enc, max_new_tokens=self.cfg.max_new_tokens, do_sample=sample,
                                  temperature=self.cfg.temperature if sample else None,
                                  top_p=self.cfg.top_p if sample else None, pad_token_id=self.tok.pad_token_id)
        return [self.tok.decode(row[enc["input_ids"].shape[1]:], skip_special_tokens=True).strip() for row in out]

    def __call__(self, batch: dict) -> pa.Table:
        convs = [json.loads(m) for m in batch["messages"]]
        status = ["success"] * len(convs)
        turns = max(sum(m["role"] == "assistant" for m in c) for c in convs)
        # Batch seed from the records' ids, so a record's sampled answer does not depend on scheduling.
        seed = self.cfg.seed + zlib.crc32("".join(map(str, batch["id"])).encode())
        for k in range(turns):
            todo, prompts = [], []
            for i, c in enumerate(convs):
                pos = [j for j, m in enumerate(c) if m["role"] == "assistant"]
                if status[i] != "success" or k >= len(pos):
                    continue
                prompt = c[: pos[k]]
                n = len(self.tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                                     return_dict=True, **self.kw)["input_ids"])
                if n + self.cfg.max_new_tokens > self.max_pos:
                    status[i] = "skipped"
                    continue
                todo.append((i, pos[k]))
                prompts.append(prompt)
            for s in range(0, len(prompts), self.cfg.batch_size):
                chunk = todo[s: s + self.cfg.batch_size]
                try:
                    answers = self._generate(prompts[s: s + self.cfg.batch_size], seed + 7919 * k + s)
                except Exception:  # e.g. out of memory on one batch: count it, keep going
                    answers = [""] * len(chunk)
                for (i, j), text in zip(chunk, answers):
                    if text:
                        convs[i][j] = {"role": "assistant", "content": text}
                    else:
                        status[i] = "errored"
        originals = batch["messages"]
        keep = [st != "errored" or self.cfg.on_error == "keep_original" for st in status]
        msgs = [json.dumps(c, ensure_ascii=False) if st == "success" else originals[i]
                for i, (c, st) in enumerate(zip(convs, status))]
        return pa.table({"id": pa.array([str(x) for x in batch["id"]], pa.string()),
                         "messages": pa.array(msgs, pa.string()), "status": pa.array(status, pa.string()),
                         "kept": pa.array(keep, pa.bool_())})


def run_regenerate(cfg: Regenerate, target: Path, records: Path, out_dir: Path) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    table = read_records_table(records)
    sources = {}
    with open(records, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            sources[rec["id"]] = rec["source"]
    ds = ray.data.from_arrow(table).repartition(max(1, min(cfg.num_actors * 4, table.num_rows // cfg.batch_size)))
    ds = ds.map_batches(Regenerator, batch_size=cfg.batch_size * 4, batch_format="numpy",
                        compute=ray.data.ActorPoolStrategy(size=cfg.num_actors), num_cpus=cfg.num_cpus_per_actor,
                        num_gpus=cfg.num_gpus_per_actor, fn_constructor_kwargs={"target": str(target),
                                                                               "cfg": cfg.model_dump()})
    result = pa.concat_tables(ray.get(ds.to_arrow_refs()))
    order = {rid: i for i, rid in enumerate(table.column("id").to_pylist())}
    rows = sorted(result.to_pylist(), key=lambda r: order[r["id"]])
    counts = {"success": 0, "skipped": 0, "errored": 0, "dropped": 0}
    with open(out_dir / "records.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            counts[r["status"]] += 1
            if not r["kept"]:
                counts["dropped"] += 1
                continue
            f.write(json.dumps({"id": r["id"], "source": sources[r["id"]], "regenerated": r["status"] == "success",
                                "messages": json.loads(r["messages"])}, ensure_ascii=False) + "\n")
    stats = {"records": len(rows), **counts, "on_error": cfg.on_error, "temperature": cfg.temperature,
             "max_new_tokens": cfg.max_new_tokens}
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=2))
    return stats
