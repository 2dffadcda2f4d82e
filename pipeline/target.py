"""What every stage needs to know about a target (docs/ARCHITECTURE.md §4), read in one place.

- A target is a local folder or a URI: every reader here takes either, a URI's files copied once to the
  node that reads them (`storage.node_copy`), so Ray actors on any node pass the location, never a path.
- `TargetSpec.read(folder)`: the target's facts read once from its folder (config, tokenizer, weight files):
  layers, hidden size, vocab, architecture, context, the hashes that identify it. Every stage takes one.
- `text_config(cfg)`: the language model's config of any HF config (multimodal wrappers included).
- `decoder_layers(model)`: the decoder blocks (Llama-style `model.layers`, GPT-2-style `transformer.h`, ...),
  or a refusal that names the class.
- `default_aux_layers` / `resolve_aux_layers`: the capture rule and the one check on aux layer ids.
- `attention_layout(model)`: which layers attend to everything and which through a sliding window, and
  whether the model takes one ready mask per layer type; tree verification needs it (ARCHITECTURE.md
  §8 "Verify masks").
- `LogitRule` / `target_logits`: the target's last hidden state -> its real logits (lm_head bias, Gemma-2
  soft-capping, Cohere's logit_scale, Granite's logits_scaling), so training learns the true next-token
  distribution.
"""
from __future__ import annotations

import inspect
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

import pipeline.cluster  # noqa: F401  (environment defaults, DeepSpeed's accelerator among them, before transformers)
from pipeline import storage

log = logging.getLogger(__name__)

# The configs' dtype names (pipeline/yaml_config.py ModelDtype, StorageDtype) -> torch's; fp8 is a storage
# codec only (pipeline/codec.py).
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class TargetSpec:
    """A target folder's facts, without loading its weights. `identity()` is what shards and regenerated
    records are stamped with, so later stages refuse the output of another target."""
    path: Path
    config: object               # the language model's config (text_config of the folder's config)
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int              # rows of the embedding / lm_head
    tokenizer_size: int          # len(tokenizer), special tokens included
    max_positions: int
    config_sha256: str
    chat_template_sha256: str
    weights_id: str

    @classmethod
    def read(cls, folder) -> "TargetSpec":
        import hashlib
        import json

        from transformers import AutoConfig, AutoTokenizer

        loc, folder = folder, storage.node_copy(folder)  # a URI's files copied to this node once
        full = AutoConfig.from_pretrained(folder)
        cfg = text_config(full)
        tok = AutoTokenizer.from_pretrained(folder)
        tmpl = tok.chat_template if isinstance(tok.chat_template, str) or tok.chat_template is None else \
            json.dumps(tok.chat_template, sort_keys=True)
        return cls(path=folder, config=cfg, architecture=(full.architectures or ["LlamaForCausalLM"])[0],
                   num_layers=cfg.num_hidden_layers, hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size,
                   tokenizer_size=len(tok), max_positions=int(getattr(cfg, "max_position_embeddings", None) or 4096),
                   config_sha256=hashlib.sha256((folder / "config.json").read_bytes()).hexdigest(),
                   chat_template_sha256=hashlib.sha256((tmpl or "").encode()).hexdigest(),
                   weights_id=weights_id(loc))

    def aux_layers(self, layer_ids: list[int] | None = None, key: str = "capture.layer_ids") -> list[int]:
        return resolve_aux_layers(self.num_layers, layer_ids, key)

    def identity(self) -> dict:
        """The fields a shard manifest carries about its target (docs/ARCHITECTURE.md §3)."""
        return {"target_config_sha256": self.config_sha256, "target_weights_id": self.weights_id,
                "hidden_size": self.hidden_size, "num_layers": self.num_layers,
                "chat_template_sha256": self.chat_template_sha256, "vocab_size": self.tokenizer_size}


def weights_id(target) -> str:
    """Identity of a target's weights without reading them: name, size and mtime of every weight file.
    A target retrained in place gets a new id, so regeneration and capture do not reuse stale output."""
    import hashlib

    h = hashlib.sha256()
    for name, size, mtime in storage.listing(target):  # a URI's: the store's times, alike on every node
        if "/" not in name and Path(name).suffix in (".safetensors", ".bin", ".gguf", ".pt"):
            h.update(f"{name}\t{size}\t{mtime}\n".encode())
    return h.hexdigest()[:32]


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 matmuls natively (AVX512-BF16 / AMX). Without it oneDNN emulates
    bf16, ~100x slower than fp32 (measured 0.9 vs 122 GFLOP/s on an AVX2 EPYC)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def auto_dtype(device: str) -> torch.dtype:
    """What "auto" means for a target's weights in every engine: bf16 on GPU, fp32 on CPU (many CPUs
    have no native bf16, and every CPU path then runs one model). vLLM's own "auto" would downcast an
    fp32 checkpoint to bf16 and decode another model (docs/ARCHITECTURE.md §4)."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def torch_dtype(name: str, device: str) -> torch.dtype:
    """A config's dtype name (fp32, bf16, fp16, auto) -> torch's; "auto" is `auto_dtype(device)`."""
    return auto_dtype(device) if name == "auto" else TORCH_DTYPES[name]


def load_model(target, dtype: str | torch.dtype = "auto", use_gpu: bool = False):
    """The one target loader: AutoModelForCausalLM from a folder, eval mode, on cuda when asked and
    present; dtype a config's name (`torch_dtype`) or torch's. -> (model, device)."""
    from transformers import AutoModelForCausalLM

    device = "cuda" if use_gpu and torch.cuda.is_available() else "cpu"
    if not isinstance(dtype, torch.dtype):
        dtype = torch_dtype(dtype, device)
    return AutoModelForCausalLM.from_pretrained(storage.node_copy(target), dtype=dtype).to(device).eval(), device


# Layer types transformers names in `config.layer_types` that a 4D verify mask can express.
FULL, SLIDING, CHUNKED = "full_attention", "sliding_attention", "chunked_attention"
MASKABLE = (FULL, SLIDING, CHUNKED)


def text_config(cfg):
    """The decoder's config: `get_text_config()` where transformers has it, else the config itself."""
    get = getattr(cfg, "get_text_config", None)
    return get() if callable(get) else (getattr(cfg, "text_config", None) or cfg)


def num_layers(cfg) -> int:
    return int(text_config(cfg).num_hidden_layers)


def decoder_layers(model) -> torch.nn.ModuleList:
    """The ModuleList of decoder blocks: the shortest-named ModuleList whose length is the config's
    num_hidden_layers (covers model.layers, transformer.h, model.language_model.layers, ...)."""
    n = num_layers(model.config)
    found = [(name, mod) for name, mod in model.named_modules()
             if isinstance(mod, torch.nn.ModuleList) and len(mod) == n and n > 0]
    if not found:
        raise ValueError(f"{type(model).__name__}: no ModuleList of its {n} decoder layers found; "
                         f"this model class is not supported as a target")
    found.sort(key=lambda x: (x[0].count("."), len(x[0])))
    return found[0][1]


def default_aux_layers(n: int) -> list[int]:
    """0-indexed decoder layers whose outputs are captured: [1, N//2-1, N-4] (SGLang / EAGLE rule) for
    N >= 7; below that the rule repeats layers, so the nearest three distinct ascending layers are used
    (N=3..6 -> [0,1,2] / [1,2,3]). Engines sort and de-duplicate ids, so repeats cannot be exported."""
    if n < 3:
        raise ValueError(f"a {n}-layer target has fewer than 3 decoder layers to capture aux states from")
    low = min(1, n - 3)
    mid = max(low + 1, n // 2 - 1)
    high = min(n - 1, max(mid + 1, n - 4))
    return [low, mid, high]


def resolve_aux_layers(n: int, layer_ids: list[int] | None, key: str = "capture.layer_ids") -> list[int]:
    """The one check on aux layer ids: three distinct, strictly ascending layers of an n-layer target."""
    if layer_ids is None:
        ids = default_aux_layers(n)
        if n < 7:
            log.warning("%d-layer target: the rule [1, N//2-1, N-4] repeats layers; capturing %s instead", n, ids)
        return ids
    ids = [int(j) for j in layer_ids]
    if len(ids) != 3:
        raise ValueError(f"{key}: need exactly 3 layers (low, mid, high), got {ids}")
    bad = [j for j in ids if not 0 <= j < n]
    if bad:
        raise ValueError(f"{key}: {bad} out of range for a {n}-layer target (default rule gives "
                         f"{default_aux_layers(n)})")
    if not ids[0] < ids[1] < ids[2]:
        raise ValueError(f"{key}: {ids} must be strictly ascending (engines sort and de-duplicate aux layers, "
                         f"so any other order feeds the head different features than it was trained on)")
    return ids


@dataclass(frozen=True)
class AttentionLayout:
    """Per decoder layer: its attention type and window (None: sees the whole prefix). `per_type` says
    the model takes a dict {layer type: 4D mask}; otherwise it takes one mask for every layer."""
    types: tuple[str, ...]
    windows: tuple[int | None, ...]
    per_type: bool

    @property
    def kinds(self) -> dict[str, int | None]:
        return dict(zip(self.types, self.windows))

    @property
    def uniform(self) -> bool:
        return len(set(self.types)) == 1


def _module_source(model) -> str:
    mod = sys.modules.get(type(model).__module__)
    try:
        return inspect.getsource(mod) if mod is not None else ""
    except (OSError, TypeError):
        return ""


def attention_layout(model) -> AttentionLayout:
    """Read the layer types and windows the model's own mask builders use (transformers 5: the model
    either builds {layer type: mask} and accepts such a dict as `attention_mask`, or builds one mask,
    sliding when `config.sliding_window` is set). Refuses types a verify mask cannot express."""
    cfg = text_config(model.config)
    n = num_layers(cfg)
    src = _module_source(model)
    per_type = "causal_mask_mapping := attention_mask" in src
    window = getattr(cfg, "sliding_window", None)
    chunk = getattr(cfg, "attention_chunk_size", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:
        sliding = window is not None and "create_sliding_window_causal_mask" in src
        types = [SLIDING if sliding else FULL] * n
    types = list(types)[:n]
    unknown = sorted(set(types) - set(MASKABLE))
    if unknown:
        raise ValueError(f"{type(model).__name__}: layer types {unknown} (recurrent or linear attention) keep a "
                         f"state that tree verification cannot branch and roll back; not supported as a target")
    if len(set(types)) > 1 and not per_type:
        raise ValueError(f"{type(model).__name__}: mixes {sorted(set(types))} layers but builds one mask for all; "
                         f"a verify mask cannot be given per layer, so it is not supported as a target")
    windows = [window if t == SLIDING else chunk if t == CHUNKED else None for t in types]
    if any(t != FULL and w is None for t, w in zip(types, windows)):
        raise ValueError(f"{type(model).__name__}: {SLIDING}/{CHUNKED} layers without a sliding_window / "
                         f"attention_chunk_size in the config")
    return AttentionLayout(tuple(types), tuple(windows), per_type)


@dataclass(frozen=True)
class LogitRule:
    """How the target turns its final hidden state into logits beyond `h @ W.T`: an lm_head bias is a
    tensor passed alongside; these are the config-driven transforms transformers applies after it."""
    softcap: float | None = None     # Gemma-2/3: cap * tanh(logits / cap)
    scale: float = 1.0               # Cohere logit_scale (multiply); Granite 1 / logits_scaling

    @classmethod
    def of(cls, cfg) -> "LogitRule":
        cfg = text_config(cfg)
        scale = float(getattr(cfg, "logit_scale", None) or 1.0)
        div = getattr(cfg, "logits_scaling", None)
        if div:
            scale /= float(div)
        return cls(getattr(cfg, "final_logit_softcapping", None), scale)


def target_logits(last_hidden: torch.Tensor, lm_weight: torch.Tensor, lm_bias: torch.Tensor | None,
                  rule: LogitRule, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The target's logits from its final-norm hidden state [N, H] (what its lm_head consumes).
    out_dtype: the GEMM's output dtype when it differs from its inputs' (aten::mm.dtype, GPU only)."""
    if out_dtype is None:
        logits = last_hidden @ lm_weight.T
    else:
        logits = torch.mm(last_hidden, lm_weight.T, out_dtype=out_dtype)
    if lm_bias is not None:
        logits = logits + lm_bias
    if rule.scale != 1.0:
        logits = logits * rule.scale
    if rule.softcap:
        logits = torch.tanh(logits / rule.softcap) * rule.softcap
    return logits
