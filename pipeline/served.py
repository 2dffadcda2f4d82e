"""Served records: the traffic log's format (docs/USAGE.md "Learning from traffic"), one owner for its
writer (the endpoint, infer/traffic_log.py) and its reader (ingest's `format: served`).

One Parquet row per finished decode. `output_ids` / `output_text` are the target's own answer (our decode is
lossless), so ingest skips regeneration for these records. `accepted[i]` is the draft tokens accepted in
drafting round i and `round_starts[i]` the output index of that round's first new token: the draft was
rejected at output index `round_starts[i] + accepted[i]` whenever `accepted[i] < depth`.
"""
from __future__ import annotations

import json

import pyarrow as pa

SERVED_SCHEMA = pa.schema([
    ("request_id", pa.string()),
    ("model", pa.string()),
    ("route", pa.string()),                 # chat | completion
    ("messages", pa.string()),              # chat: JSON [{role, content}]; completion: the prompt as one user turn
    ("prompt_tokens", pa.int32()),
    ("output_ids", pa.list_(pa.int32())),
    ("output_text", pa.string()),
    ("finish_reason", pa.string()),
    ("temperature", pa.float32()),
    ("depth", pa.int16()),
    ("accepted", pa.list_(pa.int16())),
    ("round_starts", pa.list_(pa.int32())),
    ("tau", pa.float32()),
    ("head_version", pa.string()),          # "" when the target served alone
    ("started_at", pa.float64()),           # unix seconds
    ("finished_at", pa.float64()),
])
SERVED_KEYS = ("output_ids", "head_version", "finished_at")  # what marks a record as served (detect_format)


def served_row(*, request_id: str, model: str, route: str, messages: list[dict], prompt_tokens: int,
               output_ids: list[int], output_text: str, finish_reason: str | None, temperature: float, depth: int,
               accepted: list[int], round_starts: list[int], tau: float, head_version: str | None,
               started_at: float, finished_at: float) -> dict:
    """One finished decode as a row of SERVED_SCHEMA."""
    return {"request_id": request_id, "model": model, "route": route,
            "messages": json.dumps(messages, ensure_ascii=False), "prompt_tokens": prompt_tokens,
            "output_ids": list(output_ids), "output_text": output_text, "finish_reason": finish_reason or "",
            "temperature": temperature, "depth": depth, "accepted": list(accepted),
            "round_starts": list(round_starts), "tau": tau, "head_version": head_version or "",
            "started_at": started_at, "finished_at": finished_at}


def served_turns(obj: dict) -> list[dict]:
    """A served row -> its conversation: the request's turns, then the answer the target gave. Raises
    ValueError naming what is wrong (ingest counts it as a reject)."""
    try:
        turns = json.loads(obj["messages"]) if isinstance(obj["messages"], str) else obj["messages"]
    except (json.JSONDecodeError, TypeError):
        raise ValueError("messages is not a JSON list of turns") from None
    if not isinstance(turns, list) or not turns:
        raise ValueError("messages is not a JSON list of turns")
    if obj.get("route") == "completion":
        raise ValueError("a completions request: its prompt is raw text, not a chat to template")
    answer = obj.get("output_text")
    if not isinstance(answer, str) or not answer.strip():
        raise ValueError("empty answer")
    return [{"role": t.get("role"), "content": t.get("content")} for t in turns] + \
        [{"role": "assistant", "content": answer}]


def rejections(accepted: list[int], round_starts: list[int], depth: int) -> list[int]:
    """Output indices where a drafting round's draft was rejected (the target's token replaced it)."""
    return [s + a for a, s in zip(accepted, round_starts) if a < depth]


def time_split(rows: list[dict], held_out: float) -> tuple[list[dict], list[dict]]:
    """Records ordered by when they finished -> (training, held-out): the latest `held_out` share is held out,
    so a candidate is judged on traffic later than anything it learnt from. Any held-out share > 0 of two
    or more records holds out at least one."""
    if not 0 <= held_out < 1:
        raise ValueError(f"held_out: {held_out} must be in [0, 1)")
    ordered = sorted(rows, key=lambda r: (r["finished_at"], r["id"]))
    k = 0 if held_out == 0 or len(ordered) < 2 else max(1, round(len(ordered) * held_out))
    return ordered[:len(ordered) - k], ordered[len(ordered) - k:]
