"""Export / import of heads in the SGLang (`LlamaForCausalLMEagle3`) and vLLM speculators formats.

Both formats hold the same tensors (ARCHITECTURE.md §4); speculators renames `midlayer.` to `layers.0.`. Aux
layer ids are kept internally as "output of layer j" (our capture rule) and always written explicitly,
in each engine's own numbering, so no engine falls back on a default rule of its own (vLLM's is per
model class): SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids`, as outputs (j); vLLM
reads the top-level `eagle_aux_hidden_state_layer_ids` first, as inputs (j + 1), and falls back on
`eagle_config`'s with the same input meaning. The SGLang-format file therefore carries both fields, so
one folder picks the same layers in both engines (tools/check_vllm.py measured the single-field file
in vLLM one layer off: tau 2.73 instead of 2.93 on the demo head). Every export and import checks the
key set exactly: vLLM loads a head with a missing tensor silently.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from pipeline.target import TargetSpec, default_aux_layers, resolve_aux_layers
from trainer.head import HEAD_OPTIONS, HeadConfig

LAYER_KEYS = ["hidden_norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
              "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
              "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
HEAD_KEYS = ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"] + [f"midlayer.{k}" for k in LAYER_KEYS]
FORMATS = ("sglang", "speculators")
# Tensors that only some heads hold (trainer/head.py HEAD_OPTIONS); the names are vLLM's and speculators'.
OPTION_KEYS = {"norm_before_fc": ["input_norm.weight"], "fc_norm": [f"fc_norm.{i}.weight" for i in range(3)]}
# Tensors a peer's checkpoint may carry that are the target's, not the head's: we use the target's own.
TARGET_COPIES = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def head_keys(options: dict | None = None) -> list[str]:
    """The tensor names of a head with these options (HeadConfig.options; None: plain EAGLE-3)."""
    extra = [k for opt, keys in OPTION_KEYS.items() if (options or {}).get(opt) for k in keys]
    return HEAD_KEYS + extra


def check_keys(state: dict, where: str, options: dict | None = None) -> None:
    want = head_keys(options)
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing or extra:
        raise ValueError(f"{where}: head tensors do not match ARCHITECTURE.md §4 (missing {missing}, unexpected {extra})")


def check_exportable(aux_layer_ids: list[int], num_target_layers: int, formats: list[str],
                     options: dict | None = None) -> None:
    """Refuse what an engine cannot load, before training rather than after it: engines sort and
    de-duplicate aux ids, so only three distinct ascending layers mean the same thing everywhere; SGLang's
    LlamaForCausalLMEagle3 reads none of the EAGLE 3.1 options (it would drop their tensors silently)."""
    resolve_aux_layers(num_target_layers, list(aux_layer_ids), "export: aux layer ids")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"export_formats: unknown {unknown} (known: {', '.join(FORMATS)})")
    on = [k for k, v in (options or {}).items() if v]
    if on and "sglang" in formats:
        raise ValueError(f"export_formats: sglang: SGLang's EAGLE-3 head reads none of model.{', model.'.join(on)}; "
                         f"export this head as speculators (vLLM reads it)")


def expected_shapes(cfg: HeadConfig) -> dict[str, tuple]:
    h, ht, hd = cfg.hidden_size, cfg.target_hidden_size, cfg.head_dim
    nq, nkv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    return {"fc.weight": (h, 3 * ht), "norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h),
            "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,),
            "input_norm.weight": (3 * ht,), **{f"fc_norm.{i}.weight": (ht,) for i in range(3)},
            "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
            "midlayer.post_attention_layernorm.weight": (h,), "midlayer.self_attn.q_proj.weight": (nq, 2 * h),
            "midlayer.self_attn.k_proj.weight": (nkv, 2 * h), "midlayer.self_attn.v_proj.weight": (nkv, 2 * h),
            "midlayer.self_attn.o_proj.weight": (h, nq), "midlayer.mlp.gate_proj.weight": (inter, h),
            "midlayer.mlp.up_proj.weight": (inter, h), "midlayer.mlp.down_proj.weight": (h, inter)}


def _rope_fields(cfg: HeadConfig) -> dict:
    rope = dict(cfg.rope_parameters)
    theta = rope.pop("rope_theta", 10000.0)
    scaling = rope if rope.get("rope_type", "default") != "default" else None
    return {"rope_theta": theta, "rope_scaling": scaling}


def _llama_fields(cfg: HeadConfig) -> dict:
    return {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "vocab_size": cfg.vocab_size, "draft_vocab_size": cfg.draft_vocab_size, "rms_norm_eps": cfg.rms_norm_eps,
            **_rope_fields(cfg), "max_position_embeddings": cfg.max_position_embeddings,
            "tie_word_embeddings": False, "torch_dtype": "float32"}


def export_head(state: dict, cfg: HeadConfig, aux_layer_ids: list[int], target: TargetSpec, out: Path,
                fmt: str) -> Path:
    """Write a head folder (config.json + model.safetensors) in `fmt` for `target` (its layer count checks
    the aux ids; speculators configs name it as the verifier)."""
    state = {k: v.detach().cpu().contiguous() for k, v in state.items()}
    check_keys(state, "export", cfg.options)
    _check_shapes(state, cfg, "export")
    check_exportable(aux_layer_ids, target.num_layers, [fmt], cfg.options)
    out.mkdir(parents=True, exist_ok=True)
    ht = cfg.target_hidden_size
    aux = [int(j) for j in aux_layer_ids]
    inputs = [j + 1 for j in aux]  # vLLM / speculators numbering: id k is hidden_states[k], input of layer k
    if fmt == "sglang":
        conf = {"architectures": ["LlamaForCausalLMEagle3"], **_llama_fields(cfg),
                "eagle_aux_hidden_state_layer_ids": inputs,  # read by vLLM (before eagle_config's)
                "eagle_config": {"use_aux_hidden_state": True,
                                 "eagle_aux_hidden_state_layer_ids": aux}}  # read by SGLang, which adds 1
        if ht != cfg.hidden_size:
            conf["target_hidden_size"] = ht
        tensors = state
    elif fmt == "speculators":
        conf = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                "speculators_version": "0.3.0", "draft_vocab_size": cfg.draft_vocab_size,
                "target_hidden_size": ht, **cfg.options,
                "eagle_aux_hidden_state_layer_ids": inputs,
                "transformer_layer_config": {**_llama_fields(cfg), "architectures": ["LlamaForCausalLM"]},
                "speculators_config": {
                    "algorithm": "eagle3", "default_proposal_method": "greedy",
                    "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3,
                                          "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                    "verifier": {"name_or_path": str(target.path), "architectures": [target.architecture]}},
                "torch_dtype": "float32"}
        tensors = {k.replace("midlayer.", "layers.0.", 1): v for k, v in state.items()}
    else:
        raise ValueError(f"unknown export format {fmt!r} (known: {', '.join(FORMATS)})")
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "eagleray_format": fmt})
    return out


def import_head(folder: Path, num_target_layers: int | None = None) -> tuple[dict, HeadConfig, list[int] | None]:
    """Read a head in either format -> (state in SGLang naming, head config, aux ids as outputs of layers;
    None when the config relies on the default rule and num_target_layers is not given). EAGLE 3.1 options
    are read as vLLM reads them (a speculators config without `norm_before_residual` means true there)."""
    folder = Path(folder)
    conf = json.loads((folder / "config.json").read_text())
    raw = load_file(str(folder / "model.safetensors"))
    if "speculators_config" in conf or conf.get("architectures") == ["Eagle3Speculator"]:
        fields = dict(conf["transformer_layer_config"])
        fields.setdefault("draft_vocab_size", conf["draft_vocab_size"])
        fields["target_hidden_size"] = conf.get("target_hidden_size") or fields["hidden_size"]  # speculators: null
        options = {k: bool(conf.get(k, k == "norm_before_residual")) for k in HEAD_OPTIONS}
        ids = conf.get("eagle_aux_hidden_state_layer_ids")
        aux = [j - 1 for j in ids] if ids else None
        state = {k.replace("layers.0.", "midlayer.", 1): v for k, v in raw.items()}
        if "draft_id_to_target_id" in state:
            state["d2t"] = state.pop("draft_id_to_target_id")
    else:
        fields = dict(conf)
        fields.setdefault("target_hidden_size", fields["hidden_size"])
        eagle = conf.get("eagle_config") or {}
        options = {k: bool(eagle.get(k, conf.get(k, False))) for k in HEAD_OPTIONS}
        aux = _sglang_file_aux(conf, folder)
        state = dict(raw)
    for k in TARGET_COPIES:  # some exports carry the target's tensors; we use the target's own
        state.pop(k, None)
    if aux is None and num_target_layers is not None:
        aux = default_aux_layers(num_target_layers)
    check_keys(state, str(folder), options)
    rope = {"rope_type": "default", "rope_theta": fields.get("rope_theta", 10000.0)}
    if fields.get("rope_scaling"):
        rope.update(fields["rope_scaling"])
    try:
        cfg = HeadConfig(
            hidden_size=fields["hidden_size"], intermediate_size=fields["intermediate_size"],
            num_attention_heads=fields["num_attention_heads"], num_key_value_heads=fields["num_key_value_heads"],
            head_dim=fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"],
            vocab_size=fields["vocab_size"], draft_vocab_size=fields["draft_vocab_size"],
            target_hidden_size=fields["target_hidden_size"], rms_norm_eps=fields["rms_norm_eps"],
            max_position_embeddings=fields["max_position_embeddings"], rope_parameters=rope, **options)
    except ValueError as err:
        raise ValueError(f"{folder}: {err}") from None
    _check_shapes(state, cfg, str(folder))
    return state, cfg, aux


def _check_shapes(state: dict, cfg: HeadConfig, where: str) -> None:
    for k, shape in expected_shapes(cfg).items():
        if k in state and tuple(state[k].shape) != shape:
            raise ValueError(f"{where}: {k} has shape {tuple(state[k].shape)}, expected {shape}")


def _sglang_file_aux(conf: dict, folder: Path) -> list[int] | None:
    """Aux ids (outputs of layers) of an SGLang-format config; both fields must name the same layers."""
    sglang = (conf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    vllm = conf.get("eagle_aux_hidden_state_layer_ids")
    if sglang is not None and vllm is not None and [j + 1 for j in sglang] != list(vllm):
        raise ValueError(f"{folder}: eagle_config.eagle_aux_hidden_state_layer_ids {sglang} (outputs, SGLang) and "
                         f"eagle_aux_hidden_state_layer_ids {vllm} (inputs, vLLM) name different layers")
    if sglang is not None:
        return list(sglang)
    return [k - 1 for k in vllm] if vllm is not None else None


def convert_head(src: Path, target: TargetSpec, out: Path, fmt: str, aux_layer_ids: list[int] | None = None):
    """Read a head in either format and write it in `fmt` -> (folder, aux ids). Aux ids: the given ones,
    else the source config's, else the default rule for the target's layer count."""
    state, cfg, aux = import_head(src, target.num_layers)
    aux = list(aux_layer_ids) if aux_layer_ids is not None else aux
    return export_head(state, cfg, aux, target, out, fmt), aux


def head_state(head: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The exportable tensors of an Eagle3Head (drops the non-persistent rotary cache)."""
    keys = set(head_keys(head.config.options))
    return {k: v for k, v in head.state_dict().items() if k in keys}
