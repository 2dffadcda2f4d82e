"""Regeneration: the target's own greedy answers replace the corpus answers; too-long prompts are skipped."""
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.regenerate import run_regenerate
from pipeline.schema import Regenerate


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
