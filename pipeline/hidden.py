"""Target capture rule (DESIGN §3): fused low/mid/high residual states and the final-norm output.

Aux states are the outputs of decoder layers [1, N//2-1, N-4] (HF hidden_states[j+1]); `last_hidden` is
what the lm_head consumes. Forward hooks on the decoder layers take them from any Hugging Face causal
LM without a patched class; models whose layers cannot be found fall back to output_hidden_states.
The base model is run without the lm_head, so capture costs no more than a bare forward.
"""
from __future__ import annotations

import numpy as np
import torch

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def default_aux_layers(num_layers: int) -> list[int]:
    """0-indexed decoder layers whose outputs are captured: low, mid, high."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def resolve_aux_layers(num_layers: int, layer_ids: list[int] | None) -> list[int]:
    ids = list(layer_ids) if layer_ids is not None else default_aux_layers(num_layers)
    if len(ids) != 3:
        raise ValueError(f"capture.layer_ids: need exactly 3 layers (low, mid, high), got {ids}")
    bad = [j for j in ids if not 0 <= j < num_layers]
    if bad:
        raise ValueError(f"capture.layer_ids: {bad} out of range for a {num_layers}-layer target "
                         f"(default rule gives {default_aux_layers(num_layers)})")
    return ids


def decoder_layers(model) -> torch.nn.ModuleList | None:
    base = getattr(model, model.base_model_prefix, None) if hasattr(model, "base_model_prefix") else None
    for owner in (base, getattr(model, "model", None), model):
        layers = getattr(owner, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    return None


@torch.no_grad()
def capture_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (aux [B, T, 3H] low|mid|high, last [B, T, H]) in the model's dtype."""
    layers = decoder_layers(model)
    base = getattr(model, model.base_model_prefix, None)
    if layers is None or base is None:
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                    use_cache=False)
        hs = out.hidden_states
        return torch.cat([hs[j + 1] for j in layer_ids], dim=-1), hs[-1]
    grabbed: dict[int, torch.Tensor] = {}

    def hook(idx):
        def fn(_module, _inputs, output):
            grabbed[idx] = output[0] if isinstance(output, tuple) else output
        return fn

    handles = [layers[j].register_forward_hook(hook(j)) for j in layer_ids]
    try:
        out = base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return torch.cat([grabbed[j] for j in layer_ids], dim=-1), out.last_hidden_state


def to_bytes(t: torch.Tensor, dtype: str) -> bytes:
    """A [T, D] tensor as little-endian raw bytes of the storage dtype."""
    t = t.detach().to(TORCH_DTYPES[dtype]).contiguous().cpu()
    if dtype == "bf16":  # numpy has no bf16: move the bits as int16
        return t.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    return t.numpy().astype("<f2" if dtype == "fp16" else "<f4", copy=False).tobytes()


def from_bytes(buf: bytes, dtype: str, width: int) -> torch.Tensor:
    """Inverse of to_bytes: -> [T, width] tensor of the storage dtype."""
    if dtype == "bf16":
        arr = np.frombuffer(buf, dtype="<i2").reshape(-1, width)
        return torch.from_numpy(arr.copy()).view(torch.bfloat16)
    arr = np.frombuffer(buf, dtype="<f2" if dtype == "fp16" else "<f4").reshape(-1, width)
    return torch.from_numpy(arr.copy())
