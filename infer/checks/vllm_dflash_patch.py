"""A documented correction to vLLM 0.32's CPU build for DFlash heads of more than one layer.

`DFlashQwen3Model._normalize_context_k` (vllm/model_executor/models/qwen3_dflash.py) norms the context keys of
every draft layer in one `ops.rms_norm` call over [L, ctx, kv_heads, head_dim] with the layers' k_norm
weights stacked as [L, head_dim]. The CPU kernel reads one weight row for all rows, so every layer's
context keys are normed with layer 0's weight (max error 1.37 on a random case here, 2.09 as first
reported): a head of 2+ layers silently drafts worse than it was trained to. The correction runs the same
kernel once per layer with that layer's weight. `apply()` patches the class in this process (the runner's
engine runs in-process); tests/test_vllm_interop.py checks that stock vLLM still needs it and that the
patched method equals the per-layer reference. Imports only vLLM and torch (the runner's environment).
"""
from __future__ import annotations


def per_layer_normalize_context_k(self, all_k):
    """[L, ctx, kv, d] keys -> each layer's keys normed with that layer's k_norm weight."""
    import torch
    from vllm import _custom_ops as ops

    out = torch.empty_like(all_k)
    for i in range(all_k.shape[0]):
        ops.rms_norm(out[i], all_k[i].contiguous(), self._k_norm_weights[i].contiguous(), self._rms_norm_eps)
    return out


def needed() -> bool:
    """True when this vLLM's stock method norms a 2-layer case wrongly on this platform."""
    import torch
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 2, 16, generator=gen)
    probe = type("Probe", (), {"_k_norm_weights": torch.rand(2, 16, generator=gen) + 0.5, "_rms_norm_eps": 1e-6})()
    stock = DFlashQwen3Model._normalize_context_k(probe, k)
    return not torch.allclose(stock, per_layer_normalize_context_k(probe, k), atol=1e-5)


def apply() -> bool:
    """Patch DFlashQwen3Model in this process when its stock method is wrong here; returns whether it did."""
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    if getattr(DFlashQwen3Model, "_eagleray_patched", False):
        return True
    if not needed():
        return False
    DFlashQwen3Model._normalize_context_k = per_layer_normalize_context_k
    DFlashQwen3Model._eagleray_patched = True
    return True
