"""Stage 3, tokenize: the target's chat template with an assistant-only loss mask, truncated.

The mask comes from `return_assistant_tokens_mask` when the template has `{% generation %}` markers;
otherwise assistant spans are found in the rendered conversation by their content (ARCHITECTURE.md §3):
each turn's text is located in order, and an assistant span runs from its content to the end-of-turn
special token right after it (`<|im_end|>`, `<|eot_id|>`, `</s>`, `<end_of_turn>` ...), so the draft learns
to stop. Anchoring on content rather than on prefix renders keeps masks right for templates that are not
prefix-preserving (Qwen3's think block on the last turn only, DeepSeek-R1's `<think>\n` generation prompt
and its history without reasoning).
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

from pipeline import storage
from pipeline.config import ChatTemplate, Tokenize

TOKENS_SCHEMA = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())),
                           ("loss_mask", pa.list_(pa.uint8())), ("n_tokens", pa.int32()), ("n_loss", pa.int32())])
TOKENS_META = b"eagleray_tokenize"  # schema metadata of tokens.parquet: {"max_length": ...}


def tokens_max_length(tokens_path) -> int:
    """The length cap the tokens were cut at (written by run_tokenize); a path or URI."""
    from pipeline import storage

    meta = storage.parquet_file(tokens_path).schema_arrow.metadata or {}
    if TOKENS_META not in meta:
        raise ValueError(f"{tokens_path} carries no tokenize settings (written by an older version): "
                         f"rerun the tokenize stage")
    return int(json.loads(meta[TOKENS_META])["max_length"])


@lru_cache(maxsize=4)
def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(storage.node_copy(path))
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{path}: the tokenizer has no chat template")
    return tok


def has_generation_markers(tok) -> bool:
    tmpl = tok.chat_template if isinstance(tok.chat_template, str) else json.dumps(tok.chat_template)
    return "{% generation %}" in tmpl or "{%- generation %}" in tmpl or "generation -%}" in tmpl


def mask_by_markers(tok, messages: list[dict], **kw) -> tuple[list[int], list[int]]:
    enc = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True, **kw)
    return list(enc["input_ids"]), [int(x) for x in enc["assistant_masks"]]


def content_candidates(content: str) -> list[str]:
    """How a template may have rendered an assistant turn's content: as is, trimmed (Llama-3, Gemma), or
    with its reasoning dropped (DeepSeek-R1 / Qwen3 history keep what follows `</think>`)."""
    out = [content, content.strip()]
    if "</think>" in content:
        out.append(content.split("</think>")[-1].strip())
    return [c for i, c in enumerate(out) if c and c not in out[:i]]


def assistant_char_spans(full: str, messages: list[dict], end_markers: list[str]) -> list[tuple[int, int]]:
    """Pure: the rendered conversation `full` -> character spans of each assistant turn's content plus
    the end-of-turn marker that immediately follows it (longest of `end_markers`). Turns are located in
    order, so an answer quoted inside a later prompt cannot be mistaken for it. Raises ValueError when an
    assistant turn's content cannot be found."""
    spans, cursor = [], 0
    markers = sorted(set(end_markers), key=len, reverse=True)
    for i, m in enumerate(messages):
        found = next(((full.find(c, cursor), c) for c in content_candidates(m["content"])
                      if full.find(c, cursor) >= 0), None)
        if found is None:
            if m["role"] == "assistant":
                raise ValueError(f"assistant turn {i} not found in the rendered conversation")
            continue  # a template may rewrite system / user text; only answers must be located
        start, text = found
        end = start + len(text)
        cursor = end
        if m["role"] == "assistant":
            end += next((len(t) for t in markers if full.startswith(t, end)), 0)
            spans.append((start, end))
            cursor = end
    return spans


def end_markers(tok) -> list[str]:
    """Special tokens that may close a turn: every special / added special token of the tokenizer."""
    added = [t.content for t in getattr(tok, "added_tokens_decoder", {}).values() if getattr(t, "special", False)]
    return [t for t in set(tok.all_special_tokens) | set(added) if t]


def mask_by_render(tok, messages: list[dict], **kw) -> tuple[list[int], list[int]]:
    full = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **kw)
    spans = assistant_char_spans(full, messages, end_markers(tok))
    enc = tok(full, add_special_tokens=False, return_offsets_mapping=True)
    # A token that merges the separator's whitespace with the answer's first word (" The" after
    # "[/INST]") is the answer's first token: it starts before the span only by whitespace.
    mask = [int(any(a < e and b > s and (a >= s or full[a:s].isspace()) for s, e in spans))
            for a, b in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask


def tokenize_batch(batch: dict, target: str, max_length: int, mode: str, min_loss: int,
                   chat: ChatTemplate) -> pa.Table:
    """Ray Data UDF: records (id, messages as JSON) -> token rows, rejects carried in `reason`."""
    tok = load_tokenizer(target)
    use_markers = mode == "generation" or (mode == "auto" and has_generation_markers(tok))
    kw = chat.kwargs()
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
                 chat: ChatTemplate = ChatTemplate()) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    table = read_records_table(records)
    if table.num_rows == 0:
        raise ValueError(f"tokenize: {records} holds no records")
    blocks = max(1, min(8, table.num_rows // 256))
    ds = ray.data.from_arrow(table).repartition(blocks)
    ds = ds.map_batches(tokenize_batch, batch_format="numpy", batch_size=256, fn_kwargs=dict(
        target=str(target), max_length=cfg.max_length, mode=cfg.mask, min_loss=cfg.min_loss_tokens,
        chat=chat))
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
    # The cap travels with the tokens: capture stamps it into the data signature.
    good = good.replace_schema_metadata({TOKENS_META: json.dumps({"max_length": cfg.max_length}).encode()})
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
