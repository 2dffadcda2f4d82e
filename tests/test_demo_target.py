"""The demo target: an ordinary HF folder that trains, loads through the Auto classes and generates."""
import json
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from infer.demo import target as dt


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


def test_shipped_target_is_used_checked_and_refused(tiny_target, tmp_path, capsys):
    """`--shipped`: a target shipped for this recipe and corpus is written out in fp32 without training; a
    corrupted file is refused in one line; another recipe trains instead."""
    corpus = json.loads((tiny_target / "report.json").read_text())["recipe"]["corpus"]
    shipped = tmp_path / "data" / "demo_target"
    dt.ship(tiny_target, shipped)
    import hashlib

    (tmp_path / "data/SHA256SUMS").write_text("".join(
        f"{hashlib.sha256(f.read_bytes()).hexdigest()}  ./demo_target/{f.name}\n" for f in sorted(shipped.iterdir())))
    assert (shipped / "model.safetensors").stat().st_size < 0.6 * (tiny_target / "model.safetensors").stat().st_size
    t0 = time.time()
    report = dt.main(["--out", str(tmp_path / "out"), "--preset", "tiny", "--corpus", *corpus, "--shipped", str(shipped)])
    assert time.time() - t0 < 30 and report["shipped_from"] == str(shipped)
    assert "shipped in" in capsys.readouterr().out
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    theirs = AutoModelForCausalLM.from_pretrained(tiny_target)
    assert ours.dtype == torch.float32
    for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values()):
        assert torch.equal(a, b.to(torch.bfloat16).float()), name  # the bf16-rounded trained weights
    # A recipe the shipped target was not trained from is not copied (main then trains one).
    other = dt.TargetRecipe(out=tmp_path / "other", preset="tiny", corpus=list(corpus), steps=2)
    assert dt.use_shipped(other, shipped) is None and not (tmp_path / "other").exists()
    assert "trained from another recipe" in capsys.readouterr().out
    raw = bytearray((shipped / "model.safetensors").read_bytes())
    raw[-1] ^= 1
    (shipped / "model.safetensors").write_bytes(bytes(raw))
    try:
        dt.main(["--out", str(tmp_path / "bad"), "--preset", "tiny", "--corpus", *corpus, "--shipped", str(shipped)])
    except SystemExit as exc:
        assert "model.safetensors does not match its sha256" in str(exc)
    else:
        raise AssertionError("a corrupted shipped target was used")
