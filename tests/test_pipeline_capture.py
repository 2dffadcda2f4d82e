"""Capture: every stored row equals a direct HF forward for Llama, Qwen2, Qwen3 and Mistral targets."""
import json

import pyarrow.parquet as pq
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.buckets import length_buckets
from pipeline.capture import run_capture
from pipeline.codec import from_bytes
from pipeline.target import default_aux_layers, resolve_aux_layers
from pipeline.config import Capture
from pipeline.shards import drop_ids, read_manifest, shard_ranges

ARCHS = ["llama", "qwen2", "qwen3", "mistral"]


def make_random_target(arch: str, tokenizer_dir, out):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig}[arch]
    cfg = cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=8,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
              pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(ARCHS.index(arch))
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_aux_layer_rule():
    assert default_aux_layers(32) == [1, 15, 28]
    assert default_aux_layers(8) == [1, 3, 4]
    assert resolve_aux_layers(8, [0, 2, 7]) == [0, 2, 7]
    with pytest.raises(ValueError, match="out of range"):
        resolve_aux_layers(8, [1, 3, 8])
    with pytest.raises(ValueError, match="exactly 3"):
        resolve_aux_layers(8, [1, 3])


def test_shard_ranges_and_micro_batches():
    assert shard_ranges(35, 16) == [(0, 0, 16), (1, 16, 32), (2, 32, 35)]
    groups = length_buckets([5, 40, 10, 40, 7], 80, longest_first=True)
    assert groups == [[1, 3], [2, 4, 0]]
    assert sorted(i for g in groups for i in g) == list(range(5))


def test_drop_ids_filters_held_out_rows_in_a_light_process():
    """The trainer's held-out filter runs in Ray Data's task processes: it keeps every other row in order, and
    importing its module (what each such process does) does not import torch."""
    import subprocess
    import sys

    import pyarrow as pa

    t = pa.table({"id": ["a", "b", "c", "d"], "n": [1, 2, 3, 4]})
    assert drop_ids(t, ["b", "d"]).to_pydict() == {"id": ["a", "c"], "n": [1, 3]}
    assert drop_ids(t, []).num_rows == 4
    probe = "import sys, pipeline.shards; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_equals_direct_forward(arch, tmp_path, ray_cluster, pipeline_run, tiny_target):
    target = make_random_target(arch, tiny_target, tmp_path / arch)
    tokens = pipeline_run / "tokenize" / "tokens.parquet"
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    n = model.config.num_hidden_layers
    head = model.get_output_embeddings().weight
    for dtype in ("bf16", "fp32"):
        out = tmp_path / f"cap_{dtype}"
        info = run_capture(Capture(dtype=dtype, rows_per_shard=24, batch_tokens=1024, threads_per_actor=1),
                           target, tokens, out)
        man = read_manifest(out)
        assert man["aux_layer_ids"] == [1, n // 2 - 1, n - 4] and man["hidden_size"] == 64
        rows = pq.read_table(sorted(out.glob("shard-*.parquet"))).to_pylist()
        assert len(rows) == info["rows"] == pq.read_metadata(tokens).num_rows
        for r in rows:
            ids = torch.tensor([r["input_ids"]])
            with torch.no_grad():
                ref = model(input_ids=ids, output_hidden_states=True)
            hs = ref.hidden_states
            want_aux = torch.cat([hs[2], hs[n // 2], hs[n - 3]], dim=-1)[0]
            aux = from_bytes(r["aux_hidden"], dtype, 3 * 64).float()
            last = from_bytes(r["last_hidden"], dtype, 64).float()
            assert aux.shape == want_aux.shape
            if dtype == "fp32":
                torch.testing.assert_close(aux, want_aux, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(last @ head.T, ref.logits[0], atol=1e-4, rtol=1e-4)
            else:
                # bf16 keeps 8 significant bits: allow one rounding step of the stored value.
                tol = want_aux.abs() * 2 ** -7 + 1e-6
                assert ((aux - want_aux).abs() <= tol).all()
                want_last = hs[n][0]
                assert ((last - want_last).abs() <= want_last.abs() * 2 ** -7 + 1e-6).all()
                assert torch.equal((last @ head.T).argmax(-1), ref.logits[0].argmax(-1)) or \
                    (last @ head.T - ref.logits[0]).abs().max() < 0.05


def test_manifest_and_vocab(pipeline_run):
    man = json.loads((pipeline_run / "capture" / "manifest.json").read_text())
    tokens = pq.read_table(pipeline_run / "tokenize" / "tokens.parquet")
    assert man["rows"] == tokens.num_rows and man["tokens"] == sum(tokens["n_tokens"].to_pylist())
    assert len(man["shards"]) == -(-tokens.num_rows // 16)
    assert man["pipeline_config"]["capture"]["rows_per_shard"] == 16
    schema = pq.read_schema(pipeline_run / "capture" / "shard-00000.parquet")
    assert str(schema.field("input_ids").type) == "list<element: int32>"
    assert str(schema.field("aux_hidden").type) == "binary"
    meta = pq.read_metadata(pipeline_run / "capture" / "shard-00000.parquet")
    assert meta.row_group(0).column(3).compression == "ZSTD"


def test_plan_estimate_close_to_actual(pipeline_run):
    from pipeline.plan import estimate_storage
    from pipeline.config import PipelineConfig

    cfg = PipelineConfig.model_validate_json((pipeline_run / "pipeline_config.json").read_text())
    plan = estimate_storage(cfg, pipeline_run / "tokenize/tokens.parquet")
    man = read_manifest(pipeline_run / "capture")
    assert plan["tokens"] == man["tokens"]
    assert plan["raw_total_bytes"] == man["raw_hidden_bytes"] == man["tokens"] * 4 * 64 * 2
    assert abs(plan["est_disk_total_bytes"] - man["bytes"]) / man["bytes"] < 0.10


def test_fp8_codec_round_trip_and_size():
    """fp8 shards: e4m3 with an fp32 scale per token and layer. Each value comes back within e4m3's
    relative step (2^-4) plus the scale's subnormal step; a layer with small values keeps its precision
    next to a layer of large ones; the row costs D + 4 x groups bytes (~0.5x bf16)."""
    from pipeline.codec import bytes_per_token, to_bytes

    torch.manual_seed(0)
    h = 64
    x = torch.cat([torch.randn(10, h) * 0.01, torch.randn(10, h), torch.randn(10, h) * 300], dim=-1)
    buf = to_bytes(x, "fp8", groups=3)
    assert len(buf) == 10 * bytes_per_token("fp8", 3 * h, 3) == 10 * (3 * h + 12)
    assert bytes_per_token("fp8", 3 * 576, 3) / bytes_per_token("bf16", 3 * 576) < 0.51  # SmolLM2 width
    back = from_bytes(buf, "fp8", 3 * h, groups=3)
    scale = x.view(10, 3, h).abs().amax(-1, keepdim=True).expand(10, 3, h).reshape(10, 3 * h) / 448
    assert ((back - x).abs() <= x.abs() * 2 ** -4 + scale * 2 ** -9 + 1e-12).all()
    low = slice(0, h)  # the 0.01-scale layer: relative error stays small despite the 300-scale one
    assert ((back[:, low] - x[:, low]).abs() / x[:, low].abs().clamp(min=1e-4)).median() < 0.04
    one = from_bytes(to_bytes(x, "fp8"), "fp8", 3 * h)  # one scale for the whole row: the small layer is lost
    assert ((one[:, low] - x[:, low]).abs() / x[:, low].abs().clamp(min=1e-4)).median() > 0.08
