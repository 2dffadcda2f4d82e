"""The target side of speculative decoding: any HF causal LM on its own KV cache, with aux capture.

The aux states (the pipeline's capture rule) come out of prefill and every tree verify, so the draft never
needs a second pass over the target: from the layer loop of the lean forward (Llama-shaped targets,
infer/cpu/lean.py) or from forward hooks on the decoder layers of any other HF model. Verify
masks follow the target's attention layout (docs/ARCHITECTURE.md §8 "Verify masks"): a sliding-window
layer must not see more of the prefix during verify than it does in prefill and in HF generate.
"""
from __future__ import annotations

import inspect

import torch

from infer import cpu
from infer.tree import Tree, verify_mask
from pipeline.hidden import AuxTap
from pipeline.target import CHUNKED, SLIDING, attention_layout


class TargetRunner:
    """One target behind one interface: `new_cache`, `forward`, `compact`. Llama-shaped targets run the
    lean forward (infer/cpu/lean.py) unless cpu_path is "generic"; every other family runs the HF forward
    on a `DynamicCache` with hooks for the aux states. `path` says which runs and why (infer/cpu)."""

    def __init__(self, model, aux_layer_ids: list[int], cpu_path: str = "auto", exact_verify: bool = True):
        self.model = model.eval()
        self.aux_layer_ids = list(aux_layer_ids)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.layout = attention_layout(model)  # refuses recurrent / unmaskable layouts up front
        self.lean, self.path = cpu.choose_target(model, self.aux_layer_ids, cpu_path, exact_verify)
        self.tap = AuxTap(model, self.aux_layer_ids) if self.lean is None else None
        # Prefill needs the last position's logits only; a full-vocab lm_head over a long prompt is a
        # large share of the prefill (SmolLM2: 49k x 576 per token). HF generate skips it the same way.
        self.keeps_last = "logits_to_keep" in inspect.signature(model.forward).parameters

    def verify_masks(self, tree: Tree, prefix_len: int):
        """The attention_mask argument for verifying `tree`: one 4D mask, or {layer type: 4D mask}."""
        def one(kind: str, window: int | None) -> torch.Tensor:
            return verify_mask(tree, prefix_len, self.dtype, window if kind == SLIDING else None,
                               window if kind == CHUNKED else None).to(self.device)
        kinds = self.layout.kinds
        if self.layout.per_type:
            return {kind: one(kind, w) for kind, w in kinds.items()}
        (kind, w), = kinds.items()  # attention_layout refused mixed layouts without per-type masks
        return one(kind, w)

    def new_cache(self):
        """An empty KV cache for one sequence (the lean path's own, or a transformers DynamicCache)."""
        if self.lean is not None:
            return self.lean.new_cache()
        from transformers import DynamicCache
        return DynamicCache()

    def compact(self, cache, src: torch.Tensor, dst: torch.Tensor, new_len: int) -> None:
        """Keep the accepted path: K/V rows src -> dst slots, the cache cut to new_len."""
        if self.lean is not None:
            cache.compact(src, dst, new_len)
        else:
            compact_cache(cache, src, dst, new_len)

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache, mask=None, last_only: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions [n] -> (logits [n, V] fp32, or [1, V] for the last position when last_only;
        aux [n, 3H]); appends n rows to `cache`. mask: None (causal, the model builds it) or what
        `verify_masks` returns."""
        if self.lean is not None:
            tokens, positions = tokens.to(self.device), positions.to(self.device)
            return self.lean.forward(tokens, positions, cache, mask, last_only)
        keep = {"logits_to_keep": 1} if last_only and self.keeps_last else {}
        out = self.model(input_ids=tokens[None].to(self.device), position_ids=positions[None].to(self.device),
                         attention_mask=mask, past_key_values=cache, use_cache=True, **keep)
        logits = out.logits[0, -1:] if last_only else out.logits[0]
        return logits.float(), self.tap.states()[0]


def compact_cache(cache, src: torch.Tensor, dst: torch.Tensor, new_len: int) -> None:
    """Move the accepted path's K/V rows (src -> dst slots) in every layer, then drop the rest.
    Writes each layer's `keys` / `values` (transformers 5's cache layers); this is the one place that does."""
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", True) or layer.keys is None:
            continue
        s, d = src.to(layer.keys.device), dst.to(layer.keys.device)
        layer.keys = layer.keys.index_copy_(2, d, layer.keys.index_select(2, s))[:, :, :new_len]
        layer.values = layer.values.index_copy_(2, d, layer.values.index_select(2, s))[:, :, :new_len]
