"""Warm start from another head (`model.init_from`): its weights, its lm_head rows remapped by token; or
the draft lm_head from the target's own rows (`model.lm_head_init: target`).

A head's lm_head row i scores draft id i, i.e. target token i + d2t[i]. A new corpus gives a new draft
vocabulary, so the old rows are moved to the new draft ids of the same target tokens; tokens the old head
never scored start from the target's own lm_head row (the head's hidden width is the target's), scaled to
the old rows' mean norm.
"""
from __future__ import annotations

import logging

import torch

from pipeline import storage
from trainer.head import HeadConfig, head_config_from_target
from trainer.kinds import build_head

log = logging.getLogger(__name__)


def remap_lm_head(old_w: torch.Tensor, old_d2t: torch.Tensor, new_d2t: torch.Tensor,
                  target_lm: torch.Tensor) -> tuple[torch.Tensor, int]:
    """-> (lm_head rows for the new draft vocab [len(new_d2t), H], how many came from the old head)."""
    vocab = target_lm.shape[0]
    old_tokens = torch.arange(len(old_d2t)) + old_d2t.long()
    new_tokens = torch.arange(len(new_d2t)) + new_d2t.long()
    row_of = torch.full((vocab,), -1, dtype=torch.long)
    row_of[old_tokens] = torch.arange(len(old_tokens))
    src = row_of[new_tokens]
    out = target_lm[new_tokens].to(old_w.dtype).clone()
    kept = src >= 0
    # A target row is not scaled for the head's residual stream: SmolLM2's lm_head rows are 4.5x the
    # norm of a trained head's, so 2883 new tokens outscored every trained one (held-out step-0 accuracy
    # 0.087 instead of ~0.3). New rows keep the target's direction at the old rows' mean norm.
    norm, fresh = old_w.float().norm(dim=1).mean(), out[~kept].float()
    out[~kept] = (fresh * (norm / fresh.norm(dim=1, keepdim=True).clamp(min=1e-6))).to(out.dtype)
    out[kept] = old_w[src[kept]]
    return out, int(kept.sum())


def target_lm_rows(target_lm: torch.Tensor, d2t: torch.Tensor, width: int) -> torch.Tensor:
    """The target's lm_head rows of the draft vocabulary [len(d2t), H], as speculators starts its draft
    lm_head: draft id i scores target token i + d2t[i]. Needs a head as wide as the target."""
    if target_lm.shape[1] != width:
        raise ValueError(f"model.lm_head_init: target needs a head as wide as the target's lm_head "
                         f"({target_lm.shape[1]}), not {width}")
    return target_lm[torch.arange(len(d2t)) + d2t.long().cpu()].float().clone()


def warm_start_state(state: dict, cfg: HeadConfig, d2t: torch.Tensor, target_lm: torch.Tensor) -> dict:
    """An imported head's state made to fit `cfg` and this corpus's draft vocabulary `d2t`; refuses a
    head of another shape (other hidden size, target width or vocabulary) naming the tensor."""
    from trainer.export import expected_shapes

    want = expected_shapes(cfg)
    for k, shape in want.items():
        if k in ("lm_head.weight", "d2t") or k not in state:
            continue
        if tuple(state[k].shape) != shape:
            raise ValueError(f"model.init_from: {k} has shape {tuple(state[k].shape)}, this target's head needs "
                             f"{shape}")
    if target_lm.shape[1] != cfg.hidden_size:
        raise ValueError(f"model.init_from: the head is {cfg.hidden_size} wide but the target's lm_head is "
                         f"{target_lm.shape[1]}: new draft tokens have no row to start from")
    rows, kept = remap_lm_head(state["lm_head.weight"], state["d2t"], d2t, target_lm)
    log.info("init_from: %d of %d lm_head rows from the old head, %d from the target's lm_head",
             kept, len(d2t), len(d2t) - kept)
    out = dict(state, **{"lm_head.weight": rows, "d2t": d2t.clone()})
    out.pop("t2d", None)
    return out


def check_init_from(loc, signature: dict, spec) -> None:
    """Refuse, in one line, a head to start from that another target or other aux layers trained: its
    vocabulary must be the shards' target's, its hidden states the target's width, its aux layers the
    shards' (the head reads those layers' states, in that order). `loc`: a folder or a URI (node_copy)."""
    from trainer.export import import_head

    state, hcfg, aux = import_head(storage.node_copy(loc), spec.num_layers)
    folder = storage.redact(loc)
    if len(state["t2d"]) != spec.vocab_size:
        raise ValueError(f"model.init_from: {folder} drafts for a vocabulary of {len(state['t2d'])} tokens, the "
                         f"shards' target has {spec.vocab_size}")
    if hcfg.target_hidden_size != signature["hidden_size"]:
        raise ValueError(f"model.init_from: {folder} reads hidden states {hcfg.target_hidden_size} wide, the "
                         f"shards' target's are {signature['hidden_size']}")
    if aux is not None and list(aux) != list(signature["aux_layer_ids"]):
        raise ValueError(f"model.init_from: {folder} reads aux layers {list(aux)}, the shards hold "
                         f"{list(signature['aux_layer_ids'])}")


def run_head_config(model, tcfg, draft_vocab: int, embedding: torch.Tensor) -> HeadConfig:
    """The head config of a run (trainer config's `model` section) for target config tcfg: an EAGLE-3
    head, or a DFlash one whose mask token defaults to trainer/dflash.py's rule over the target's embedding."""
    extra = {}
    if model.kind == "dflash":
        from pipeline.target import text_config
        from trainer.dflash import default_mask_token

        mask = model.mask_token_id
        if mask is None:
            t = text_config(tcfg)
            ids = [getattr(t, k, None) for k in ("eos_token_id", "bos_token_id", "pad_token_id")]
            avoid = {int(i) for x in ids for i in (x if isinstance(x, list) else [x]) if i is not None}
            mask = default_mask_token(embedding, avoid)
        extra = {"kind": "dflash", "num_layers": model.layers, "block_size": model.block_size, "mask_token_id": mask,
                 "block_causal": model.block_causal}
    return head_config_from_target(tcfg, draft_vocab, model.intermediate_size, **model.head_options, **extra)


def target_layer_state(layers: list[dict[str, torch.Tensor]], head: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A DFlash head's `layers.{j}.*` from the target's decoder layers (`load_target_layers`, one dict a
    draft layer): every tensor the head's layer has under the same name. Where the target has no q/k norms
    (Llama) the head's, which set every head's q and k to the weight's size, start at the size the target's
    projections give (`qk_size`), so a copied layer's attention is about as sharp as the target's rather than
    flatter. One line naming the tensor when a projection is missing or mis-shaped."""
    own, out = head.state_dict(), {}
    for j, layer in enumerate(layers):
        for k, v in own.items():
            if not k.startswith(f"layers.{j}."):
                continue
            local = k[len(f"layers.{j}."):]
            if local not in layer:
                if local.endswith(("q_norm.weight", "k_norm.weight")):
                    proj = layer.get(local.replace("_norm.", "_proj."))  # self_attn.q_proj.weight
                    if proj is not None and "input_layernorm.weight" in layer:
                        out[k] = torch.full_like(v, qk_size(proj, layer["input_layernorm.weight"]))
                    continue
                raise ValueError(f"model.layers_init: target: the target's layer has no {local} (Llama/Qwen-style "
                                 f"layers only)")
            if tuple(layer[local].shape) != tuple(v.shape):
                raise ValueError(f"model.layers_init: target: {local} is {tuple(layer[local].shape)} in the target, "
                                 f"{tuple(v.shape)} in the head")
            out[k] = layer[local].to(v.dtype)
    return out


def qk_size(proj: torch.Tensor, in_norm: torch.Tensor) -> float:
    """The RMS of a q or k entry that the target's projection proj [out, H] gives after its input norm (weight
    in_norm) for an input of unit RMS in every direction: sqrt(mean_r sum_i W[r, i]^2 g[i]^2). On SmolLM2's
    last two layers it reads 1.34-1.51 where 30 real tokens gave 1.83-1.99: a data-free floor."""
    return float((proj.float().pow(2) * in_norm.float().pow(2)).sum(1).mean().sqrt())


def eagle3_layer_state(layer: dict[str, torch.Tensor], head: torch.nn.Module) -> dict[str, torch.Tensor]:
    """An EAGLE-3 head's `midlayer.*` from one target decoder layer (`load_target_layers`): o_proj, the MLP
    and post_attention_layernorm as they are; q/k/v read [input_layernorm(emb) ; hidden_norm(h)], so the
    target's projection becomes the hidden half and the embedding half starts at zero (the layer first acts
    as the target's on the fused state; the token's embedding enters as training finds it useful); both
    input norms take the target's input_layernorm; q/k norms (Qwen3) have no place in an EAGLE-3 layer and
    are left out. One line naming the tensor when one is missing or mis-shaped (Llama/Qwen-style layers)."""
    own, out = head.state_dict(), {}
    copy = {f"self_attn.{p}.weight": f"self_attn.{p}.weight" for p in ("o_proj", "q_proj", "k_proj", "v_proj")}
    copy |= {f"mlp.{p}.weight": f"mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    copy |= {"post_attention_layernorm.weight": "post_attention_layernorm.weight",
             "hidden_norm.weight": "input_layernorm.weight", "input_layernorm.weight": "input_layernorm.weight"}
    for mine, theirs in copy.items():
        want = own[f"midlayer.{mine}"]
        if theirs not in layer:
            raise ValueError(f"model.layers_init: target: the target's layer has no {theirs} (Llama/Qwen-style "
                             f"layers only)")
        src = layer[theirs].to(want.dtype)
        if mine.split(".")[-2] in ("q_proj", "k_proj", "v_proj"):
            half = want.shape[1] // 2
            src = torch.cat([torch.zeros_like(src), src], dim=1) if src.shape[1] == half else src
        if tuple(src.shape) != tuple(want.shape):
            raise ValueError(f"model.layers_init: target: {theirs} is {tuple(layer[theirs].shape)} in the target, "
                             f"the head's {mine} is {tuple(want.shape)}")
        out[f"midlayer.{mine}"] = src
    return out


def high_fc(hidden: int, target_hidden: int) -> torch.Tensor:
    """The fc weight [H, 3 Ht] (EAGLE-3's and DFlash's) that passes the high aux state (the third) through:
    [0 | 0 | I]."""
    if hidden != target_hidden:
        raise ValueError(f"model.fc_init: high needs the head as wide as the target ({hidden} vs {target_hidden})")
    return torch.cat([torch.zeros(hidden, 2 * hidden), torch.eye(hidden)], dim=1)


def starting_head(model, hcfg: HeadConfig, d2t: torch.Tensor, t2d: torch.Tensor, target_lm: torch.Tensor,
                  num_layers: int, target=None) -> torch.nn.Module:
    """The head a run starts from (trainer config's `model` section): fresh, its lm_head from the target's
    rows (`lm_head_init: target`), its layers from the target's last layers (`layers_init: target`;
    `target` is then the target's folder), its fc passing the high aux state (`fc_init: high`), or another
    head's weights (`init_from`, of the same kind); lm_head frozen on request."""
    head = build_head(hcfg)
    if model.init_std is not None:  # Hugging Face's initializer_range rule, as speculators starts its heads
        for mod in head.modules():
            if isinstance(mod, torch.nn.Linear):
                torch.nn.init.normal_(mod.weight, std=model.init_std)
    if model.layers_init == "target":
        from trainer.target_parts import load_target_layers
        layers, final_norm = load_target_layers(target, list(range(num_layers - hcfg.num_layers, num_layers)))
        state = eagle3_layer_state(layers[0], head) if hcfg.kind == "eagle3" else target_layer_state(layers, head)
        head.load_state_dict(state, strict=False)
        if final_norm is not None and final_norm.shape == head.norm.weight.shape:  # what the target's rows read
            head.norm.weight.data.copy_(final_norm)
    if model.fc_init == "high":
        head.fc.weight.data.copy_(high_fc(hcfg.hidden_size, hcfg.target_hidden_size))
        if hcfg.kind == "dflash" and model.layers_init == "target":  # context as the first layer reads input
            head.hidden_norm.weight.data.copy_(layers[0]["input_layernorm.weight"])
    if model.lm_head_init == "target":
        head.lm_head.weight.data.copy_(target_lm_rows(target_lm, d2t, hcfg.hidden_size))
    if model.init_from is not None:
        from trainer.export import import_head
        state, old, _ = import_head(storage.node_copy(model.init_from), num_layers)  # a folder or a URI
        if (old.kind, old.num_layers) != (hcfg.kind, hcfg.num_layers):
            raise ValueError(f"model.init_from: that head is {old.kind} with {old.num_layers} layer(s); this run "
                             f"trains {hcfg.kind} with {hcfg.num_layers}")
        if old.options != hcfg.options:
            raise ValueError(f"model.init_from: that head was trained with {old.options}; this run's model "
                             f"options are {hcfg.options}")
        head.load_state_dict(warm_start_state(state, hcfg, d2t, target_lm), strict=False)
    head.set_vocab(d2t, t2d)
    head.lm_head.weight.requires_grad_(not model.freeze_lm_head)
    return head
