"""The one screen `make demo` ends with, from the files each step writes (infer/demo/summary.py)."""
import json

from infer.demo.summary import lines


def write(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj))


def test_summary_names_every_output_and_each_benchmark(tmp_path):
    d = tmp_path / "demo"
    write(d / "target/report.json", {"params": 13181184, "steps_run": 220, "val_loss": 1.93, "hit_time_cap": False})
    write(d / "data/summary.json", {"capture": {"rows": 1200, "tokens": 198000, "shards": 6},
                                    "vocab": {"draft_vocab_size": 512}})
    write(d / "head/report.json", {"steps": 300, "best": {"sim_tau": 2.71, "step": 300, "val_acc": [0.6, 0.5, 0.4]}})
    write(d / "decode.json", {"prompts": [{"prompt": "Sam has 17 marbles.", "eagle3": "Sam has\n 20 marbles."}],
                              "vanilla_tokens_per_s": 50.0, "eagle3_tokens_per_s": 110.0, "speedup": 2.2,
                              "identical": 1})
    write(d / "report/report.json", {"benchmarks": {"mt_bench": {"tau": 2.9, "speedup": 1.8, "match_rate": 1.0},
                                                    "gsm8k": {"tau": 3.1, "speedup": 2.0, "match_rate": 1.0}}})
    write(d / "serve.json", {"endpoint": "http://127.0.0.1:8000/v1", "model": "eagleray-demo", "tau": 2.5,
                             "question": "Sum a list?", "answer": "def f(xs):\n    return sum(xs)"})
    out = lines(d, seconds=600)
    text = "\n".join(out)
    assert out[1] == "EagleRay demo: done in 10.0 min"
    assert "13.2M-parameter Llama, 220 steps" in text and "1200 conversations, 198000 tokens" in text
    assert "held-out simulated tau 2.71 (chain of 3)" in text and "2.20x" in text and "A: Sam has 20 marbles." in text
    assert any("mt_bench  tau 2.90   speedup 1.80x" in ln for ln in out)
    assert any("gsm8k     tau 3.10   speedup 2.00x" in ln for ln in out)
    assert "A: def f(xs): return sum(xs)" in text and "fluent but often wrong" in text
    assert "13.2M-parameter model trained in minutes on generated chats (trained here)" in text
    assert "max_minutes" not in text and len(out) <= 24  # fits one screen
    assert "tau 2.50" in text
    write(d / "target/report.json", {"params": 13181184, "steps_run": 48, "hit_time_cap": True})
    assert "max_minutes" in "\n".join(lines(d))
    write(d / "target/report.json", {"params": 952384, "steps_run": 400, "shipped_from": "data/demo_target"})
    assert "1.0M-parameter model trained in minutes on generated chats (shipped in data/demo_target/" in "\n".join(lines(d))
    write(d / "report/report.json", {"benchmarks": {"gsm8k": {
        "tau": 1.15, "speedup": 0.99, "match_rate": 1.0, "drafting_share": 0.31, "fixed": {"speedup": 0.82}}}})
    both = lines(d)  # the adaptive default beside the fixed tree, and how often it drafted
    assert any("gsm8k     tau 1.15   speedup 0.99x (fixed tree 0.82x), drafted 31% of rounds" in ln for ln in both)
    assert len(both) <= 24
