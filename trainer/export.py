"""Export / import of heads in the SGLang (`LlamaForCausalLMEagle3`) and vLLM speculators formats.

Both formats hold the same tensors (ARCHITECTURE.md §5); speculators renames `midlayer.` to `layers.0.`. Aux
layer ids are kept internally as "output of layer j" (our capture rule) and always written explicitly,
in each engine's own numbering, so no engine falls back on a default rule of its own (vLLM's is per
model class): SGLang reads only `eagle_config.eagle_aux_hidden_state_layer_ids`, as outputs (j); vLLM
reads the top-level `eagle_aux_hidden_state_layer_ids` first, as inputs (j + 1), and falls back on
`eagle_config`'s with the same input meaning. The SGLang-format file therefore carries both fields, so
one folder picks the same layers in both engines (infer/checks/vllm_interop.py measured the single-field file
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
FORMATS = ("sglang", "speculators", "dflash")
KIND_FORMATS = {"eagle3": ("sglang", "speculators"), "dflash": ("dflash",)}  # what each draft kind exports as
DFLASH_LAYER_KEYS = ["input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
                     "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
                     "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
                     "mlp.up_proj.weight", "mlp.down_proj.weight"]
# Tensors that only some heads hold (trainer/head.py HEAD_OPTIONS); the names are vLLM's and speculators'.
OPTION_KEYS = {"norm_before_fc": ["input_norm.weight"], "fc_norm": [f"fc_norm.{i}.weight" for i in range(3)]}
# Tensors a peer's checkpoint may carry that are the target's, not the head's: we use the target's own.
TARGET_COPIES = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")


def head_keys(options: dict | None = None) -> list[str]:
    """The tensor names of a head with these options (HeadConfig.options; None: plain EAGLE-3)."""
    extra = [k for opt, keys in OPTION_KEYS.items() if (options or {}).get(opt) for k in keys]
    return HEAD_KEYS + extra


def state_keys(cfg: HeadConfig) -> list[str]:
    """The tensor names of a head of this config, either kind (DFlash's are vLLM's DFlashDraftModel's)."""
    if cfg.kind == "dflash":
        return ["fc.weight", "hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"] + [
            f"layers.{i}.{k}" for i in range(cfg.num_layers) for k in DFLASH_LAYER_KEYS]
    return head_keys(cfg.options)


def check_keys(state: dict, where: str, options: dict | None = None, want: list[str] | None = None) -> None:
    want = want or head_keys(options)
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing or extra:
        raise ValueError(f"{where}: head tensors do not match ARCHITECTURE.md §5 (missing {missing}, unexpected {extra})")


def check_exportable(aux_layer_ids: list[int], num_target_layers: int, formats: list[str],
                     options: dict | None = None, kind: str = "eagle3") -> None:
    """Refuse what an engine cannot load, before training rather than after it: engines sort and
    de-duplicate aux ids, so only three distinct ascending layers mean the same thing everywhere; SGLang's
    LlamaForCausalLMEagle3 reads none of the EAGLE 3.1 options (it would drop their tensors silently); a
    draft kind exports only in its own formats."""
    resolve_aux_layers(num_target_layers, list(aux_layer_ids), "export: aux layer ids")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"export_formats: unknown {unknown} (known: {', '.join(FORMATS)})")
    other = [f for f in formats if f not in KIND_FORMATS[kind]]
    if other:
        raise ValueError(f"export_formats: a {kind} head exports as {', '.join(KIND_FORMATS[kind])}, not {other}")
    on = [k for k, v in (options or {}).items() if v]
    if on and "sglang" in formats:
        raise ValueError(f"export_formats: sglang: SGLang's EAGLE-3 head reads none of model.{', model.'.join(on)}; "
                         f"export this head as speculators (vLLM reads it)")


def expected_shapes(cfg: HeadConfig) -> dict[str, tuple]:
    h, ht, hd = cfg.hidden_size, cfg.target_hidden_size, cfg.head_dim
    nq, nkv, inter = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd, cfg.intermediate_size
    if cfg.kind == "dflash":
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (nq, h), "self_attn.k_proj.weight": (nkv, h),
                 "self_attn.v_proj.weight": (nkv, h), "self_attn.o_proj.weight": (h, nq),
                 "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
                 "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter)}
        return {"fc.weight": (h, 3 * ht), "hidden_norm.weight": (h,), "norm.weight": (h,),
                "lm_head.weight": (cfg.draft_vocab_size, h), "d2t": (cfg.draft_vocab_size,), "t2d": (cfg.vocab_size,),
                **{f"layers.{i}.{k}": v for i in range(cfg.num_layers) for k, v in layer.items()}}
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
    check_keys(state, "export", want=state_keys(cfg))
    _check_shapes(state, cfg, "export")
    check_exportable(aux_layer_ids, target.num_layers, [fmt], cfg.options, cfg.kind)
    if cfg.kind == "dflash":
        return export_dflash(state, cfg, aux_layer_ids, out)
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


def head_version(folder) -> str:
    """A head's identity: its folder's name and the first 12 hex of the sha256 of its weight files, so two
    exports of the same weights read alike and a retrained head in the same folder does not."""
    import hashlib

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{folder}: no .safetensors weights (is this an exported head folder?)")
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return f"{Path(folder).name}@{h.hexdigest()[:12]}"


def import_head(folder: Path, num_target_layers: int | None = None) -> tuple[dict, HeadConfig, list[int] | None]:
    """Read a head in either format -> (state in SGLang naming, head config, aux ids as outputs of layers;
    None when the config relies on the default rule and num_target_layers is not given). EAGLE 3.1 options
    are read as vLLM reads them (a speculators config without `norm_before_residual` means true there)."""
    folder = Path(folder)
    conf = json.loads((folder / "config.json").read_text())
    raw = load_file(str(folder / "model.safetensors"))
    if conf.get("speculators_model_type") == "dflash":
        conf = speculators_dflash_conf(conf, folder)
    if conf.get("architectures") == [DFLASH_ARCH]:
        return import_dflash(conf, raw, folder, num_target_layers)
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
    cfg = _config_of(fields, folder, **options)
    _check_shapes(state, cfg, str(folder))
    return state, cfg, aux


def _config_of(fields: dict, folder: Path, **extra) -> HeadConfig:
    """A HeadConfig from Llama/Qwen3-style config fields (either kind); one line naming the folder and the
    missing key or the refused value."""
    rope = {"rope_type": "default", "rope_theta": fields.get("rope_theta", 10000.0)}
    if fields.get("rope_scaling"):
        rope.update(fields["rope_scaling"])
    if fields.get("rope_parameters"):  # transformers 5 configs (speculators' layer configs): theta inside
        rope.update(fields["rope_parameters"])
    try:
        return HeadConfig(
            hidden_size=fields["hidden_size"], intermediate_size=fields["intermediate_size"],
            num_attention_heads=fields["num_attention_heads"], num_key_value_heads=fields["num_key_value_heads"],
            head_dim=fields.get("head_dim") or fields["hidden_size"] // fields["num_attention_heads"],
            vocab_size=fields["vocab_size"], draft_vocab_size=fields["draft_vocab_size"],
            target_hidden_size=fields["target_hidden_size"], rms_norm_eps=fields["rms_norm_eps"],
            max_position_embeddings=fields["max_position_embeddings"], rope_parameters=rope, **extra)
    except KeyError as err:
        raise ValueError(f"{folder}: config.json: {err.args[0]}: missing") from None
    except (TypeError, ValueError) as err:
        raise ValueError(f"{folder}: {err}") from None


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
    """The exportable tensors of a head of either kind (drops the non-persistent rotary cache)."""
    keys = set(state_keys(head.config))
    return {k: v for k, v in head.state_dict().items() if k in keys}


# --- DFlash: vLLM's DFlashDraftModel (model_executor/models/qwen3_dflash.py), a Qwen3 config ---------------
DFLASH_ARCH = "DFlashDraftModel"


def export_dflash(state: dict, cfg: HeadConfig, aux_layer_ids: list[int], out: Path) -> Path:
    """A DFlash head folder vLLM loads for `method: dflash`. Aux ids are written twice, as vLLM reads them:
    `eagle_aux_hidden_state_layer_ids` as inputs of layers (j + 1, read first) and
    `dflash_config.target_layer_ids` as outputs (j, DFlash's own numbering). d2t ships only when the draft
    vocabulary is smaller than the target's (vLLM has no place for it otherwise); vLLM skips t2d."""
    out.mkdir(parents=True, exist_ok=True)
    aux = [int(j) for j in aux_layer_ids]
    fields = {k: v for k, v in _llama_fields(cfg).items() if k != "model_type"}
    conf = {"architectures": [DFLASH_ARCH], "model_type": "qwen3", **fields, "num_hidden_layers": cfg.num_layers,
            "target_hidden_size": cfg.target_hidden_size, "attention_bias": False, "use_sliding_window": False,
            "block_size": cfg.block_size, "eagle_aux_hidden_state_layer_ids": [j + 1 for j in aux],
            "dflash_config": {"mask_token_id": cfg.mask_token_id, "target_layer_ids": aux, "causal": cfg.block_causal}}
    tensors = dict(state)
    if cfg.draft_vocab_size == cfg.vocab_size:
        tensors.pop("d2t")
    (out / "config.json").write_text(json.dumps(conf, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "eagleray_format": "dflash"})
    return out


def speculators_dflash_conf(conf: dict, folder: Path) -> dict:
    """A speculators DFlash config as the vLLM DFlashDraftModel config it stands for, by vLLM 0.32's own
    conversion (transformers_utils/configs/speculators/algos.py update_dflash): its layer config's fields,
    aux ids as inputs of layers (`aux_hidden_state_layer_ids`), the block causal unless
    `sliding_window_non_causal`. A sliding window shorter than the head's positions is refused (our engine
    attends to the whole context)."""
    layer = dict(conf.get("transformer_layer_config") or {})
    ids = conf.get("aux_hidden_state_layer_ids")
    if ids is None:
        raise ValueError(f"{folder}: aux_hidden_state_layer_ids: missing (which target layers feed the head)")
    window = layer.get("sliding_window")
    if "sliding_attention" in (layer.get("layer_types") or []) and window is not None \
            and window < layer.get("max_position_embeddings", 0):
        raise ValueError(f"{folder}: transformer_layer_config.sliding_window {window}: a window shorter than "
                         f"{layer.get('max_position_embeddings')} positions (our engine attends to all of them)")
    return {**layer, "architectures": [DFLASH_ARCH], "block_size": conf.get("block_size"),
            "draft_vocab_size": conf.get("draft_vocab_size"), "target_hidden_size": conf.get("target_hidden_size"),
            "eagle_aux_hidden_state_layer_ids": list(ids),
            "dflash_config": {"mask_token_id": conf.get("mask_token_id"), "target_layer_ids": [i - 1 for i in ids],
                              "causal": not conf.get("sliding_window_non_causal", True)}}


def block_causal(conf: dict, folder: Path) -> bool:
    """Whether a DFlash config's block is causal, by vLLM 0.32's rule (qwen3_dflash.py _dflash_layer_causal):
    `is_causal`, else `dflash_config.causal`, else each layer's type (sliding: causal); layers must agree."""
    if conf.get("is_causal") is not None:
        return bool(conf["is_causal"])
    if (conf.get("dflash_config") or {}).get("causal") is not None:
        return bool(conf["dflash_config"]["causal"])
    kinds = {t == "sliding_attention" for t in (conf.get("layer_types") or [])} or {False}
    if len(kinds) > 1:
        raise ValueError(f"{folder}: layer_types: causal and non-causal layers mixed (our engine runs one block mask)")
    return kinds.pop()


def import_dflash(conf: dict, raw: dict, folder: Path, num_target_layers: int | None):
    """A DFlash folder -> (state, head config, aux ids as outputs of layers); refuses, in one line naming
    the key or tensor, a config whose two aux-layer fields disagree, aux layers this target lacks, and
    weights the config does not describe."""
    dcfg = conf.get("dflash_config") or {}
    ids, outs = conf.get("eagle_aux_hidden_state_layer_ids"), dcfg.get("target_layer_ids")
    if ids is not None and outs is not None and [j + 1 for j in outs] != list(ids):
        raise ValueError(f"{folder}: dflash_config.target_layer_ids {outs} (outputs) and "
                         f"eagle_aux_hidden_state_layer_ids {ids} (inputs) name different target layers")
    aux = list(outs) if outs is not None else ([j - 1 for j in ids] if ids is not None else None)
    if aux is None:
        raise ValueError(f"{folder}: dflash_config.target_layer_ids: missing (which target layers feed the head)")
    if num_target_layers is not None:
        resolve_aux_layers(num_target_layers, aux, f"{folder}: dflash_config.target_layer_ids")
    fields = dict(conf, draft_vocab_size=conf.get("draft_vocab_size") or conf.get("vocab_size"),
                  target_hidden_size=conf.get("target_hidden_size") or conf.get("hidden_size"))
    cfg = _config_of(fields, folder, kind="dflash", num_layers=conf.get("num_hidden_layers", 0),
                     block_size=conf.get("block_size", 0), mask_token_id=dcfg.get("mask_token_id"),
                     block_causal=block_causal(conf, folder))
    state = dict(raw)
    if "d2t" not in state:  # shipped only for a smaller draft vocabulary (export_dflash)
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.long)
    if "t2d" not in state:
        state["t2d"] = torch.ones(cfg.vocab_size, dtype=torch.bool)
    check_keys(state, str(folder), want=state_keys(cfg))
    _check_shapes(state, cfg, str(folder))
    return state, cfg, aux
