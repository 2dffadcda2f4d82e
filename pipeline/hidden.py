"""Target capture rule (ARCHITECTURE.md §3): fused low/mid/high residual states and the final-norm output.

Aux states are the outputs of decoder layers [1, N//2-1, N-4] (HF hidden_states[j+1], the rule lives in
pipeline/target.py); `last_hidden` is what the lm_head consumes. Forward hooks on the decoder layers take
them from any Hugging Face causal LM without a patched class.
The base model is run without the lm_head, so capture costs no more than a bare forward.
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.target import TORCH_DTYPES, decoder_layers


@torch.no_grad()
def capture_hidden(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                   layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (aux [B, T, 3H] low|mid|high, last [B, T, H]) in the model's dtype."""
    layers = decoder_layers(model)  # refuses, naming the class, when there are none
    base = getattr(model, "base_model", None)
    if base is None or base is model:
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


class StorageOverflow(ValueError):
    """A hidden state does not fit the storage dtype (fp16 overflows past 65504)."""


FP8_MAX = 448.0  # largest finite float8_e4m3fn


def bytes_per_token(dtype: str, width: int, groups: int = 1) -> int:
    """Raw stored bytes of one token's row of `width` values (fp8: one byte a value + an fp32 scale per group)."""
    return width + 4 * groups if dtype == "fp8" else width * (4 if dtype == "fp32" else 2)


def to_bytes(t: torch.Tensor, dtype: str, groups: int = 1) -> bytes:
    """A [T, D] tensor as little-endian raw bytes of the storage dtype; refuses values the dtype turns
    into inf (fp16's range is +-65504: large-activation targets overflow it, bf16 keeps fp32's range).
    fp8: e4m3 with one fp32 scale per token and group (aux: one per layer, groups=3, their magnitudes
    differ), laid out as [T, groups] scales then [T, D] fp8 bytes."""
    t = t.detach()
    if dtype == "fp8":
        return _fp8_bytes(t, groups)
    stored = t.to(TORCH_DTYPES[dtype]).contiguous().cpu()
    if stored.is_floating_point() and not bool(torch.isfinite(stored).all()):
        worst = float(t.float().abs().nan_to_num(posinf=float("inf")).max())
        raise StorageOverflow(f"hidden state does not fit {dtype} (max |x| = {worst:.4g}); capture with "
                              f"capture.dtype: bf16")
    if dtype == "bf16":  # numpy has no bf16: move the bits as int16
        return stored.view(torch.int16).numpy().astype("<i2", copy=False).tobytes()
    return stored.numpy().astype("<f2" if dtype == "fp16" else "<f4", copy=False).tobytes()


def _fp8_bytes(t: torch.Tensor, groups: int) -> bytes:
    x = t.float().cpu()
    if not bool(torch.isfinite(x).all()):
        raise StorageOverflow("hidden state holds inf/nan; nothing can store it")
    rows, width = x.shape
    g = x.view(rows, groups, width // groups)
    scale = (g.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    q = (g / scale).to(torch.float8_e4m3fn).view(torch.uint8).reshape(rows, width)
    return scale.reshape(rows, groups).numpy().astype("<f4").tobytes() + q.numpy().tobytes()


def from_bytes(buf: bytes, dtype: str, width: int, groups: int = 1) -> torch.Tensor:
    """Inverse of to_bytes: -> [T, width] tensor of the storage dtype (fp8: dequantised to fp32)."""
    if dtype == "fp8":
        rows = len(buf) // (width + 4 * groups)
        scale = torch.from_numpy(np.frombuffer(buf, dtype="<f4", count=rows * groups).copy()).view(rows, groups, 1)
        q = np.frombuffer(buf, dtype=np.uint8, offset=rows * groups * 4).reshape(rows, groups, width // groups)
        return (torch.from_numpy(q.copy()).view(torch.float8_e4m3fn).float() * scale).reshape(rows, width)
    if dtype == "bf16":
        arr = np.frombuffer(buf, dtype="<i2").reshape(-1, width)
        return torch.from_numpy(arr.copy()).view(torch.bfloat16)
    arr = np.frombuffer(buf, dtype="<f2" if dtype == "fp16" else "<f4").reshape(-1, width)
    return torch.from_numpy(arr.copy())


@torch.no_grad()
def check_logit_rule(model, layer_ids: list[int], tokens: int = 12) -> float:
    """Refuse a target whose logits are not `target_logits(last_hidden)` (pipeline/target.py): training
    would learn another distribution than the one decoding verifies against. Returns the max abs error."""
    from pipeline.target import LogitRule, target_logits, text_config

    device = next(model.parameters()).device
    ids = (torch.arange(tokens, device=device)[None] * 7 + 3) % text_config(model.config).vocab_size
    _, last = capture_hidden(model, ids, None, layer_ids)
    head = model.get_output_embeddings()
    ours = target_logits(last.float(), head.weight.float(), None if getattr(head, "bias", None) is None
                         else head.bias.float(), LogitRule.of(model.config))
    theirs = model(input_ids=ids, use_cache=False).logits.float()
    err = float((ours - theirs).abs().max())
    if not err <= 1e-3 * max(1.0, float(theirs.abs().max())):
        raise ValueError(f"{type(model).__name__}: its logits differ from lm_head(last_hidden) under the known "
                         f"transforms (bias, soft-capping, logit scale) by {err:.3g}; this target transforms its "
                         f"logits in a way EagleRay does not model, so a head trained on it would learn the wrong "
                         f"distribution")
    return err
