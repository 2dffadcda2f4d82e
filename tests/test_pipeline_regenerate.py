"""Regeneration: the target's own greedy answers replace the corpus answers; too-long prompts are skipped."""
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.regenerate import run_regenerate
from pipeline.config import Regenerate


def test_regenerate_greedy_matches_target_and_counts(tmp_path, ray_cluster, tiny_target):
    recs = [{"id": f"r{i}", "source": "t", "messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": "placeholder answer"},
        {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "second placeholder"}]}
        for i, q in enumerate(["What is the capital of Kaloria?", "小明有5个苹果。", "Write a Python function.",
                               "Hi!", "How many people live in Sanvenia?"])]
    recs.append({"id": "long", "source": "t", "messages": [{"role": "user", "content": "word " * 2100},
                                                           {"role": "assistant", "content": "kept as is"}]})
    src = tmp_path / "records.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    stats = run_regenerate(Regenerate(enabled=True, max_new_tokens=24, batch_size=4, num_cpus_per_actor=1),
                           tiny_target, src, tmp_path / "out")
    assert stats == stats | {"records": 6, "success": 5, "skipped": 1, "errored": 0, "dropped": 0}
    out = {r["id"]: r for r in map(json.loads, (tmp_path / "out/records.jsonl").open())}
    assert len(out) == 6 and out["long"]["messages"] == recs[-1]["messages"] and not out["long"]["regenerated"]
    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target).eval()
    for r in recs[:5]:
        msgs = out[r["id"]]["messages"]
        assert [m["role"] for m in msgs] == [m["role"] for m in r["messages"]]
        for k in (1, 3):  # each answer is the target's greedy continuation of the regenerated history
            ids = tok.apply_chat_template(msgs[:k], add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)["input_ids"]
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False)
            want = tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True).strip()
            assert msgs[k]["content"] == want


def test_prompt_only_records_are_answered_and_bad_records_counted(tmp_path, ray_cluster, tiny_target, data_dir):
    """ShareGPT first-turn prompts (500 GSM8K test questions as one-turn ShareGPT records): all rejected as
    no_assistant without regeneration, all accepted with it; the target then writes each answer. A record the chat template cannot render is counted with its
    reason and dropped (it has no answer of its own to keep); the run goes on."""
    # a copy: the test touches the weights' mtime, and other xdist workers share the session's target
    tiny_target = Path(shutil.copytree(tiny_target, tmp_path / "target"))
    from pipeline.ingest import run_ingest
    from pipeline.config import Ingest

    questions = [json.loads(x)["question"] for x in (data_dir / "gsm8k/test.jsonl").open()][:500]
    src = tmp_path / "prompts.sharegpt.json"
    src.write_text(json.dumps([{"id": f"q{i}", "conversations": [{"from": "human", "value": q}]}
                               for i, q in enumerate(questions)]))
    ing = Ingest(sources=[{"path": str(src), "format": "sharegpt"}])
    off = run_ingest(ing, tmp_path / "off")
    on = run_ingest(ing, tmp_path / "on", prompt_only=True)
    assert off["records"] == 0 and off["rejected_by_reason"] == {"no_assistant": 500}
    assert on["read"] == on["records"] == on["prompt_only"] == 500 and on["rejected"] == 0
    assert "no_assistant" not in on["rejected_by_reason"]
    recs = [json.loads(x) for x in (tmp_path / "on/records.jsonl").open()][:5]
    recs.append({"id": "bad", "source": "t", "messages": [{"role": "user", "content": None}]})
    gsm = {"id": "gsm", "source": "t", "messages": [{"role": "user", "content": "Tom has 3 apples and buys 4. How many?"}]}
    recs.append(gsm)
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    stats = run_regenerate(Regenerate(enabled=True, max_new_tokens=16, batch_size=4), tiny_target, path, tmp_path / "r")
    assert stats == stats | {"records": 7, "success": 6, "errored": 1, "dropped": 1}
    assert stats["reasons"] == {"chat_template": 1}
    out = [json.loads(x) for x in (tmp_path / "r/records.jsonl").open()]
    assert len(out) == 6 and all(r["messages"][-1]["role"] == "assistant" and r["messages"][-1]["content"]
                                 for r in out)
    fail = [json.loads(x) for x in (tmp_path / "r/failures.jsonl").open()]
    assert [(f["id"], f["status"], f["kept"]) for f in fail] == [("bad", "errored", False)]
    again = run_regenerate(Regenerate(enabled=True, max_new_tokens=16, batch_size=4), tiny_target, path, tmp_path / "r")
    assert again["reused"] and again["success"] == 6  # a finished run is not redone
    # A run killed after its first chunk (16 records a chunk at batch_size 4): the rerun does the rest only.
    small = Regenerate(enabled=True, max_new_tokens=16, batch_size=1)  # 4 records a chunk: chunks 0 and 1
    first = run_regenerate(small, tiny_target, path, tmp_path / "k")
    before = (tmp_path / "k/records.jsonl").read_text()
    (tmp_path / "k/stats.json").unlink()
    (tmp_path / "k/parts/part-00001.parquet").unlink()
    resumed = run_regenerate(small, tiny_target, path, tmp_path / "k")
    assert (first["chunks"], first["chunks_reused"], resumed["chunks_reused"]) == (2, 0, 1)
    assert (tmp_path / "k/records.jsonl").read_text() == before
    weights = tiny_target / "model.safetensors"  # the target retrained in place: new answers are due
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    try:
        fresh = run_regenerate(Regenerate(enabled=True, max_new_tokens=16, batch_size=4), tiny_target, path,
                               tmp_path / "r")
        assert "reused" not in fresh and fresh["success"] == 6
    finally:
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.slow
def test_vllm_engine_writes_the_same_answers_as_hf(tmp_path, ray_cluster, tiny_target):
    """regenerate.engine=vllm (vLLM's CPU build inside a Ray Data actor): same statuses, and at T=0 the
    same answers as the HF engine on multi-turn records (each turn conditioned on the regenerated ones)."""
    recs = [{"id": f"r{i}", "source": "t", "messages": [
        {"role": "user", "content": q}, {"role": "assistant", "content": "placeholder"},
        {"role": "user", "content": "And then?"}]}
        for i, q in enumerate(["What is the capital of Kaloria?", "小明有5个苹果。", "Write a Python function.",
                               "Hi!", "How many people live in Sanvenia?", "What is 12 times 7?"])]
    src = tmp_path / "records.jsonl"
    src.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    base = dict(enabled=True, max_new_tokens=24, batch_size=4)
    hf = run_regenerate(Regenerate(**base), tiny_target, src, tmp_path / "hf")
    vl = run_regenerate(Regenerate(**base, engine="vllm", vllm={"max_model_len": 512}), tiny_target, src,
                        tmp_path / "vllm")
    assert hf["success"] == vl["success"] == 6 and vl["engine"] == "vllm"
    a = {r["id"]: r["messages"] for r in map(json.loads, (tmp_path / "hf/records.jsonl").open())}
    b = {r["id"]: r["messages"] for r in map(json.loads, (tmp_path / "vllm/records.jsonl").open())}
    assert all(len(b[k]) == 4 for k in b)  # both answers written, the trailing user turn answered
    same = sum(a[k] == b[k] for k in a)
    assert same >= 5, (same, a, b)
