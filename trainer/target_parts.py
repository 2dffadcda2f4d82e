"""The target tensors the trainer needs (input embedding, lm_head and its bias), read without loading
the model, and the two functions built on them: `embed` (what the draft is fed) and `logits` (the
target's real next-token logits, transforms included; ARCHITECTURE.md §4).

Parameter names are discovered on a meta-device instance of the target's own class, then only those
tensors are read from its safetensors files (a 70B target costs two matrices of memory, not 140 GB).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from pipeline import storage
from pipeline.target import LogitRule, target_logits


def _param_name(model, param) -> str:
    for name, p in model.named_parameters():
        if p is param:
            return name
    raise KeyError("the requested tensor is not among the model's parameters")


def _read(target: Path, names: list[str]) -> dict[str, torch.Tensor]:
    index = target / "model.safetensors.index.json"
    files = ({n: f for n, f in json.loads(index.read_text())["weight_map"].items()} if index.is_file()
             else {n: "model.safetensors" for n in names})
    out = {}
    for n in names:
        fname = files.get(n)
        if fname is None:
            raise KeyError(f"{target}: tensor {n} is not in the checkpoint")
        with safe_open(str(target / fname), framework="pt") as f:
            if n not in f.keys():
                raise KeyError(f"{target / fname}: tensor {n} missing")
            out[n] = f.get_tensor(n)
    return out


@dataclass
class TargetParts:
    embedding: torch.Tensor          # [V, H]
    lm_weight: torch.Tensor          # [V, H]
    lm_bias: torch.Tensor | None     # [V] (Phi-2, GPT-J style heads) or None
    rule: LogitRule
    config: object

    def to(self, device, embed_dtype=None, bf16_hidden: bool = False) -> "TargetParts":
        """Copies on `device`; the lm_head in fp32, except on a GPU when the weights are bf16 and the
        hidden states fed to `logits` are bf16 (`bf16_hidden`): then it stays bf16 and `logits` runs one
        bf16 GEMM that accumulates and returns fp32, the same products as the fp32 GEMM (bf16 x bf16 is
        exact in fp32) at a fraction of the time (docs/ARCHITECTURE.md §4)."""
        bias = None if self.lm_bias is None else self.lm_bias.to(device, torch.float32)
        keep = bf16_hidden and torch.device(device).type == "cuda" and self.lm_weight.dtype == torch.bfloat16
        lm_weight = self.lm_weight.to(device, None if keep else torch.float32)
        return TargetParts(self.embedding.to(device, embed_dtype or self.embedding.dtype), lm_weight, bias,
                           self.rule, self.config)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The draft's token embeddings: a plain lookup in the target's embedding matrix, which is what
        vLLM's EAGLE-3 proposer feeds (it shares the target's embed_tokens module; model-level scaling
        such as Gemma's sqrt(H) normalizer is not part of it) and what our decoder feeds."""
        return torch.nn.functional.embedding(ids, self.embedding)

    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [N, V] of final-norm hidden states [N, H]."""
        if self.lm_weight.dtype == torch.bfloat16:  # `to(bf16_hidden=True)` on a GPU: fp32 out of a bf16 GEMM
            if last_hidden.dtype != torch.bfloat16:
                raise ValueError(f"the bf16 target lm_head takes bf16 hidden states, not {last_hidden.dtype}")
            return target_logits(last_hidden, self.lm_weight, self.lm_bias, self.rule, out_dtype=torch.float32)
        return target_logits(last_hidden.float(), self.lm_weight, self.lm_bias, self.rule)


def load_target_parts(target: str | Path) -> TargetParts:
    from transformers import AutoConfig, AutoModelForCausalLM

    target = storage.node_copy(target)
    cfg = AutoConfig.from_pretrained(target)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    emb_name = _param_name(model, emb)
    tied = head.weight is emb or getattr(cfg, "tie_word_embeddings", False)
    head_name = emb_name if tied else _param_name(model, head.weight)
    bias_name = _param_name(model, head.bias) if getattr(head, "bias", None) is not None else None
    tensors = _read(target, sorted({emb_name, head_name} | ({bias_name} if bias_name else set())))
    return TargetParts(tensors[emb_name], tensors[head_name], tensors.get(bias_name) if bias_name else None,
                       LogitRule.of(cfg), cfg)


def load_target_layers(target: str | Path, layer_ids: list[int]) -> tuple[list[dict[str, torch.Tensor]], torch.Tensor | None]:
    """The tensors of the target's decoder layers `layer_ids`, each dict keyed by the layer's own parameter
    names (`self_attn.q_proj.weight`, ...), and its final norm's weight (the last `*norm.weight` outside the
    layers; None if there is none), read without loading the model (as `load_target_parts`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.target import decoder_layers

    target = storage.node_copy(target)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target))
    layers = decoder_layers(model)
    names = [{local: _param_name(model, p) for local, p in layers[i].named_parameters()} for i in layer_ids]
    inside = {id(p) for p in layers.parameters()}
    norms = [n for n, p in model.named_parameters() if n.endswith("norm.weight") and id(p) not in inside]
    tensors = _read(target, sorted({n for layer in names for n in layer.values()} | set(norms[-1:])))
    return [{local: tensors[full] for local, full in layer.items()} for layer in names], \
        (tensors[norms[-1]] if norms else None)
