"""Prompt sets for the decoding tools: MT-Bench first turns, GSM8K questions, or a jsonl of {"prompt"}."""
from __future__ import annotations

import json
from pathlib import Path

DEFAULT_SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def mt_bench(shared: Path, n: int) -> list[str]:
    rows = [json.loads(x) for x in (shared / "mt_bench" / "question.jsonl").open(encoding="utf-8")]
    return [r["turns"][0] for r in rows[:n]]


def gsm8k(shared: Path, n: int) -> list[str]:
    rows = [json.loads(x) for x in (shared / "gsm8k" / "test.jsonl").open(encoding="utf-8")]
    return [r["question"] for r in rows[:n]]


def prompt_file(path: Path) -> list[str]:
    out = []
    for i, line in enumerate(Path(path).open(encoding="utf-8")):
        if line.strip():
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
                raise ValueError(f"{path}:{i + 1}: expected {{\"prompt\": str}}")
            out.append(rec["prompt"])
    return out


def default_prompts(shared: Path | None, n: int) -> list[str]:
    """n prompts: MT-Bench first turns (half, at most its 80) and GSM8K test questions for the rest."""
    shared = Path(shared) if shared else DEFAULT_SHARED
    if not (shared / "mt_bench" / "question.jsonl").is_file():
        raise FileNotFoundError(f"{shared}: no mt_bench/question.jsonl; pass --shared DIR or --prompts FILE")
    mt = mt_bench(shared, n // 2)
    return mt + gsm8k(shared, n - len(mt))


def chat_ids(tokenizer, prompt: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
