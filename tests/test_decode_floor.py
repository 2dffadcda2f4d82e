"""tools/decode_floor.py: the weights it counts, and one run on the tiny target whose parts add up."""
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import decode_floor  # noqa: E402


@pytest.mark.parametrize("tied", [True, False])
def test_linear_bytes_counts_a_tied_lm_head_once(tied):
    cfg = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    per_layer = (32 * 32 + 2 * 16 * 32 + 32 * 32) + 3 * 32 * 48  # q, k, v, o + gate, up, down
    total, layers = decode_floor.linear_bytes(model)
    assert layers == 2 * per_layer * 2  # bf16: 2 bytes a weight
    assert total == layers + 100 * 32 * 2  # the lm_head (the embedding's matrix when tied) once


def test_tiny_target_run_parts_add_up(tiny_target):
    res = decode_floor.main(["--target", str(tiny_target), "--prefix", "24", "--steps", "4",
                             "--threads", "1"])
    assert res["lean_target"] is True and res["read_gb_s"] > 0
    floor = res["weights_mb"] / res["read_gb_s"]  # MB / (GB/s) = ms
    assert res["step_floor_ms"] == pytest.approx(floor, rel=0.01, abs=0.01)
    for side in ("ours", "hf"):
        a = res[side]
        assert a["linears_ms"] > 0 and a["attention_ms"] > 0, a
        assert a["linears_ms"] + a["attention_ms"] + a["rest_ms"] == pytest.approx(a["step_ms"], abs=0.03)
    assert res["ours_vs_hf"] == pytest.approx(res["hf"]["step_ms"] / res["ours"]["step_ms"], abs=0.002)
