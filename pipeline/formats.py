"""Corpus record formats (ARCHITECTURE.md §3): ShareGPT, UltraChat / OpenAI messages, question-answer pairs,
served records (the traffic log's rows, pipeline/served.py).

`normalise` turns one parsed record into `[{role, content}]` or a reject reason; `read_records` walks a
.json (list), .jsonl or .parquet file and yields (line number, record or None, reason or None), so a broken line
is a counted reject and never stops the reader.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

from pipeline.served import SERVED_KEYS, served_turns

ROLE_ALIASES = {
    "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "bot": "assistant",
    "chatgpt": "assistant", "model": "assistant", "system": "system",
}
FORMATS = ("sharegpt", "ultrachat", "qa", "served", "auto")


class Reject(Exception):
    """A record that cannot be normalised; `reason` is a short stable key counted in stats."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def detect_format(obj: Any) -> str:
    if not isinstance(obj, dict):
        raise Reject("wrong_type", f"record is {type(obj).__name__}, expected an object")
    if all(k in obj for k in SERVED_KEYS):
        return "served"
    if "conversations" in obj:
        return "sharegpt"
    if "messages" in obj:
        return "ultrachat"
    if "question" in obj and "answer" in obj:
        return "qa"
    if any(k in obj for k in PROMPT_KEYS):
        return "prompt"
    raise Reject("missing_turns", "no 'conversations', 'messages', 'question', 'prompt' or 'instruction' field")


PROMPT_KEYS = ("prompt", "instruction", "question")  # bare prompts: {"prompt"}, Alpaca, GSM8K questions


def prompt_turns(obj: dict) -> list[dict]:
    """A bare prompt -> a user turn (Alpaca: instruction + input), with the answer if the record has one."""
    key = next(k for k in PROMPT_KEYS if k in obj)
    text = obj[key]
    if key == "instruction" and isinstance(obj.get("input"), str) and obj["input"].strip():
        text = f"{text}\n\n{obj['input']}" if isinstance(text, str) else text
    turns = [{"role": "user", "content": text}]
    answer = obj.get("output", obj.get("answer", obj.get("response")))
    if answer is not None:
        turns.append({"role": "assistant", "content": answer})
    return turns


def normalise(obj: Any, fmt: str = "auto", prompt_only: bool = False) -> list[dict]:
    """One record -> [{role, content}], roles user/assistant/system; raise Reject with a reason.
    prompt_only: user turns without answers are kept (the target writes them: regeneration is on)."""
    found = detect_format(obj)
    if fmt != "auto" and found != fmt:
        raise Reject("format_mismatch", f"looks like {found}, source declared {fmt}")
    if found == "served":
        try:
            turns = served_turns(obj)
        except ValueError as e:
            raise Reject("bad_served", str(e)) from None
    elif found == "qa":
        turns = [{"role": "user", "content": obj["question"]}, {"role": "assistant", "content": obj["answer"]}]
    elif found == "prompt":
        turns = prompt_turns(obj)
    else:
        raw = obj["conversations"] if found == "sharegpt" else obj["messages"]
        role_key, text_key = ("from", "value") if found == "sharegpt" else ("role", "content")
        if not isinstance(raw, list):
            raise Reject("wrong_type", f"'{'conversations' if found == 'sharegpt' else 'messages'}' is not a list")
        turns = []
        for t in raw:
            if not isinstance(t, dict):
                raise Reject("wrong_type", "a turn is not an object")
            role = ROLE_ALIASES.get(str(t.get(role_key, t.get("role", t.get("from", "")))).lower())
            if role is None:
                raise Reject("unknown_role", repr(t.get(role_key)))
            turns.append({"role": role, "content": t.get(text_key, t.get("content", t.get("value")))})
    for t in turns:
        if not isinstance(t["content"], str):
            raise Reject("non_string_content", type(t["content"]).__name__)
        if not t["content"].strip():
            raise Reject("empty_content", t["role"])
    return check_order(turns, prompt_only)


def check_order(turns: list[dict], prompt_only: bool = False) -> list[dict]:
    """System turns only first; then user/assistant alternating from a user; at least one assistant
    (unless prompt_only: then a trailing user turn is kept for the target to answer)."""
    body = turns
    while body and body[0]["role"] == "system":
        body = body[1:]
    if not body:
        raise Reject("system_only" if turns else "missing_turns")
    if any(t["role"] == "system" for t in body):
        raise Reject("misplaced_system")
    if body[0]["role"] != "user":
        raise Reject("assistant_first")
    if not prompt_only and not any(t["role"] == "assistant" for t in body):
        raise Reject("no_assistant")
    for a, b in zip(body, body[1:]):
        if a["role"] == b["role"]:
            raise Reject("not_alternating", a["role"])
    # Without regeneration a trailing user turn has no answer to learn from: drop it, not the record.
    if body[-1]["role"] == "user" and not prompt_only:
        turns = turns[:-1]
    return turns


def read_records(path) -> Iterator[tuple[int, Any, str | None]]:
    """Yield (index, parsed object or None, parse-failure reason or None) for a .json, .jsonl or .parquet
    file, local or at a URI (pipeline/storage.py). A Parquet row is one record (a Hugging Face dataset's
    Parquet export, UltraChat's `messages` column say); an unreadable Parquet file is one reject."""
    from pipeline import storage

    name = storage.name(path)
    if name.endswith(".parquet"):
        yield from parquet_records(path)
        return
    data = storage.read_bytes(path)
    whole = name.endswith(".json") or (not name.endswith(".jsonl") and data.lstrip()[:1] == b"[")
    if whole:
        try:
            items = json.loads(data.decode("utf-8"))
        except UnicodeDecodeError:
            yield 0, None, "invalid_utf8"
            return
        except json.JSONDecodeError:
            yield 0, None, "broken_json"
            return
        if not isinstance(items, list):
            items = [items]
        for i, obj in enumerate(items):
            yield i, obj, None
        return
    for i, line in enumerate(data.split(b"\n")):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError:
            yield i, None, "invalid_utf8"
            continue
        try:
            yield i, json.loads(text), None
        except json.JSONDecodeError:
            yield i, None, "broken_json"


def parquet_records(path) -> Iterator[tuple[int, Any, str | None]]:
    from pipeline import storage

    try:
        pf = storage.parquet_file(path)
    except (OSError, ValueError):  # not Parquet, truncated: ArrowInvalid is a ValueError
        yield 0, None, "broken_parquet"
        return
    i = 0
    for batch in pf.iter_batches(batch_size=1024):
        for obj in batch.to_pylist():
            yield i, obj, None
            i += 1


def load_conversations(path: str | Path, fmt: str = "auto") -> tuple[list[list[dict]], dict[str, int]]:
    """All normalisable conversations of a file plus reject counts by reason (simple, single-process)."""
    convs, rejects = [], {}
    for _, obj, reason in read_records(path):
        if reason is None:
            try:
                convs.append(normalise(obj, fmt))
                continue
            except Reject as r:
                reason = r.reason
        rejects[reason] = rejects.get(reason, 0) + 1
    return convs, rejects
