"""A packed Llama-shaped decoder layer in two TorchScript halves (docs/ARCHITECTURE.md "Scripted layer").

On a small target most of a decode step that is not the weights' matmuls is per-op overhead: ~35 tiny
kernels a layer (RMSNorm alone is 8), each paying Python dispatch. TorchScript runs the same ATen ops in the
same order, so the bits are HF's (`LeanTarget` checks them on a probe and falls back otherwise), with the
Python side of every op gone. The attention stays in Python between the halves: its exact verify groups
rows in ways a script would only repeat (infer/exact_attention.py).

The ops mirror transformers' modules: `LlamaRMSNorm` (fp32 statistics, cast back, then the weight), the
rotation `x * cos + rotate_half(x) * sin`, and the MLP `down(silu(gate) * up)`.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F


@torch.jit.script
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, op for op."""
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(x.dtype)


@torch.jit.script
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """x @ W.T + b with W packed by `torch.ops.mkldnn._reorder_linear_weight` (infer/packed_linear.py)."""
    no_scalars: List[Optional[number]] = []  # noqa: F821 - TorchScript's `number` type
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", no_scalars, "")


@torch.jit.script
def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotation `x * cos + rotate_half(x) * sin`, op for op (so bit for bit), on x [1, n, heads, D]
    with cos, sin [1, n, 1, D]: q and k heads side by side in one pass."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


@torch.jit.script
def attention_inputs(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, qkv: torch.Tensor,
                     qkv_bias: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor, heads: int,
                     kv_heads: int, head_dim: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [1, n, H] -> q [1, heads, n, D], k, v [1, kv_heads, n, D]: input norm, packed q|k|v, q and k
    rotated together (cos, sin [1, n, 1, D])."""
    n = x.shape[1]
    out = packed_linear(rms_norm(x, norm_weight, eps), qkv, qkv_bias)
    nqk = (heads + kv_heads) * head_dim
    qk = rope_rows(out[..., :nqk].view(1, n, heads + kv_heads, head_dim), cos, sin)
    v = out[..., nqk:].view(1, n, kv_heads, head_dim).transpose(1, 2)
    return qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), v


@torch.jit.script
def output_and_mlp(x: torch.Tensor, attn: torch.Tensor, o: torch.Tensor, o_bias: Optional[torch.Tensor],
                   norm_weight: torch.Tensor, eps: float, gate_up: torch.Tensor,
                   gate_up_bias: Optional[torch.Tensor], down: torch.Tensor,
                   down_bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The rest of the layer: x + o(attn), then + down(silu(gate) * up) of its post-attention norm."""
    x = x + packed_linear(attn, o, o_bias)
    gate, up = packed_linear(rms_norm(x, norm_weight, eps), gate_up, gate_up_bias).chunk(2, dim=-1)
    return x + packed_linear(F.silu(gate) * up, down, down_bias)
