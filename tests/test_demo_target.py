"""The demo target: an ordinary HF folder that trains, loads through the Auto classes and generates."""
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import demo_target as dt


def test_tiny_preset_trains_fast_and_loss_falls(tiny_target):
    report = json.loads((tiny_target / "report.json").read_text())
    # Seconds, not minutes: 33.6 s on a 32 GFLOP/s-a-thread AVX2 EPYC with the suite alone on it (it hit
    # its 6-minute cap beside a demo run). An emulated-bf16 path (~100x slower) would blow past this.
    assert report["train_s"] <= 180, report["train_s"]
    assert report["val_loss"] < 0.5 * report["first_loss"]
    assert report["final_train_loss"] < report["first_loss"] - 2.0
    assert report["layers"] == 8 and report["heldout_prompts"] == 20


def test_loads_through_auto_classes_and_generates(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    model = AutoModelForCausalLM.from_pretrained(tiny_target)
    assert type(model).__name__ == "LlamaForCausalLM"
    cfg = model.config
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert (tiny_target / "model.safetensors").is_file() and not list(tiny_target.glob("*.bin"))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of Kaloria?"}],
                                  add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert out.shape[1] > ids.shape[1]
    # Greedy decoding is reproducible from the saved folder.
    again = AutoModelForCausalLM.from_pretrained(tiny_target).generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
    assert torch.equal(out, again)


def test_assistant_mask_covers_exactly_assistant_content(tiny_target):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    conv = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! 你好"},
            {"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."},
            {"role": "user", "content": "Thanks"}, {"role": "assistant", "content": " Bye\nnow"}]
    enc = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = enc["input_ids"], enc["assistant_masks"]
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    want = [m["content"] + "<|im_end|>" for m in conv if m["role"] == "assistant"]
    assert [tok.decode(s) for s in spans] == want
    # Nothing else is masked in: the masked count equals the tokens of those spans exactly.
    assert sum(mask) == sum(len(tok(w, add_special_tokens=False)["input_ids"]) for w in want)


def test_config_override_and_reuse(tiny_target, capsys):
    t0 = time.time()
    corpus = json.loads((tiny_target / "report.json").read_text())["recipe"]["corpus"]
    dt.main(["--out", str(tiny_target), "--preset", "tiny", "--corpus", *corpus, "--reuse"])
    assert "reusing the target" in capsys.readouterr().out and time.time() - t0 < 10


def test_distinct_2():
    assert dt.distinct_2([[1, 2, 3], [1, 2, 4]]) == 3 / 4
    assert dt.distinct_2([[5, 5, 5, 5]]) == 1 / 3
