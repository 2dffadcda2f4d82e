"""Export / import in SGLang and speculators formats: exact names, shapes, config fields, bit-exact."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.target import TargetSpec
from test_ttt import tiny_head
from trainer.export import HEAD_KEYS, export_head, head_state, import_head

DESIGN_KEYS = {
    "fc.weight", "midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
    "midlayer.post_attention_layernorm.weight", "midlayer.self_attn.q_proj.weight",
    "midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
    "midlayer.mlp.gate_proj.weight", "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight",
    "norm.weight", "lm_head.weight", "d2t", "t2d"}


def spec(num_layers: int, path: str = "/models/t") -> TargetSpec:
    """What export needs of a target, without a target folder."""
    return TargetSpec(path=Path(path), config=None, architecture="LlamaForCausalLM", num_layers=num_layers,
                      hidden_size=32, vocab_size=40, tokenizer_size=40, max_positions=128, config_sha256="",
                      chat_template_sha256="", weights_id="")


def head_and_state():
    head = tiny_head().float()
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p))  # norms away from 1 so a swapped tensor would show
    return head, head_state(head)


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_round_trip_bit_exact(tmp_path, fmt):
    head, state = head_and_state()
    assert set(state) == DESIGN_KEYS == set(HEAD_KEYS)
    out = export_head(state, head.config, [1, 3, 4], spec(8, "/models/t"), tmp_path / fmt, fmt)
    back, cfg, aux = import_head(out, 8)
    assert aux == [1, 3, 4]
    assert set(back) == DESIGN_KEYS
    for k in DESIGN_KEYS:
        assert back[k].dtype == state[k].dtype and torch.equal(back[k], state[k]), k
    for f in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "draft_vocab_size", "rms_norm_eps", "max_position_embeddings", "target_hidden_size"):
        assert getattr(cfg, f) == getattr(head.config, f), f


def test_sglang_layout(tmp_path):
    head, state = head_and_state()
    out = export_head(state, head.config, [1, 3, 4], spec(8), tmp_path / "s", "sglang")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["model_type"] == "llama"
    assert conf["num_hidden_layers"] == 1 and conf["tie_word_embeddings"] is False
    # Explicit ids in each engine's numbering: SGLang reads eagle_config's (outputs), vLLM the top level (inputs)
    assert conf["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": [1, 3, 4]}
    assert conf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert (conf["vocab_size"], conf["draft_vocab_size"], conf["max_position_embeddings"]) == (40, 24, 128)
    assert conf["hidden_size"] == 32 and conf["head_dim"] == 8 and "target_hidden_size" not in conf
    assert conf["rope_theta"] == 10000.0
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == DESIGN_KEYS and "embed_tokens.weight" not in tensors
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    assert shapes["fc.weight"] == (32, 96) and shapes["lm_head.weight"] == (24, 32)
    assert shapes["midlayer.self_attn.q_proj.weight"] == (32, 64)
    assert shapes["midlayer.self_attn.k_proj.weight"] == (16, 64)
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    explicit = json.loads((export_head(state, head.config, [0, 2, 5], spec(8), tmp_path / "e", "sglang") / "config.json")
                          .read_text())
    assert explicit["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 5]
    assert explicit["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]


def test_aux_fields_must_agree_and_either_alone_reads(tmp_path):
    head, state = head_and_state()
    out = export_head(state, head.config, [0, 2, 5], spec(8), tmp_path / "s", "sglang")
    conf = json.loads((out / "config.json").read_text())
    for drop, keep in (("top", "eagle_config"), ("eagle_config", "top")):
        c = json.loads(json.dumps(conf))
        if drop == "top":
            del c["eagle_aux_hidden_state_layer_ids"]
        else:
            del c["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
        (out / "config.json").write_text(json.dumps(c))
        assert import_head(out, 8)[2] == [0, 2, 5], keep
    conf["eagle_aux_hidden_state_layer_ids"] = [0, 2, 5]  # SGLang numbering written where vLLM reads inputs
    (out / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"\[0, 2, 5\] \(outputs, SGLang\) and eagle_aux_hidden_state_layer_ids "
                                         r"\[0, 2, 5\] \(inputs, vLLM\) name different layers"):
        import_head(out, 8)


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_aux_layers_must_be_distinct_ascending_in_every_format(tmp_path, fmt):
    """Engines sort and de-duplicate aux ids (vLLM) or capture in layer order (SGLang): repeated or
    unordered ids would feed the head other features than it was trained on, so no format takes them."""
    head, state = head_and_state()
    with pytest.raises(ValueError, match=r"\[1, 1, 2\] must be strictly ascending"):
        export_head(state, head.config, [1, 1, 2], spec(6), tmp_path / "a", fmt)
    with pytest.raises(ValueError, match=r"\[3, 1, 4\] must be strictly ascending"):
        export_head(state, head.config, [3, 1, 4], spec(8), tmp_path / "b", fmt)
    with pytest.raises(ValueError, match=r"\[8\] out of range for a 8-layer target"):
        export_head(state, head.config, [1, 3, 8], spec(8), tmp_path / "x", fmt)
    assert not any((tmp_path / d).exists() for d in "abx")
    export_head(state, head.config, [1, 3, 4], spec(8), tmp_path / "ok", fmt)
    assert (tmp_path / "ok" / "model.safetensors").is_file()


def test_speculators_layout(tmp_path):
    head, state = head_and_state()
    out = export_head(state, head.config, [1, 3, 4], spec(8, "/models/t"), tmp_path / "v", "speculators")
    conf = json.loads((out / "config.json").read_text())
    assert conf["architectures"] == ["Eagle3Speculator"] and conf["speculators_model_type"] == "eagle3"
    assert conf["norm_before_residual"] is False
    assert conf["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # input-of-layer numbering
    assert conf["draft_vocab_size"] == 24 and conf["target_hidden_size"] == 32
    assert conf["transformer_layer_config"]["num_hidden_layers"] == 1
    assert conf["speculators_config"]["algorithm"] == "eagle3"
    tensors = load_file(str(out / "model.safetensors"))
    assert {k.replace("layers.0.", "midlayer.") for k in tensors} == DESIGN_KEYS
    assert not any(k.startswith("midlayer.") for k in tensors)
    # speculators' own checkpoints (transformers 5) keep the theta inside rope_parameters: read from there
    layer = conf["transformer_layer_config"]
    layer.pop("rope_theta", None)
    layer["rope_parameters"] = {"rope_type": "default", "rope_theta": 100000.0}
    (out / "config.json").write_text(json.dumps(conf))
    assert import_head(out, 8)[1].rope_parameters["rope_theta"] == 100000.0


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_missing_tensor_fails(tmp_path, fmt):
    head, state = head_and_state()
    broken = dict(state)
    del broken["midlayer.hidden_norm.weight"]
    with pytest.raises(ValueError, match="missing .*hidden_norm"):
        export_head(broken, head.config, [1, 3, 4], spec(8), tmp_path / "x", fmt)
    out = export_head(state, head.config, [1, 3, 4], spec(8), tmp_path / fmt, fmt)
    tensors = load_file(str(out / "model.safetensors"))
    tensors.pop(next(k for k in tensors if k.endswith("mlp.up_proj.weight")))
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="missing .*up_proj"):
        import_head(out, 8)


def test_wrong_shape_fails(tmp_path):
    head, state = head_and_state()
    state["fc.weight"] = state["fc.weight"][:, :64]
    with pytest.raises(ValueError, match=r"fc.weight has shape \(32, 64\), expected \(32, 96\)"):
        export_head(state, head.config, [1, 3, 4], spec(8), tmp_path / "x", "sglang")
