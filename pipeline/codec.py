"""The hidden-state byte codec of the shards (ARCHITECTURE.md §3): a [T, D] tensor <-> little-endian bytes
in the storage dtype (bf16, fp16, fp32, or fp8 e4m3 with per-token-and-group fp32 scales).
"""
from __future__ import annotations

import numpy as np
import torch

from pipeline.target import TORCH_DTYPES


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
