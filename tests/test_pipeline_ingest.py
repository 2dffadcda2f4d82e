"""Ingest and tokenize on bad input: every bad record counted under its reason, every good one kept."""
import json

import pyarrow.parquet as pq
import pytest

from conftest import pipeline_tree, write_yaml
from pipeline.yaml_config import load_config
from pipeline.ingest import mix_counts
from pipeline.config import PipelineConfig, Source

GOOD = [
    {"id": f"good-{i}", "conversations": [{"from": "human", "value": f"What is {i} + {i}?"},
                                         {"from": "gpt", "value": f"{i} + {i} = {2 * i}."}]}
    for i in range(6)
]
# (reason, raw line) for one record of each malformed kind
BAD = [
    ("broken_json", b'{"conversations": [{"from": "human", "value": "hi"}'),
    ("wrong_type", b'["not", "an", "object"]'),
    ("missing_turns", b'{"id": "x1", "text": "no turns here"}'),
    ("unknown_role", json.dumps({"conversations": [{"from": "wizard", "value": "abracadabra"},
                                                   {"from": "gpt", "value": "ok"}]}).encode()),
    ("empty_content", json.dumps({"conversations": [{"from": "human", "value": "   "},
                                                    {"from": "gpt", "value": "ok"}]}).encode()),
    ("non_string_content", json.dumps({"conversations": [{"from": "human", "value": 42},
                                                         {"from": "gpt", "value": "ok"}]}).encode()),
    ("no_assistant", json.dumps({"conversations": [{"from": "human", "value": "anyone there?"}]}).encode()),
    ("assistant_first", json.dumps({"conversations": [{"from": "gpt", "value": "I start"},
                                                      {"from": "human", "value": "odd"}]}).encode()),
    ("system_only", json.dumps({"conversations": [{"from": "system", "value": "You are terse."}]}).encode()),
    ("too_long", json.dumps({"conversations": [{"from": "human", "value": "long " * 400},
                                               {"from": "gpt", "value": "ok"}]}).encode()),
    ("duplicate", json.dumps({"id": "dup", "conversations": [{"from": "human", "value": "What is  0 + 0?"},
                                                              {"from": "gpt", "value": "0 + 0 = 0."}]}).encode()),
    ("invalid_utf8", b'{"conversations": [{"from": "human", "value": "caf\xe9"}, {"from": "gpt", "value": "x"}]}'),
    ("format_mismatch", json.dumps({"messages": [{"role": "user", "content": "mixed formats"},
                                                 {"role": "assistant", "content": "in one file"}]}).encode()),
    ("not_alternating", json.dumps({"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"},
                                                      {"from": "gpt", "value": "c"}]}).encode()),
]


def test_bad_records_counted_good_records_kept(tmp_path, ray_cluster, tiny_target):
    corpus = tmp_path / "bad.jsonl"
    lines = [json.dumps(g).encode() for g in GOOD[:3]] + [raw for _, raw in BAD] + \
            [json.dumps(g).encode() for g in GOOD[3:]] + [b"", b"   "]
    corpus.write_bytes(b"\n".join(lines) + b"\n")
    tree = pipeline_tree(tmp_path / "run", tiny_target, corpus)
    tree["ingest"] = {"sources": [{"path": str(corpus), "format": "sharegpt"}], "max_chars": 1000}
    tree["capture"]["enabled"] = False
    tree["vocab"]["enabled"] = False
    from pipeline.__main__ import run

    summary = run(load_config(PipelineConfig, write_yaml(tmp_path / "c.yaml", tree)))
    ing = summary["ingest"]
    assert len(BAD) >= 12
    assert ing["rejected_by_reason"] == {reason: 1 for reason, _ in BAD}
    assert ing["read"] == len(GOOD) + len(BAD) and ing["records"] == len(GOOD)
    out = [json.loads(x) for x in (tmp_path / "run/ingest/records.jsonl").open()]
    assert sorted(r["id"] for r in out) == sorted(g["id"] for g in GOOD)
    rejects = [json.loads(x) for x in (tmp_path / "run/ingest/rejects.jsonl").open()]
    assert sorted(r["reason"] for r in rejects) == sorted(reason for reason, _ in BAD)
    stats = json.loads((tmp_path / "run/ingest/stats.json").read_text())
    assert stats["sources"]["bad.jsonl"]["rejected"]["duplicate"] == 1
    toks = pq.read_table(tmp_path / "run/tokenize/tokens.parquet")
    assert sorted(toks["id"].to_pylist()) == sorted(g["id"] for g in GOOD)


def test_tokenize_over_max_length_and_no_mask(tmp_path, ray_cluster, tiny_target, demo_corpus):
    tree = pipeline_tree(tmp_path / "run", tiny_target, demo_corpus / "train.jsonl", records=20)
    tree["tokenize"]["max_length"] = 8  # every assistant turn starts after token 8
    tree["capture"]["enabled"] = False
    tree["vocab"]["enabled"] = False
    from pipeline.__main__ import main

    cfg = write_yaml(tmp_path / "c.yaml", tree)
    with pytest.raises(SystemExit) as e:
        main([str(cfg)])
    assert e.value.code == 1
    rejects = [json.loads(x) for x in (tmp_path / "run/tokenize/rejects.jsonl").open()]
    assert len(rejects) == 20 and {r["reason"] for r in rejects} == {"no_loss_tokens"}


def test_render_fallback_mask_equals_generation_markers(pipeline_run, tiny_target):
    from pipeline.tokenize import load_tokenizer, mask_by_markers, mask_by_render

    tok = load_tokenizer(str(tiny_target))
    records = [json.loads(x) for x in (pipeline_run / "ingest/records.jsonl").open()]
    assert len(records) == 64
    for rec in records:
        assert mask_by_render(tok, rec["messages"]) == mask_by_markers(tok, rec["messages"])


def test_inspect_marks_spans(pipeline_run, tiny_target, capsys):
    from pipeline.tokenize import inspect

    text = inspect(pipeline_run / "tokenize/tokens.parquet", tiny_target, 2)
    assert text.count("--- ") == 2 and "[[" in text and "<|im_end|>]]" in text
    assert "<|im_start|>assistant\n[[" in text


def test_mix_by_weight(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("")
    b.write_text("")
    srcs = [Source(path=a, weight=3), Source(path=b, weight=1)]
    assert mix_counts({"a.jsonl": 100, "b.jsonl": 100}, srcs, None) == {"a.jsonl": 100, "b.jsonl": 33}
    assert mix_counts({"a.jsonl": 100, "b.jsonl": 100}, srcs, 40) == {"a.jsonl": 30, "b.jsonl": 10}
    capped = [Source(path=a, max_records=5), Source(path=b)]
    assert mix_counts({"a.jsonl": 100, "b.jsonl": 7}, capped, None) == {"a.jsonl": 5, "b.jsonl": 7}


def test_multi_source_mix_is_seeded(tmp_path, ray_cluster, tiny_target, data_dir):
    from pipeline.ingest import run_ingest
    from pipeline.config import Ingest

    cfg = Ingest(sources=[{"path": data_dir / "chat/fastchat_dummy_conversation.sharegpt.json", "weight": 1},
                          {"path": data_dir / "chat/oasst1_zh_689.ultrachat.jsonl", "weight": 1}],
                 total_records=200, seed=1)
    s1 = run_ingest(cfg, tmp_path / "a")
    s2 = run_ingest(cfg, tmp_path / "b")
    assert s1["records"] == 200
    assert (tmp_path / "a/records.jsonl").read_bytes() == (tmp_path / "b/records.jsonl").read_bytes()
    assert {k: v["selected"] for k, v in s1["sources"].items()} == {
        "fastchat_dummy_conversation.sharegpt.json": 100, "oasst1_zh_689.ultrachat.jsonl": 100}
    for st in s1["sources"].values():  # nothing vanishes: read = rejected + selected + not sampled
        assert st["read"] == sum(st["rejected"].values()) + st["selected"] + st["not_sampled"]
