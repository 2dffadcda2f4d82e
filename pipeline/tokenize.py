"""Stage 3, tokenize: the target's chat template with an assistant-only loss mask, truncated.

The mask comes from `return_assistant_tokens_mask` when the template has `{% generation %}` markers;
otherwise assistant spans are found by rendering: the text between the render of the history with a
generation prompt and the render including the assistant turn is that turn's content (+ its end tokens).
Writes <run_dir>/tokenize/tokens.parquet (id, input_ids, loss_mask, n_tokens, n_loss), rejects.jsonl and
stats.json. A run whose masks cover no token at all fails with a message saying why.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from pipeline.schema import Tokenize

TOKENS_SCHEMA = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                           ("loss_mask", pa.list_(pa.uint8())), ("n_tokens", pa.int32()), ("n_loss", pa.int32())])


@lru_cache(maxsize=4)
def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{path}: the tokenizer has no chat template")
    return tok


def has_generation_markers(tok) -> bool:
    tmpl = tok.chat_template if isinstance(tok.chat_template, str) else json.dumps(tok.chat_template)
    return "{% generation %}" in tmpl or "{%- generation %}" in tmpl or "generation -%}" in tmpl


def _template_kwargs(enable_thinking: bool | None) -> dict:
    return {} if enable_thinking is None else {"enable_thinking": enable_thinking}


def mask_by_markers(tok, messages: list[dict], **kw) -> tuple[list[int], list[int]]:
    enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True, **kw)
    return list(enc["input_ids"]), [int(x) for x in enc["assistant_masks"]]


def assistant_char_spans(render, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """Pure: `render(msgs, add_generation_prompt)` -> text. Returns the full text and the character
    spans of each assistant turn (from after its generation prompt to the end of its rendered turn)."""
    full = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        start = len(render(messages[:i], True))
        end = len(render(messages[: i + 1], False))
        if not full.startswith(render(messages[: i + 1], False)) or end <= start:
            raise ValueError("chat template is not prefix-stable; cannot locate assistant spans by rendering")
        # The turn separator after the end-of-turn token belongs to the template, not to the answer.
        text = full[start:end]
        spans.append((start, start + len(text.rstrip("\n"))))
    return full, spans


def mask_by_render(tok, messages: list[dict], **kw) -> tuple[list[int], list[int]]:
    def render(msgs, gen):
        return tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, **kw) if msgs else ""

    full, spans = assistant_char_spans(render, messages)
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(s <= a < e for s, e in spans)) for a, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def tokenize_batch(batch: dict, target: str, max_length: int, mode: str, min_loss: int,
                   enable_thinking: bool | None) -> pa.Table:
    """Ray Data UDF: records (id, messages as JSON) -> token rows, rejects carried in `reason`."""
    tok = load_tokenizer(target)
    use_markers = mode == "generation" or (mode == "auto" and has_generation_markers(tok))
    kw = _template_kwargs(enable_thinking)
    cols = {"id": [], "input_ids": [], "loss_mask": [], "n_tokens": [], "n_loss": [], "reason": []}
    for rid, raw in zip(batch["id"], batch["messages"]):
        messages = json.loads(raw)
        try:
            ids, mask = (mask_by_markers if use_markers else mask_by_render)(tok, messages, **kw)
            reason = ""
        except Exception as e:  # a template that fails on one record is that record's reject
            ids, mask, reason = [], [], f"template_error: {type(e).__name__}: {str(e)[:120]}"
        ids, mask = ids[:max_length], mask[:max_length]
        if not reason and sum(mask) < min_loss:
            reason = "no_loss_tokens"
        cols["id"].append(str(rid))
        cols["input_ids"].append(np.asarray(ids, dtype=np.int32))
        cols["loss_mask"].append(np.asarray(mask, dtype=np.uint8))
        cols["n_tokens"].append(len(ids))
        cols["n_loss"].append(int(sum(mask)))
        cols["reason"].append(reason)
    return pa.table({
        "id": pa.array(cols["id"], pa.string()),
        "input_ids": pa.array(cols["input_ids"], pa.list_(pa.int32())),
        "loss_mask": pa.array(cols["loss_mask"], pa.list_(pa.uint8())),
        "n_tokens": pa.array(cols["n_tokens"], pa.int32()), "n_loss": pa.array(cols["n_loss"], pa.int32()),
        "reason": pa.array(cols["reason"], pa.string())})


def read_records_table(path: Path) -> pa.Table:
    ids, msgs = [], []
    with open(path, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            ids.append(rec["id"])
            msgs.append(json.dumps(rec["messages"], ensure_ascii=False))
    return pa.table({"id": pa.array(ids, pa.string()), "messages": pa.array(msgs, pa.string())})


def run_tokenize(cfg: Tokenize, target: Path, records: Path, out_dir: Path,
                 enable_thinking: bool | None = None) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    table = read_records_table(records)
    if table.num_rows == 0:
        raise ValueError(f"tokenize: {records} holds no records")
    blocks = max(1, min(8, table.num_rows // 256))
    ds = ray.data.from_arrow(table).repartition(blocks)
    ds = ds.map_batches(tokenize_batch, batch_format="numpy", batch_size=256, fn_kwargs=dict(
        target=str(target), max_length=cfg.max_length, mode=cfg.mask, min_loss=cfg.min_loss_tokens,
        enable_thinking=enable_thinking))
    result = pa.concat_tables(ray.get(ds.to_arrow_refs()))
    # Keep the input order whatever order the blocks finished in: shards downstream depend on it.
    order = {rid: i for i, rid in enumerate(table.column("id").to_pylist())}
    got = result.column("id").to_pylist()
    result = result.take(sorted(range(result.num_rows), key=lambda i: order[got[i]]))
    reasons = result.column("reason").to_pylist()
    good = result.filter(pa.array([not r for r in reasons])).drop_columns(["reason"]).cast(TOKENS_SCHEMA)
    by_reason: dict[str, int] = {}
    with open(out_dir / "rejects.jsonl", "w", encoding="utf-8") as rej:
        for rid, r in zip(result.column("id").to_pylist(), reasons):
            if r:
                key = r.split(":")[0]
                by_reason[key] = by_reason.get(key, 0) + 1
                rej.write(json.dumps({"id": rid, "reason": key, "detail": r}) + "\n")
    if good.num_rows == 0:
        raise ValueError(
            f"tokenize: no record has a loss token (rejects: {by_reason}). The chat template of {target} "
            f"may not mark assistant turns; try tokenize.mask=render, or check max_length={cfg.max_length}")
    tmp = out_dir / "tokens.parquet.tmp"
    pq.write_table(good, tmp, compression="zstd")
    tmp.replace(out_dir / "tokens.parquet")
    stats = {"records": table.num_rows, "sequences": good.num_rows, "rejected_by_reason": by_reason,
             "tokens": int(pa.compute.sum(good["n_tokens"]).as_py()),
             "loss_tokens": int(pa.compute.sum(good["n_loss"]).as_py()),
             "truncated": int(sum(n >= cfg.max_length for n in good["n_tokens"].to_pylist())),
             "mask_method": "generation" if cfg.mask == "generation" or (
                 cfg.mask == "auto" and has_generation_markers(load_tokenizer(str(target)))) else "render"}
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=2))
    return stats


def inspect(tokens_path: Path, target: Path, n: int) -> str:
    """N samples with the loss-masked spans between [[ and ]]."""
    tok = load_tokenizer(str(target))
    rows = pq.read_table(tokens_path).slice(0, n).to_pylist()
    out = []
    for r in rows:
        parts, cur, cur_m = [], [], None
        for t, m in zip(r["input_ids"], r["loss_mask"]):
            if cur and m != cur_m:
                parts.append(("[[" + tok.decode(cur) + "]]") if cur_m else tok.decode(cur))
                cur = []
            cur.append(t)
            cur_m = m
        if cur:
            parts.append(("[[" + tok.decode(cur) + "]]") if cur_m else tok.decode(cur))
        out.append(f"--- {r['id']} ({r['n_tokens']} tokens, {r['n_loss']} in the loss)\n" + "".join(parts))
    return "\n".join(out)
