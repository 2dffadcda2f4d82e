"""The two target tensors the trainer needs: input embedding and lm_head, read without loading the model.

Parameter names are discovered on a meta-device instance of the target's own class, then only those
tensors are read from its safetensors files (a 70B target costs two matrices of memory, not 140 GB).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


def _param_name(model, module) -> str:
    for name, p in model.named_parameters():
        if p is module.weight:
            return name
    raise KeyError("weight of the requested module not found among the model's parameters")


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


def load_target_parts(target: str | Path) -> tuple[torch.Tensor, torch.Tensor, object]:
    """-> (embedding [V, H], lm_head [V, H], target config)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    target = Path(target)
    cfg = AutoConfig.from_pretrained(target)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    emb_name = _param_name(model, model.get_input_embeddings())
    head = model.get_output_embeddings()
    tied = head.weight is model.get_input_embeddings().weight or getattr(cfg, "tie_word_embeddings", False)
    head_name = emb_name if tied else _param_name(model, head)
    tensors = _read(target, sorted({emb_name, head_name}))
    return tensors[emb_name], tensors[head_name], cfg
