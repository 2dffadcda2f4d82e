"""Benchmark readers (local files): MT-Bench, GSM8K, C-Eval and any jsonl of prompts.

Every reader returns items `{"id": str, "turns": [user message, ...]}`; a later turn is asked after the
model's own answer to the earlier ones (MT-Bench's second question).
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

CEVAL_PROMPT = "以下是中国关于{subject}考试的单项选择题，请选出其中的正确答案。\n\n"


def read_mt_bench(path: Path, limit: int | None = None) -> list[dict]:
    rows = [json.loads(x) for x in Path(path).open(encoding="utf-8") if x.strip()]
    return [{"id": f"mt_bench-{r['question_id']}", "turns": list(r["turns"]), "category": r.get("category")}
            for r in rows[:limit]]


def read_gsm8k(path: Path, limit: int | None = None) -> list[dict]:
    rows = [json.loads(x) for x in Path(path).open(encoding="utf-8") if x.strip()]
    return [{"id": f"gsm8k-{i}", "turns": [r["question"]]} for i, r in enumerate(rows[:limit])]


def _ceval_question(row: dict, with_answer: bool) -> str:
    text = row["question"].strip() + "\n" + "\n".join(f"{k}. {row[k]}" for k in "ABCD") + "\n答案："
    return text + (row["answer"] + "\n\n" if with_answer else "")


def read_ceval(folder: Path, limit: int | None = None, few_shot: int = 0) -> list[dict]:
    """C-Eval val CSVs (`val/<subject>_val.csv`), the official Chinese prompt; `few_shot` dev examples."""
    folder = Path(folder)
    mapping = json.loads((folder / "subject_mapping.json").read_text(encoding="utf-8"))
    items = []
    for f in sorted((folder / "val").glob("*_val.csv")):
        subject = f.name[: -len("_val.csv")]
        zh = mapping.get(subject, [subject, subject])[1]
        shots = ""
        dev = folder / "dev" / f"{subject}_dev.csv"
        if few_shot and dev.is_file():
            with dev.open(encoding="utf-8", newline="") as fh:
                shots = "".join(_ceval_question(r, True) for r in list(csv.DictReader(fh))[:few_shot])
        with f.open(encoding="utf-8", newline="") as fh:
            for r in csv.DictReader(fh):
                items.append({"id": f"ceval-{subject}-{r['id']}", "answer": r["answer"],
                              "turns": [CEVAL_PROMPT.format(subject=zh) + shots + _ceval_question(r, False)]})
    return items[:limit]


def read_jsonl(path: Path, limit: int | None = None) -> list[dict]:
    """Generic prompts: {"prompt": str} or {"turns": [str, ...]} (HumanEval, MATH-500, CMMLU, Alpaca ...)."""
    items = []
    for i, line in enumerate(Path(path).open(encoding="utf-8")):
        if not line.strip():
            continue
        r = json.loads(line)
        turns = r.get("turns") or [r.get("prompt") or r.get("question") or r.get("instruction")]
        if not turns or not all(isinstance(t, str) and t for t in turns):
            raise ValueError(f"{path}:{i + 1}: need a non-empty 'prompt' (or 'turns', 'question', 'instruction')")
        items.append({"id": str(r.get("id", f"{Path(path).stem}-{i}")), "turns": turns})
    return items[:limit]


READERS = {"mt_bench": read_mt_bench, "gsm8k": read_gsm8k, "ceval": read_ceval, "jsonl": read_jsonl}


# Prompt sets for the decoding tools (bench_decode, check_lossless, check_vllm, bench_serve): the
# benchmark files the repo ships in data/ (data/README.md), or another folder of the same layout.
DATA_DIR = Path(__file__).resolve().parents[1] / "data"


def default_prompts(data: Path | None, n: int) -> list[str]:
    """n prompts: MT-Bench first turns (half, at most its 80) and GSM8K test questions for the rest."""
    data = Path(data) if data else DATA_DIR
    if not (data / "mt_bench" / "question.jsonl").is_file():
        raise FileNotFoundError(f"{data}: no mt_bench/question.jsonl; pass --data DIR or --prompts FILE")
    mt = [it["turns"][0] for it in read_mt_bench(data / "mt_bench" / "question.jsonl", n // 2)]
    return mt + [it["turns"][0] for it in read_gsm8k(data / "gsm8k" / "test.jsonl", n - len(mt))]


def prompt_file(path: Path) -> list[str]:
    """First turns of a jsonl of prompts (see read_jsonl)."""
    return [it["turns"][0] for it in read_jsonl(path)]


SOURCES = ("mt_bench", "gsm8k", "ceval", "chat")


def source_prompts(name: str, data: Path | None = None) -> list[str]:
    """First user turns of one source: a benchmark the data folder holds (MT-Bench, GSM8K test, C-Eval
    val), its chat corpora (`chat/`, every file), or a jsonl of prompts at that path."""
    data = Path(data) if data else DATA_DIR
    if name == "mt_bench":
        return [it["turns"][0] for it in read_mt_bench(data / "mt_bench" / "question.jsonl")]
    if name == "gsm8k":
        return [it["turns"][0] for it in read_gsm8k(data / "gsm8k" / "test.jsonl")]
    if name == "ceval":
        return [it["turns"][0] for it in read_ceval(data / "ceval")]
    if name == "chat":  # each file's first user turns, the files interleaved
        from pipeline.formats import load_conversations

        files = [load_conversations(f)[0] for f in sorted((data / "chat").iterdir()) if f.is_file()]
        return interleave([[next(t["content"] for t in c if t["role"] == "user") for c in convs
                            if any(t["role"] == "user" for t in c)] for convs in files])
    if Path(name).is_file():
        return prompt_file(Path(name))
    raise ValueError(f"prompt source {name!r}: not one of {', '.join(SOURCES)} nor a jsonl file")


def prompt_set(spec: str, data: Path | None = None) -> list[str]:
    """Comma-separated sources (`source_prompts`) -> their prompts, interleaved."""
    return interleave([source_prompts(s.strip(), data) for s in spec.split(",") if s.strip()])


def interleave(lists: list[list[str]]) -> list[str]:
    """One of each list in turn (so any first n hold every list), repeats dropped."""
    out, seen = [], set()
    for i in range(max((len(x) for x in lists), default=0)):
        for x in lists:
            if i < len(x) and x[i] not in seen:
                seen.add(x[i])
                out.append(x[i])
    return out


def disjoint_sets(tune: str, report: str, data: Path | None = None) -> tuple[list[str], list[str]]:
    """The tuning and report prompt sets, refused unless split by source: no source named in both, no prompt
    text in both."""
    shared = {s.strip() for s in tune.split(",")} & {s.strip() for s in report.split(",")}
    if shared:
        raise ValueError(f"--tune-prompts and --report-prompts share {', '.join(sorted(shared))}: split by source")
    a, b = prompt_set(tune, data), prompt_set(report, data)
    both = set(a) & set(b)
    if both:
        raise ValueError(f"--tune-prompts and --report-prompts share {len(both)} prompts: {next(iter(both))[:60]!r}")
    return a, b


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """One user message through the target's chat template, with the generation prompt."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
