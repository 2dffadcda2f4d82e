"""The demo corpus: deterministic per seed, bilingual, and its worked answers are arithmetically right."""
import hashlib
import json
import re

from infer.demo import corpus as dc


def digest(out) -> str:
    return hashlib.sha256((out / "train.jsonl").read_bytes() + (out / "val.jsonl").read_bytes()).hexdigest()


def test_deterministic_per_seed(tmp_path):
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    dc.main(["--out", str(a), "--seed", "3", "--size-mb", "0.2"])
    dc.main(["--out", str(b), "--seed", "3", "--size-mb", "0.2"])
    dc.main(["--out", str(c), "--seed", "4", "--size-mb", "0.2"])
    assert digest(a) == digest(b)
    assert digest(a) != digest(c)


def test_size_and_content_mix(demo_corpus):
    stats = json.loads((demo_corpus / "stats.json").read_text())
    assert 0.5 * 2**20 <= stats["bytes"] <= 0.52 * 2**20
    recs = [json.loads(line) for line in (demo_corpus / "train.jsonl").open()]
    assert len(recs) == stats["train_records"] and len({r["id"] for r in recs}) == len(recs)
    text = [m["value"] for r in recs for m in r["conversations"]]
    assert 0.15 < stats["chinese_share"] < 0.4
    for marker in ("```python", "step by step", "capital of", "一步一步"):
        assert sum(marker in t for t in text) > 20, marker
    multi = sum(sum(m["from"] == "gpt" for m in r["conversations"]) >= 2 for r in recs)
    assert multi > len(recs) // 5
    # Varied, not copied: most assistant answers are unique strings.
    answers = [m["value"] for r in recs for m in r["conversations"] if m["from"] == "gpt"]
    assert len(set(answers)) > 0.6 * len(answers)


def test_worked_answers_are_correct(demo_corpus):
    ops = {"+": int.__add__, "-": int.__sub__, "x": int.__mul__, "/": int.__floordiv__}
    checked = 0
    for line in (demo_corpus / "train.jsonl").open():
        for m in json.loads(line)["conversations"]:
            if m["from"] != "gpt":
                continue
            for a, op, b, c in re.findall(r"(\d+) ([-+x/]) (\d+) = (\d+)", m["value"]):
                assert ops[op](int(a), int(b)) == int(c), m["value"]
                checked += 1
    assert checked > 500
