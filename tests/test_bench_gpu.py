"""tools/bench/gpu.py on its tiny CPU shape (the GPU run is the same code at Llama-3.1-8B shapes), and the
device rules of the trainer's target lm_head."""
import json
import sys
from pathlib import Path

import pytest
import torch

from pipeline.target import LogitRule
from trainer.target_parts import TargetParts

from tools.bench import gpu as bench_gpu


def test_bench_gpu_tiny_shape_runs_every_section(tmp_path):
    out = tmp_path / "gpu.json"
    res = bench_gpu.main(["--shape", "tiny", "--device", "cpu", "--reps", "2", "--out", str(out)])
    assert json.loads(out.read_text())["train"] == res["train"]
    for name in ("hardware", "capture", "ttt_attention", "train", "train_blocked", "target_hf", "target_lean",
                 "target_lean_exact", "draft", "hf_generate"):
        assert "error" not in res[name] and "skipped" not in res[name], (name, res[name])
    for kind in ("flash", "blocked"):  # bf16 against the fp32 blocked reference
        att = res["ttt_attention"][kind]
        assert att["out_rel_err"] < 2e-2 and att["grad_rel_err_max"] < 5e-2, (kind, att)
    t, tb = res["train"], res["train_blocked"]
    assert (t["attention"], tb["attention"]) == ("flash", "blocked")
    assert t["first_last_loss"][0] == pytest.approx(tb["first_last_loss"][0], rel=1e-2)  # same batch and seed
    assert t["tokens_per_s"] > 0 and t["mfu"] > 0  # the peak is timed on a loaded CPU too: no upper bound
    assert t["loss_vs_fp32_lm_head"][0] == t["loss_vs_fp32_lm_head"][1]  # CPU keeps the fp32 lm_head
    lean, draft = res["target_lean"], res["draft"]
    for n in bench_gpu.VERIFY_NODES:
        want = 5.0 * lean["step_ms"] / (lean[f"verify{n}_ms"] + 6 * draft["level_ms"] + draft["ingest3_ms"])
        assert res["model_speedup"][f"target_lean_n{n}"]["5.0"] == pytest.approx(want, abs=0.006)


def test_section_error_is_recorded_not_raised(tmp_path):
    run = bench_gpu.Run("cpu", tmp_path / "r.json", budget_s=60, reps=1)
    run.section("broken", lambda _run: 1 / 0)
    assert run.result["broken"] == {"error": "ZeroDivisionError: division by zero"}
    assert json.loads((tmp_path / "r.json").read_text())["broken"]["error"].startswith("ZeroDivisionError")


def test_target_lm_head_stays_fp32_off_gpu():
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(50, 8, generator=g).bfloat16()
    parts = TargetParts(emb, emb.clone(), None, LogitRule(), None).to("cpu", torch.bfloat16, bf16_hidden=True)
    assert parts.lm_weight.dtype == torch.float32
    last = torch.randn(3, 8, generator=g).bfloat16()
    assert torch.equal(parts.logits(last), last.float() @ emb.float().T)


def test_bf16_lm_head_refuses_wider_hidden_states():
    w = torch.randn(50, 8).bfloat16()
    parts = TargetParts(w, w, None, LogitRule(), None)  # as `to(bf16_hidden=True)` leaves it on a GPU
    with pytest.raises(ValueError, match="bf16 hidden states"):
        parts.logits(torch.randn(3, 8))


@pytest.mark.slow  # the profiler pass takes most of a minute
def test_bench_gpu_runs_only_the_sections_asked_and_profiles_the_step():
    res = bench_gpu.main(["--shape", "tiny", "--device", "cpu", "--reps", "1", "--sections", "train", "--profile"])
    ran = {k for k, v in res.items() if isinstance(v, dict) and k not in ("shape", "versions", "model_speedup")}
    assert ran == {"hardware", "train"}, ran
    prof = res["train"]["profile"]
    assert prof["total_ms"] > 0 and len(prof["ops"]) == 20
    assert sum(ms for _, ms, _ in prof["ops"]) <= prof["total_ms"] + 0.05  # the top ops are a part of the total
